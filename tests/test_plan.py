"""`flowrl plan`: cost models fitted on a real tiny run, the simulation (the real runtime on a
virtual clock) against that run, the direction of each change, a runtime rule changed under it,
search and JSON output, and located errors through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.cli import main
from flowrl.plan import plan_run
from flowrl.plan.cpu import MAIN, Cpu, Load
from flowrl.plan.fit import iterations, nonneg_fit
from flowrl.plan.solo import solo_work
from flowrl.spec.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def tiny_run(parent: Path, pipeline: str, *overrides: str) -> Path:
    """`pipeline` on the tiny model, 8 steps of 8 groups, through the real CLI."""
    run_dir = parent / Path(pipeline).stem
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "run", str(ROOT / "pipelines" / pipeline),
                           "run.steps=8", "data.batch_size=8", *overrides, "--run-dir", str(run_dir), "--quiet"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory) -> Path:
    return tiny_run(tmp_path_factory.mktemp("plan"), "grpo_sync.yaml")


@pytest.fixture(scope="module")
def async_run(tmp_path_factory) -> Path:
    """score -> learner async, max_staleness 2."""
    return tiny_run(tmp_path_factory.mktemp("plan"), "grpo_async.yaml")


# ---- the pieces ----------------------------------------------------------------------------------

def test_the_slot_model_counts_iterations_rows_and_admitting_iterations():
    assert iterations([[3, 1], [2]], slots=8) == (3, 3 + 2 + 1, 1)  # all in at once: 3 rows, then 2, then 1
    assert iterations([[2, 2], [2, 2]], slots=2) == (4, 8, 2)  # two waves of two rows
    assert iterations([[2, 1, 2]], slots=2) == (3, 2 + 2 + 1, 2)  # the third row takes the freed slot


def test_the_stand_in_engine_pays_a_prefill_where_it_admits_rows_and_a_cost_per_row():
    import asyncio

    from flowrl.plan.fit import EngineCost
    from flowrl.plan.stages import Engine

    paid = []

    class Sim:
        scale = 1.0

        async def work(self, seconds: float, process: str = MAIN, lock: float = 1.0) -> None:
            paid.append(seconds)

    cost = EngineCost(slots=2, a=1.0, b=0.0, update_s=0.0, periods=1, p=10.0, r=100.0)
    asyncio.run(Engine(Sim(), cost, slots=2).decode([2, 1, 2]))
    # Two rows admitted and prefilled; the third in the slot the one-token row freed; then a decode.
    assert paid == [1 + 10 + 2 * 100, 1 + 10 + 100, 1]


def test_prefill_and_admission_costs_are_the_engines_own_counts():
    from types import SimpleNamespace

    from flowrl.plan.fit import step_shares

    def row(steps, prefills, admitted, seconds, prefill_s):
        counts = {"steps": steps, "prefill_steps": prefills, "admitted": admitted, "step_seconds": seconds,
                  "prefill_step_seconds": prefill_s}
        return {"operators": {"rollout": {f"engine/{k}": v for k, v in counts.items()}}}

    # Steady steps: 60 steps, 20 prefilling, taking 2 s of them (decoding steps 1 s / 40), 30 admitted;
    # the engine was busy 2.75 s: 0.75 s of bookkeeping, 0.025 s (one decoding step) a row.
    base = SimpleNamespace(rows=[row(0, 0, 0, 0.0, 0.0), row(10, 5, 8, 0.5, 0.25), row(70, 25, 38, 2.5, 1.25)])
    assert step_shares(base, "rollout", busy=2.75) == pytest.approx((1.0, 1.0))
    base.rows[-1]["operators"]["rollout"].pop("engine/admitted")
    assert step_shares(base, "rollout", busy=2.75) is None  # an engine that counts none (SGLang)


def test_the_fit_keeps_both_parts_non_negative():
    x = [(1.0, float(t)) for t in (10, 20, 30)]
    assert nonneg_fit(x, [2 + 0.5 * t for _, t in x]) == pytest.approx((2.0, 0.5))
    p, q = nonneg_fit(x, [5 - 0.01 * t for _, t in x])  # a negative slope: the slope is dropped
    assert q == 0.0 and p == pytest.approx(4.8)


def test_a_runs_engine_counts_weigh_its_prefills_and_without_them_iterations_take_all(grpo_run, tmp_path):
    import shutil

    from flowrl.plan import calibrate, records

    counted = calibrate(records.load(grpo_run), 2.0)
    engine = counted.engines["rollout"]
    assert engine.p > 0.2 * engine.a and engine.r > 0  # the tiny model: a prefill about doubles a step
    assert any("(the engine's counts)" in note for note in counted.notes)
    bare = tmp_path / "bare"
    shutil.copytree(grpo_run, bare)
    rows = [json.loads(line) for line in (bare / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        for counters in row.get("operators", {}).values():
            for key in [k for k in counters if k.startswith("engine/")]:
                del counters[key]
    (bare / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    plain = calibrate(records.load(bare), 2.0)
    assert plain.engines["rollout"].p == plain.engines["rollout"].r == 0.0
    assert plain.engines["rollout"].a > engine.a  # its iterations take the prefills' and rows' time
    assert any("the engine counts none" in note for note in plain.notes)


def test_a_multi_turn_engine_decodes_the_share_of_the_waits_its_counters_say():
    from types import SimpleNamespace

    from flowrl.plan.fit import wait_share
    from flowrl.plan.records import Span

    rows = [{"time": t, "operators": {"rollout": {"engine/step_seconds": s}}} for t, s in ((0, 0), (1, 0.5), (10, 2.5))]
    waits = [Span("rollout", 0, "generate", 1.0 + i, 5.0 + i, None, str(i)) for i in range(2)]  # 8 s of waits
    base = SimpleNamespace(rows=rows)
    assert wait_share(base, "rollout", waits) == pytest.approx(2.0 / 8.0)  # 2 s of steps in the steady steps
    rows[-1]["operators"]["rollout"].clear()
    assert wait_share(base, "rollout", waits) is None  # an engine that counts none


def test_lock_bound_jobs_take_turns_and_native_work_runs_beside_them():
    cpu = Cpu(cores=2)
    cpu.add(Load(MAIN, 1.0), 1.0, lambda: None)
    cpu.add(Load(MAIN, 1.0), 1.0, lambda: None)
    assert cpu.rates() == [0.5, 0.5]  # two interpreter-bound jobs of one process take turns
    cpu.jobs[1].load = Load(MAIN, 0.0)
    assert cpu.rates() == [1.0, 1.0]  # a job in native code runs on the other core
    cpu.add(Load("trainer", 1.0), 1.0, lambda: None)  # a process of its own: three jobs on two cores
    assert cpu.rates() == pytest.approx([2 / 3] * 3)
    # Two spans of one process that overlapped entirely did half the work each.
    assert solo_work([(Load(MAIN, 1.0), 0.0, 2.0), (Load(MAIN, 1.0), 0.0, 2.0), (Load("trainer", 1.0), 2.0, 3.0)],
                     2) == [1.0, 1.0, 1.0]


def test_an_oversubscribed_lock_loses_its_handoff_share():
    cpu = Cpu(cores=2, handoff=0.8)
    cpu.add(Load(MAIN, 1.0), 1.0, lambda: None)
    cpu.add(Load(MAIN, 0.5), 1.0, lambda: None)
    assert cpu.rates() == pytest.approx([0.8 / 1.5] * 2)  # the lock 1.5x oversubscribed, handed over at 0.8
    cpu.jobs[1].load = Load(MAIN, 0.0)
    assert cpu.rates() == [1.0, 1.0]  # not oversubscribed: nothing to hand over
    assert solo_work([(Load(MAIN, 1.0), 0.0, 2.0), (Load(MAIN, 1.0), 0.0, 2.0)], 2, handoff=0.8) == pytest.approx(
        [0.8, 0.8])


def test_the_groups_one_engine_decodes_share_its_thread_and_only_their_decoding_slows():
    """Multi-turn groups wait on their tools; their engine decodes a share of each wait, for all of
    them on one thread: together they hold the lock and a core at most once."""
    cpu = Cpu(cores=2)
    for _ in range(8):  # eight groups, their engine decoding 20 % of each one's wait
        cpu.add(Load(MAIN, 0.2, 0.2, 0.2, "rollout/0"), 1.0, lambda: None)
    assert cpu.rates() == [1.0] * 8  # 1.6 in all, but one thread: the lock held all the time, not 1.6x over
    cpu.add(Load(MAIN, 0.5), 1.0, lambda: None)  # a train step beside them: the lock 1.5x oversubscribed
    rate = 1 / 1.5
    assert cpu.rates()[-1] == pytest.approx(rate)
    assert cpu.rates()[0] == pytest.approx(1 / (0.8 + 0.2 / rate))  # only the decoding fifth of a wait slows


# ---- on a real run ------------------------------------------------------------------------------

def test_the_simulator_reproduces_the_run_it_was_fitted_on(grpo_run):
    result = plan_run(grpo_run, [])
    measured, simulated = result["measured"], result["simulated"]
    assert simulated["step_seconds"] == pytest.approx(measured["step_seconds"], rel=0.2)
    assert set(simulated["idle"]) == {"rollout", "score", "learner", "publish"}
    for node, idle in measured["idle"].items():
        assert abs(simulated["idle"][node] - idle) < 0.15, node
    assert list(simulated["staleness"]) == [0]  # a sync run trains on-policy
    assert any("engine iteration" in note for note in result["model"]["notes"])


def test_each_change_moves_the_prediction_its_way(grpo_run):
    simulated = plan_run(grpo_run, [])["simulated"]

    def predicted(*changes: str) -> dict:
        return plan_run(grpo_run, list(changes))["predicted"]

    assert predicted("data.batch_size=16")["step_seconds"] > 1.6 * simulated["step_seconds"]
    assert predicted("scale=3")["step_seconds"] > 2.5 * simulated["step_seconds"]
    stale = predicted("max_staleness=2")
    assert set(stale["staleness"]) <= {1, 2} and stale["idle"]["learner"] < simulated["idle"]["learner"]
    bigger = predicted("nodes.rollout.group_size=16")  # twice the rows per group: more engine time
    assert bigger["step_seconds"] > 1.3 * simulated["step_seconds"]


def test_plan_follows_the_runtimes_rules_and_keeps_none_of_its_own(grpo_run, monkeypatch):
    """The simulation runs the runtime's own coordinator: change a rule there and the prediction follows."""
    from flowrl.plan import lock
    from flowrl.runtime.admission import Admission
    from flowrl.runtime.channel import Channel

    # Handoffs free: the run's train lock is not learnt for its own (sync) scenario, so it takes turns
    # with generation, and overlapping them gains what neither holds the lock for (not handoff's loss).
    monkeypatch.setattr(lock, "handoff", lambda base: (1.0, "free here"))
    before = plan_run(grpo_run, ["max_staleness=2"])
    assert list(before["simulated"]["staleness"]) == [0] and 2 in before["predicted"]["staleness"]
    admitted = Admission.admitted  # admission one step further ahead: the sync run generates step t+1 meanwhile
    monkeypatch.setattr(Admission, "admitted", lambda self, version: admitted(self, version + 1))
    ahead = plan_run(grpo_run, [])["simulated"]
    assert 1 in ahead["staleness"] and ahead["step_seconds"] < 0.97 * before["simulated"]["step_seconds"]
    monkeypatch.setattr(Admission, "admitted", admitted)
    # A staleness rule that drops every record not of the trainer's own version: only fresh ones train.
    monkeypatch.setattr(Channel, "stale", lambda self, record, version: self.limit is not None and
                        record.version < version)
    dropped = plan_run(grpo_run, ["max_staleness=2"])["predicted"]
    assert set(dropped["staleness"]) <= {0} and dropped["samples_per_s"] < 0.8 * before["predicted"]["samples_per_s"]
    # on_stale=keep: the coordinator trains on what that rule calls stale instead of dropping it
    kept = plan_run(grpo_run, ["max_staleness=2", "on_stale=keep"])["predicted"]
    assert set(kept["staleness"]) - {0} and kept["samples_per_s"] > 1.2 * dropped["samples_per_s"]


def test_an_async_run_predicts_its_sync_configuration(async_run):
    result = plan_run(async_run, ["max_staleness=0"])
    assert set(result["measured"]["staleness"]) <= {0, 1, 2} and set(result["simulated"]["staleness"]) <= {1, 2}
    assert result["predicted"]["staleness"] == {0: sum(result["predicted"]["staleness"].values())}
    # Sync: generation and training no longer overlap, so the trainer waits longer for its batch.
    assert result["predicted"]["idle"]["learner"] > result["simulated"]["idle"]["learner"] + 0.1
    assert any("interpreter" in note for note in result["model"]["notes"])  # what the lock fit found, said
    assert 0.0 <= result["model"]["train_lock"] <= 1.0


def test_search_lists_fitting_configurations_best_first_as_json(grpo_run, capsys):
    assert main(["plan", str(grpo_run), "--search", "--max-replicas", "2", "--max-staleness", "2",
                 "--budget", "1.9", "--format", "json"]) == 0
    found = json.loads(capsys.readouterr().out)["search"]
    rows = found["configurations"]
    assert found["budget"] == {"cpus": 1.9}
    assert [r["samples_per_s"] for r in rows] == sorted((r["samples_per_s"] for r in rows), reverse=True)
    assert {(r["replicas"], r["max_staleness"]) for r in rows} == {(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)}
    assert all(r["cpus"] <= 1.9 for r in rows)
    assert main(["plan", str(grpo_run), "--search", "--max-replicas", "3", "--max-staleness", "0",
                 "--budget", "1.9"]) == 0  # a third replica (0.5 CPU more) does not fit
    out = capsys.readouterr().out
    assert "2 fit; best first" in out and "measured" in out and "simulated" in out


def test_text_output_shows_measured_simulated_and_predicted(grpo_run, capsys):
    assert main(["plan", str(grpo_run), "max_staleness=1"]) == 0
    out = capsys.readouterr().out
    assert "predicted with: max_staleness=1" in out
    header = next(line for line in out.splitlines() if "measured" in line)
    assert header.split() == ["measured", "simulated", "predicted"]
    assert "1:100%" in out.splitlines()[-1]  # one-step-off: every sample one version old


@pytest.mark.parametrize("override, words", [
    ("foo=1", "plan cannot simulate 'foo'; it simulates data.batch_size"),
    ("nodes.learner.resources.replicas=2", "plan simulates replicas of generate and reward/transform nodes"),
    ("nodes.nope.group_size=2", "no node 'nope' (nodes: rollout, score, learner, publish)"),
    ("nodes.score.group_size=2", "'group_size' is a key of generate nodes; 'score' is a reward node"),
    ("data.batch_size=0", "expected an integer >= 1"),
    ("nodes.rollout.loss.kind=cispo", "plan cannot simulate 'nodes.rollout.loss.kind'"),
    ("max_staleness", "expected key=value"),
    ("on_stale=maybe", "expected drop or keep"),
])
def test_an_override_plan_cannot_simulate_is_a_located_error(grpo_run, override, words, capsys):
    assert main(["plan", str(grpo_run), override]) == 1
    err = capsys.readouterr().err
    assert words in err and f"override {override!r}" in err and "Traceback" not in err


def test_a_directory_that_is_not_a_run_is_a_located_error(tmp_path, capsys):
    assert main(["plan", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path} is not a run directory" in err and "Traceback" not in err
    assert main(["plan", str(tmp_path / "missing")]) == 1
    assert "is not a directory" in capsys.readouterr().err


def test_a_run_without_its_trace_says_what_is_missing(grpo_run, tmp_path, capsys):
    copy = tmp_path / "run"
    copy.mkdir()
    for name in ("plan.json", "metrics.jsonl", "meta.json"):
        (copy / name).write_bytes((grpo_run / name).read_bytes())
    assert main(["plan", str(copy)]) == 1
    assert f"{copy / 'trace.json'} is missing" in capsys.readouterr().err


def test_a_run_plan_does_not_model_is_refused_saying_why(grpo_run, tmp_path, capsys):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(grpo_run, copy)
    meta = json.loads((copy / "meta.json").read_text())
    (copy / "meta.json").write_text(json.dumps({**meta, "executor": "ray"}))
    assert main(["plan", str(copy)]) == 1
    assert "the run used the Ray executor; plan models the in-process one" in capsys.readouterr().err


def test_groups_with_more_trajectories_than_group_size_wait_on_their_environment(grpo_run):
    """A multi-turn group (one trajectory per turn) keeps its measured span as its wait: the tail of
    episode times is what the simulator resamples (the long-tail task)."""
    from flowrl.plan import records
    from flowrl.plan.fit import group_pool

    base = records.load(grpo_run)
    spans = [s for s in base.spans if s.name == "generate" and s.step is not None and s.step >= records.WARMUP]
    assert all(wait == 0.0 for _, wait in group_pool(base, "rollout", spans, []))  # single-turn: the engine only
    base.plan.nodes["rollout"].config = {**base.plan.nodes["rollout"].config, "group_size": 4}  # 8 > 4: multi-turn
    notes: list[str] = []
    pool = group_pool(base, "rollout", spans, notes)
    assert sorted(w for _, w in pool) == sorted(s.seconds for s in spans)
    assert notes and notes[0].startswith("rollout: multi-turn groups: waits p50")


def test_the_other_keys_are_read(grpo_run, capsys):
    result = plan_run(grpo_run, ["run.steps=6"])
    assert result["predicted"]["staleness"] == {0: 7 * 4 * 8}  # 7 repeats of 6 steps (40+), 4 steady, 8 groups
    slots = plan_run(grpo_run, ["nodes.rollout.slots=8"])  # a quarter of the slots: never faster
    assert slots["predicted"]["step_seconds"] >= 0.98 * slots["simulated"]["step_seconds"]
    partial = plan_run(grpo_run, ["max_staleness=1", "nodes.rollout.partial_rollout=true"])["predicted"]
    assert set(partial["staleness"]) <= {0, 1}  # weights may change mid-group: version at its start
    assert main(["plan", str(grpo_run), "nodes.rollout.partial_rollout=3"]) == 1
    assert "expected true or false" in capsys.readouterr().err
    assert main(["plan", str(grpo_run), "run.steps=3"]) == 1
    assert "expected an integer >= 4" in capsys.readouterr().err


# ---- what plan reads: the cost shapes operators declare -------------------------------------------

LANES = '''
"""A generate node whose engine's slots are its config's `lanes` (the built-in calls them engine.max_batch)."""
import msgspec

from flowrl.operator import CostShape
from flowrl_operators.config import GenerateConfig
from flowrl_operators.generate import Generate


class LanesConfig(GenerateConfig):
    lanes: int = 32


class LaneGenerate(Generate):
    """The built-in generate node, its slots declared from `lanes`."""

    Config = LanesConfig

    @classmethod
    def cost_shape(cls, config):
        return msgspec.structs.replace(super().cost_shape(config), slots=config.lanes)
'''


@pytest.fixture
def lanes_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """LaneGenerate as an installed distribution (package + dist-info) on sys.path, by entry point."""
    from flowrl import plugins

    site = tmp_path / "site"
    (site / "acme_lanes").mkdir(parents=True)
    (site / "acme_lanes/__init__.py").write_text(LANES)
    info = site / "acme_lanes-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-lanes\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[flowrl.operators]\nlane_generate = acme_lanes:LaneGenerate\n")
    monkeypatch.syspath_prepend(str(site))
    plugins.targets.cache_clear()
    yield site
    monkeypatch.undo()
    plugins.targets.cache_clear()


def test_plan_reads_the_slots_a_plugin_declares_under_its_own_key(grpo_run, lanes_plugin, tmp_path):
    """The run's generate node swapped for a plugin whose slots are `lanes`: plan fits and predicts
    with them; the built-in's key for slots is nothing to it."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(grpo_run, copy)
    plan = json.loads((copy / "plan.json").read_text())
    plan["nodes"]["rollout"] |= {"op": "lane_generate", "config": plan["nodes"]["rollout"]["config"] | {"lanes": 2}}
    (copy / "plan.json").write_text(json.dumps(plan))
    narrow = plan_run(copy, ["nodes.rollout.lanes=2"])
    assert narrow["predicted"] == narrow["simulated"]  # lanes as the run had them: the same simulation
    wide = plan_run(copy, ["nodes.rollout.lanes=64"])["predicted"]
    assert wide["step_seconds"] < 0.9 * narrow["simulated"]["step_seconds"]  # 64 rows a step, not 2
    assert wide == plan_run(copy, ["nodes.rollout.slots=64"])["predicted"]  # the same field of its shape
    with pytest.raises(UserError, match="nodes.rollout.sampling.temperature': it changes nothing in the cost shape"):
        plan_run(copy, ["nodes.rollout.sampling.temperature=0.5"])


def test_overrides_set_the_declared_shape_not_config_keys_plan_knows():
    from flowrl.graph.compile import compile_file
    from flowrl.plan.changes import apply
    from flowrl.plan.shapes import processes

    plan = compile_file(str(ROOT / "pipelines/grpo_sync.yaml"), ["nodes.rollout.engine={max_batch: 16}"]).plan
    scenario = apply(plan, [], 10)
    assert (scenario.shapes["rollout"].slots, scenario.shapes["rollout"].group_size) == (16, 8)
    assert scenario.shapes["score"].concurrency == 16 and processes(scenario.plan, scenario.shapes) == {}
    changed = apply(plan, ["nodes.rollout.engine.max_batch=4", "nodes.score.concurrency=2",
                           "nodes.learner.own_process={threads: 2}", "nodes.rollout.max_concurrency=3"], 10)
    assert changed.shapes["rollout"].slots == 4 and changed.shapes["rollout"].concurrency == 3
    assert changed.shapes["score"].concurrency == 2
    assert processes(changed.plan, changed.shapes) == {"learner": 2.0}  # a trainer in a process of its own
    assert plan.nodes["rollout"].config["engine"]["max_batch"] == 16  # the run's plan is left as it was


def test_engine_threads_speed_its_per_row_work_with_the_cores_they_get(grpo_run):
    from flowrl.graph.compile import compile_file
    from flowrl.plan import calibrate, predict, records
    from flowrl.plan.changes import apply
    from flowrl.plan.shapes import engine_cores

    plan = compile_file(str(ROOT / "pipelines/grpo_sync.yaml"), []).plan  # 2 cpus, engine threads 1
    two = "nodes.rollout.engine={kind: embedded, threads: 2}"
    own = "nodes.learner.own_process={threads: 1}"
    cores = {tuple(c): engine_cores(s.plan, "rollout", 2.0, s.shapes)
             for c in ([], [two], ["nodes.rollout.engine={kind: embedded, threads: 4}"], [two, own])
             for s in [apply(plan, list(c), 10)]}
    assert list(cores.values()) == [1.0, 2.0, 2.0, 1.0]  # at most the cores, less a trainer's own process
    base = records.load(grpo_run)
    costs = calibrate(base, 2.0)
    engine = costs.engines["rollout"]
    assert engine.cores == 1.0  # what the run's engine had: its one thread
    engine.a, engine.b = 1e-4, 2e-4  # engine iterations dominated by their per-row work
    costs.parallel["rollout"] = 1.0  # linear, not timed here (threads.py): the share of the cores is tested

    def step(*changes: str) -> float:
        return predict(apply(base.plan, list(changes), 8), costs, 2.0)["step_seconds"]

    alone, threaded = step(), step(two)
    assert threaded < 0.8 * alone  # two threads on an idle second core: faster engine iterations
    assert step(two, own) == pytest.approx(step(own), rel=0.02)  # the trainer's process holds that core
    assert plan_run(grpo_run, [two])["predicted"]["step_seconds"] <= plan_run(grpo_run, [])["simulated"][
        "step_seconds"] * 1.02  # the override is accepted, and never slows the run


def with_locks(run: Path, into: Path, lock: float | None) -> Path:
    """A copy of `run` whose train spans measured `lock` (None: no measurement, as before the probe)."""
    import shutil

    shutil.copytree(run, into)
    trace = json.loads((into / "trace.json").read_text())
    for event in trace["traceEvents"]:
        if event.get("name") == "train" and event.get("ph") == "X":
            event["args"].pop("lock", None)
            if lock is not None:
                event["args"]["lock"] = lock
    (into / "trace.json").write_text(json.dumps(trace))
    return into


def timed_by(timer):
    """registry.resolve giving the real operators, their pass timed by `timer` (a plugin's own
    pass_timer: threads -> seconds; None: the operator times none)."""
    from flowrl import registry

    real = registry.resolve
    return lambda op: type("Timed", (real(op),), {"pass_timer": classmethod(lambda cls, m, r, n: timer)})


def test_a_sync_run_is_planned_with_the_lock_share_outside_its_timed_pass(grpo_run, tmp_path, monkeypatch):
    """A sync run never overlaps training with generation, so the lock share of a train step is its
    time outside the forward and backward pass its operator times here (lock.py); the less it holds,
    the more async overlaps. Where nothing can be timed: the lock probe in its spans
    (runtime/lockprobe.py), else 1 (the stages take turns)."""
    from statistics import mean

    from flowrl import registry
    from flowrl.plan import lock, records, threads

    step = mean(s.seconds for s in lock.main_process_trains(records.load(grpo_run)))

    def planned(timer, run: Path = grpo_run) -> dict:
        monkeypatch.setattr(registry, "resolve", timed_by(timer))
        monkeypatch.setattr(threads, "_SECONDS", {})
        return plan_run(run, ["max_staleness=1"])

    held, free = planned(lambda n: step / 4), planned(lambda n: 0.9 * step)
    assert held["model"]["train_lock"] == pytest.approx(0.75) and free["model"]["train_lock"] == pytest.approx(0.1)
    assert any("its time outside the forward and backward pass" in n for n in held["model"]["notes"])
    assert free["predicted"]["step_seconds"] < 0.95 * held["predicted"]["step_seconds"]
    assert planned(lambda n: 2 * step)["model"]["train_lock"] == 0.0  # a pass timed longer than the step: clipped

    trains = [e for e in json.loads((grpo_run / "trace.json").read_text())["traceEvents"] if e["name"] == "train"]
    measured = [e["args"]["lock"] for e in trains if "lock" in e["args"]]  # a step the probe never knocked in has none
    assert len(measured) >= len(trains) - 1 and all(0.0 <= share <= 1.0 for share in measured)
    probed = planned(None, with_locks(grpo_run, tmp_path / "probed", 0.2))  # the operator times no pass
    assert probed["model"]["train_lock"] == 0.2
    assert any("the lock probe in the run's train steps" in n for n in probed["model"]["notes"])
    unmeasured = planned(None, with_locks(grpo_run, tmp_path / "unmeasured", None))
    assert unmeasured["model"]["train_lock"] == 1.0  # a run from before the probe: the stages take turns
    assert any("takes turns" in note for note in unmeasured["model"]["notes"])


def test_a_sync_runs_lock_is_timed_on_its_real_pass_only_where_a_scenario_overlaps_training(grpo_run):
    """The built-in train operator's pass on the run's tiny model, timed here for an async what-if
    (a share in [0, 1]); a sync what-if times nothing and keeps 1."""
    from flowrl.plan import threads

    threads._SECONDS.clear()
    synced = plan_run(grpo_run, ["nodes.rollout.group_size=4"])
    assert synced["model"]["train_lock"] == 1.0 and threads._SECONDS == {}
    assert any("cannot tell how much of a train step holds the interpreter lock" in n for n in synced["model"]["notes"])
    result = plan_run(grpo_run, ["max_staleness=1"])
    assert any("its time outside the forward and backward pass" in n and "timed here" in n
               for n in result["model"]["notes"])
    assert 0.0 <= result["model"]["train_lock"] <= 1.0 and len(threads._SECONDS) == 1


def test_a_train_step_runs_over_its_threads_and_grows_with_its_passes(grpo_run):
    """The train step's cost moves with what its node declares: the threads it runs over (its own
    process's, or the ones the in-process engine set) and its passes over the tokens (epochs, a
    proximal forward): a trainer moved into a one-thread process, or given a decoupled loss, is slower."""
    from flowrl.graph.compile import compile_file
    from flowrl.plan import calibrate, predict, records
    from flowrl.plan.changes import apply
    from flowrl.plan.shapes import train_cores

    plan = compile_file(str(ROOT / "pipelines/grpo_sync.yaml"), []).plan
    cores = {tuple(c): train_cores(s.plan, "learner", 2.0, s.shapes) for c in (
        [], ["nodes.rollout.engine={kind: embedded, threads: 2}"], ["nodes.learner.own_process={threads: 4}"],
        ["nodes.rollout.engine={kind: embedded, threads: 2}", "nodes.learner.own_process={threads: 1}"])
        for s in [apply(plan, list(c), 10)]}
    assert list(cores.values()) == [1.0, 2.0, 2.0, 1.0]  # at most the machine's cores
    base = records.load(grpo_run)
    costs = calibrate(base, 2.0)
    assert (costs.train_cores, costs.train_passes) == (1.0, 3.0)
    costs.train = (0.5, 0.0)  # 0.5 s a step, whatever its tokens: in a sync run, added to the step

    def step(*changes: str) -> float:
        return predict(apply(base.plan, list(changes), 8), costs, 2.0)["step_seconds"]

    plain = step()
    assert step("nodes.learner.epochs=2") - plain == pytest.approx(0.5, rel=0.1)  # twice the passes
    decoupled = "nodes.learner.loss={kind: ppo_clip, decoupled: true, correction: {kind: tis}}"
    assert step(decoupled) - plain == pytest.approx(0.5 / 3, rel=0.1)  # 4 passes for 3
    assert step("nodes.learner.gradient_checkpointing=true") - plain == pytest.approx(0.5 / 3, rel=0.1)
    costs.train_cores = 2.0  # as if fitted on a trainer that ran over two threads: here it gets one
    costs.parallel["learner"] = 1.0  # linear: twice the time on half the threads
    assert step() - plain == pytest.approx(0.5, rel=0.1)
    costs.parallel["learner"] = 0.5  # half of it parallel (Amdahl): 1 thread takes 1 / 0.75 of 2 threads' time
    assert step() - plain == pytest.approx(0.5 / 3, rel=0.1)
    costs.parallel["learner"] = 0.0  # none of it parallel: the threads do not matter
    assert step() == pytest.approx(plain, rel=0.02)


def test_amdahls_law_through_two_timings():
    from flowrl.plan.threads import LINEAR, amdahl

    assert amdahl(1.0, 0.5, 2) == 1.0 and amdahl(1.0, 1.0, 2) == 0.0
    assert amdahl(1.0, 0.75, 2) == pytest.approx(0.5) and amdahl(1.0, 0.625, 4) == pytest.approx(0.5)
    assert amdahl(1.0, 1.2, 2) == 0.0 and amdahl(1.0, 0.4, 2) == 1.0  # timing noise, clipped to [0, 1]
    assert amdahl(1.0, 0.5, 1) == LINEAR  # one thread tells nothing


def test_the_thread_gain_is_timed_on_the_runs_model_only_when_a_what_if_changes_threads(grpo_run):
    """A what-if that gives the engine two threads (the run had one) has the nodes' operators time
    the run's model on one and two threads (threads.py), once per process; a what-if that changes no
    threads times nothing; a model that cannot be loaded here keeps the linear law and says why."""
    from flowrl.plan import calibrate, predict, records
    from flowrl.plan.changes import apply
    from flowrl.plan.threads import LINEAR, Probe

    base = records.load(grpo_run)
    costs = calibrate(base, 2.0)
    assert costs.model == "builtin:tiny-qwen2" and costs.probes["learner"].op == base.plan.nodes["learner"].op
    model_tokens = [t for rows in base.rows_of.values() for t in rows]
    assert base.row_length > sum(model_tokens) / len(model_tokens)  # the rows as trained: prompt included
    assert costs.probes["learner"].length == round(base.row_length)
    assert costs.probes["rollout"] == Probe(base.plan.nodes["rollout"].op, min(costs.engines["rollout"].slots,
                                                                               costs.probes["learner"].rows), 1)
    predict(apply(base.plan, ["max_staleness=1"], 8), costs, 2.0)
    assert costs.parallel == {}  # no threads changed: nothing timed
    two = "nodes.rollout.engine={kind: embedded, threads: 2}"
    result = plan_run(grpo_run, [two])
    # the in-process engine's threads are the whole process's: the trainer's too
    assert set(result["model"]["parallel"]) == {"rollout", "learner"}
    assert all(0.0 <= p <= 1.0 for p in result["model"]["parallel"].values())
    for node in ("rollout", "learner"):
        assert any(n.startswith(f"{node}: its torch work runs") and "as fast on 2 threads" in n
                   for n in result["model"]["notes"])
    costs.model = str(grpo_run / "no-such-model")
    predict(apply(base.plan, [two], 8), costs, 2.0)
    assert costs.parallel["rollout"] == LINEAR
    assert any("threads scale linearly (assumed: its model could not be timed here" in n for n in costs.notes)


@pytest.mark.parametrize("op", ["train", "generate"])
def test_the_built_in_operators_time_their_pass_on_the_threads_asked(op):
    """`Operator.pass_timer` (a contract: default None) of the built-ins runs the model's pass on the
    threads asked and returns its seconds."""
    from flowrl import registry
    from flowrl.operator import Operator

    assert Operator.pass_timer("builtin:tiny-qwen2", 4, 3) is None
    once = registry.resolve(op).pass_timer("builtin:tiny-qwen2", 4, 3)
    assert all(0.0 < once(n) < 30.0 for n in (1, 2, 1))


def test_the_built_in_engines_hand_the_lock_over_at_a_measured_speed():
    """`Operator.handoff` (a contract: default None): the built-in generate node runs two of its
    engines in two threads and in turns; handing the lock over never makes two engines faster than
    twice one, and on this machine it costs (two cores, so up to 2 if they released the lock)."""
    from flowrl import registry
    from flowrl.operator import Operator

    assert Operator.handoff("builtin:tiny-qwen2", 8) is None
    assert 0.3 < registry.resolve("generate").handoff("builtin:tiny-qwen2", 8) < 2.0


def test_plan_runs_an_oversubscribed_lock_at_its_operators_handoff(grpo_run, monkeypatch):
    """plan takes the handoff from the generate node's operator (once per process), fits and
    simulates under it, and says so; an operator that times none leaves handoffs free."""
    from flowrl import registry
    from flowrl.plan import lock

    real = registry.resolve

    def handing(value):
        monkeypatch.setattr(lock, "_HANDOFF", {})
        monkeypatch.setattr(registry, "resolve", lambda op: type("Handing", (real(op),), {
            "handoff": classmethod(lambda cls, model, rows: value)}))
        return plan_run(grpo_run, ["nodes.rollout.resources.replicas=2"])

    slow, free = handing(0.5), handing(None)
    assert any("at 0.50 of the speed of taking turns" in note for note in slow["model"]["notes"])
    assert any("handoffs are taken as free (rollout: its operator times none)" in note
               for note in free["model"]["notes"])
    # Two engine replicas in one process take turns, and lose half their speed more handing over.
    assert slow["predicted"]["step_seconds"] > 1.2 * free["predicted"]["step_seconds"]


def test_plan_takes_amdahls_fraction_from_the_operators_timings(grpo_run, monkeypatch):
    """threads.py alternates one thread and two over the operator's timer, takes the medians and
    Amdahl's law through them; an operator that times nothing keeps the linear law and says so."""
    from flowrl import registry
    from flowrl.plan import calibrate, predict, records, threads
    from flowrl.plan.changes import apply

    calls = []
    # half of it parallel: two threads take 0.75 of one's time
    monkeypatch.setattr(registry, "resolve", timed_by(lambda n: calls.append(n) or {1: 1.0, 2: 0.75}[n]))
    monkeypatch.setattr(threads, "_SECONDS", {})
    base = records.load(grpo_run)
    costs = calibrate(base, 2.0)  # times the pass on one thread (lock.py) and keeps it
    calls.clear()
    predict(apply(base.plan, ["nodes.rollout.engine={kind: embedded, threads: 2}"], 8), costs, 2.0)
    assert costs.parallel == {"rollout": 0.5, "learner": 0.5}
    assert calls[:4] == [1, 2, 1, 2] and len(calls) == 2 * 2 * (threads.REPEATS + 1)
    monkeypatch.setattr(registry, "resolve", timed_by(None))
    monkeypatch.setattr(threads, "_SECONDS", {})
    costs = calibrate(base, 2.0)
    predict(apply(base.plan, ["nodes.rollout.engine={kind: embedded, threads: 2}"], 8), costs, 2.0)
    assert costs.parallel == {"rollout": threads.LINEAR, "learner": threads.LINEAR}
    assert any("its operator times no pass" in n for n in costs.notes)


def test_a_long_pass_is_timed_once_after_its_warm_up():
    """A large model's pass (over threads.LONG_S untimed) is timed once per thread count, not
    REPEATS times: plan's timing costs a few of its steps."""
    from flowrl.plan import threads

    calls = []
    assert threads._alternating(lambda n: calls.append(n) or {1: 3.0, 2: 2.0}[n], 2) == (3.0, 2.0)
    assert calls == [1, 2, 1, 2]
    calls.clear()
    threads._alternating(lambda n: calls.append(n) or 0.01, 2)
    assert len(calls) == 2 * (threads.REPEATS + 1)
    calls.clear()
    threads._alternating(lambda n: calls.append(n) or 3.0, 1)  # one thread count (lock.py's pass)
    assert calls == [1, 1]


def test_rates_keep_their_precision_however_slow_the_run():
    """A real model's run makes 0.04 groups a second: two decimals would round 0.0439 and 0.0325 to
    0.04 and 0.03, and the time to a target computed from them 10-25 % off."""
    from flowrl.plan.records import significant

    assert significant(0.043912) == 0.04391 and significant(0.0325) == 0.0325
    assert significant(123.456) == 123.5 and significant(0.0) == 0.0


def test_a_train_step_beside_multi_turn_groups_is_fitted_as_long_as_it_took(async_run, grpo_run):
    """Multi-turn groups' busy stretches are mostly waits on their environments, and the simulation
    gives their engine no work: counted as work holding the lock, they shrank the train steps that
    overlapped them, and the long-tail async run replayed 12-17 % fast (docs/plan.md)."""
    from flowrl.plan import records
    from flowrl.plan.fit import fit

    def per_token(run: Path, group_size: int | None) -> float:
        base = records.load(run)
        if group_size is not None:  # 8 trajectories a group > 4: read as multi-turn groups
            base.plan.nodes["rollout"].config = {**base.plan.nodes["rollout"].config, "group_size": group_size}
        return fit(base, 2, 1.0).train[1]

    assert per_token(async_run, 4) > per_token(async_run, None)  # its train steps overlapped generation
    assert per_token(grpo_run, 4) == pytest.approx(per_token(grpo_run, None))  # sync: nothing overlapped


# ---- evaluations ---------------------------------------------------------------------------------

def test_an_evaluation_is_told_apart_from_the_weight_loads_it_rides_on():
    """Replica 0's loads of the versions eval.jsonl holds carry a greedy evaluation: fitted as a
    cost of its own every few versions, not spread over every load."""
    from types import SimpleNamespace

    from flowrl.plan.fit import weight_loads
    from flowrl.plan.records import Span

    loads = [Span("rollout", r, "update_weights", v, v + 0.1, None, None, version=v) for v in range(1, 11) for r in (0, 1)]
    work = {s: (0.05 if s.replica == 0 and s.version % 5 == 0 else 0.002) for s in loads}
    base = SimpleNamespace(evaluated=frozenset({0, 5, 10}))
    update, evaluation, every = weight_loads(base, "rollout", work)
    assert (update, every) == (pytest.approx(0.002), 5) and evaluation == pytest.approx(0.048)
    base.evaluated = frozenset()  # no eval.jsonl: every load alike, as before
    assert weight_loads(base, "rollout", work) == (pytest.approx(sum(work.values()) / len(work)), 0.0, 0)


def test_a_real_run_s_evaluations_are_fitted_from_its_trace_and_eval_records(tmp_path):
    """The wiring: the update_weights spans' versions (trace.json) against eval.jsonl's, on a real
    async run with partial rollout that evaluates every 2 versions."""
    from flowrl.plan.records import load

    run = tiny_run(tmp_path, "grpo_async.yaml", "data.eval={every: 2, samples: 16}")
    base = load(run)
    assert {2, 4, 6} <= base.evaluated
    assert {s.version for s in base.spans_named("rollout", "update_weights")} >= {2, 3, 4}
    result = plan_run(run, [])
    assert any("an evaluation" in n and "every 2 versions" in n for n in result["model"]["notes"])
    assert result["simulated"]["step_seconds"] == pytest.approx(result["measured"]["step_seconds"], rel=0.2)


@pytest.mark.parametrize("partial", [False, True])
def test_the_stand_in_evaluates_where_the_generate_operator_does(partial):
    """After a load, or at resume where the load paused the engine (partial rollout); on replica 0,
    at the versions due, once each."""
    import asyncio
    from types import SimpleNamespace

    from flowrl.plan.fit import EngineCost
    from flowrl.plan.stages import Engine, Generate

    paid: list[float] = []

    async def work(seconds: float, load: Load = Load(MAIN, 1.0)) -> None:
        paid.append(round(seconds, 6))

    async def loads(rank: int) -> list[float]:
        paid.clear()
        sim = SimpleNamespace(scale=1.0, work=work)
        cost = EngineCost(slots=2, a=1.0, b=0.0, update_s=0.002, periods=1, eval_s=0.05, eval_every=5)
        stand_in = object.__new__(Generate)
        stand_in.sim, stand_in.cost, stand_in.context = sim, cost, SimpleNamespace(rank=rank)
        stand_in.engine, stand_in.version, stand_in.evaluated = Engine(sim, cost, 2), 0, set()
        for version in (4, 5, 5, 6):
            if partial:
                await stand_in.pause()
            await stand_in.update_weights(None, version)
            if partial:
                await stand_in.resume()
        return paid[:]

    assert asyncio.run(loads(0)) == [0.002, 0.002, 0.05, 0.002, 0.002]
    assert asyncio.run(loads(1)) == [0.002] * 4
