"""Health judges the metrics a train node declares (`Operator.metric_roles`), not names it expects: a
plugin train node, installed as a package with an entry point, that reports its entropy, clip fraction
and mismatch under names of its own and declares them is judged (its entropy collapse is found, live
and by `flowrl inspect` from the run directory alone); the same node declaring nothing is not judged;
a run recorded before declarations is read with the built-in train operator's names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from flowrl import health, plugins
from flowrl.cli import main
from flowrl.health import BUILTIN_ROLES, Health, replay
from flowrl.operator import MetricRoles

PLUGIN = '''
"""A train node whose metrics have names of its own: its entropy falls to a tenth at step 5."""
from flowrl.operator import POLICY, TRAJECTORIES, MetricRoles, Operator, Resources, TrainResult


class DeclaredTrain(Operator):
    """Reports policy_entropy, ratio_clipped and logp_gap, and says what they are."""

    kind = "train"
    inputs = {"trajectories": TRAJECTORIES}
    outputs = {"policy": POLICY}
    resources = Resources(cpus=0.1)

    @classmethod
    def reported_metrics(cls, config):
        return frozenset({"policy_entropy", "ratio_clipped", "logp_gap"})

    @classmethod
    def metric_roles(cls, config):
        return MetricRoles(entropy="policy_entropy", clip_fraction="ratio_clipped", mismatch="logp_gap",
                           policy_gradient="logp_gap")

    async def train(self, groups, *, step):
        metrics = {"policy_entropy": 1.0 if step < 5 else 0.1, "ratio_clipped": 0.01, "logp_gap": 1e-6}
        return TrainResult(policy={"version": step + 1, "checksum": ""}, metrics=metrics)

    async def publish(self):
        return TrainResult(policy={"version": 0, "checksum": ""})


class SilentTrain(DeclaredTrain):
    """The same steps; it declares no roles."""

    @classmethod
    def metric_roles(cls, config):
        return None


class MisnamedTrain(DeclaredTrain):
    """Declares a role for a metric it does not report."""

    @classmethod
    def metric_roles(cls, config):
        return MetricRoles(entropy="entropy")
'''
ENTRY_POINTS = """[flowrl.operators]
declared_train = acme_health:DeclaredTrain
silent_train = acme_health:SilentTrain
misnamed_train = acme_health:MisnamedTrain
"""
STEPS = 20
ROLES = MetricRoles(entropy="policy_entropy", clip_fraction="ratio_clipped", mismatch="logp_gap",
                    policy_gradient="logp_gap")


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The plugin as an installed distribution (package + dist-info) on sys.path, found by entry point."""
    site = tmp_path / "site"
    (site / "acme_health").mkdir(parents=True)
    (site / "acme_health/__init__.py").write_text(PLUGIN)
    info = site / "acme_health-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-health\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(site))
    plugins.targets.cache_clear()
    yield site
    monkeypatch.undo()
    plugins.targets.cache_clear()


def spec(tmp_path: Path, train_op: str) -> Path:
    path = tmp_path / f"{train_op}.yaml"
    path.write_text(yaml.safe_dump({
        "flowrl": 1, "name": "declared", "model": {"path": "builtin:tiny-qwen2"},
        "data": {"source": "runtime_ops:Numbers", "batch_size": 2},
        "run": {"steps": STEPS, "trackers": []},
        "nodes": {"rollout": {"op": "runtime_ops:ToyGenerate"}, "score": {"op": "runtime_ops:ToyReward"},
                  "learner": {"op": train_op}, "publish": {"op": "runtime_ops:ToySync"}},
        "edges": ["rollout -> score", "score -> learner", "learner.policy -> publish.policy",
                  {"publish -> rollout.weights": {"kind": "weights"}}]}))
    return path


def run(tmp_path: Path, train_op: str) -> Path:
    run_dir = tmp_path / f"run-{train_op}"
    assert main(["run", str(spec(tmp_path, train_op)), "--run-dir", str(run_dir), "--quiet"]) == 0
    return run_dir


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def forget_recorded_health(run_dir: Path) -> None:
    """The run as one recorded before health was: no events in its rows, no `health` in meta.json
    (`flowrl inspect` then judges its rows afresh, by the roles meta.json holds)."""
    meta = json.loads((run_dir / "meta.json").read_text())
    (run_dir / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "health"}))
    rows = [{k: v for k, v in r.items() if k != "health"} for r in rows_of(run_dir)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


COLLAPSE = f"entropy collapse from step 5: entropy 0.1, under {health.ENTROPY_RATIO:g}x its start 1"


def test_a_plugin_that_declares_its_metrics_is_judged_live_and_by_inspect(installed, tmp_path, capsys):
    run_dir = run(tmp_path, "declared_train")
    events = [e for r in rows_of(run_dir) for e in r.get("health", [])]
    assert [(e["condition"], e["event"], e["step"], e["at"]) for e in events] == [
        ("entropy_collapse", "began", 5, 5 + health.ENTROPY_STEPS - 1)]
    assert json.loads((run_dir / "meta.json").read_text())["metric_roles"] == {
        "learner": {"entropy": "policy_entropy", "clip_fraction": "ratio_clipped", "mismatch": "logp_gap",
                    "policy_gradient": "logp_gap"}}
    capsys.readouterr()
    forget_recorded_health(run_dir)
    assert main(["inspect", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert COLLAPSE in out
    header = next(line for line in out.splitlines() if "time_s" in line).split()
    assert header[:6] == ["steps", "time_s", "reward", "entropy", "clip", "mismatch"]  # its metrics, by role


def test_the_same_node_declaring_nothing_is_not_judged(installed, tmp_path, capsys):
    run_dir = run(tmp_path, "silent_train")
    rows = rows_of(run_dir)
    assert rows[-1]["train"]["policy_entropy"] == 0.1  # it collapsed all the same
    assert not any(r.get("health") for r in rows)
    assert json.loads((run_dir / "meta.json").read_text())["metric_roles"] == {}
    forget_recorded_health(run_dir)
    capsys.readouterr()
    assert main(["inspect", str(run_dir)]) == 0
    assert "health: nothing found" in capsys.readouterr().out


def test_a_role_naming_a_metric_the_node_does_not_report_is_refused(installed, tmp_path, capsys):
    assert main(["validate", str(spec(tmp_path, "misnamed_train"))]) == 1
    err = capsys.readouterr().err
    assert "nodes.learner.op: operator acme_health:MisnamedTrain: its metric_roles() names 'entropy' as " \
           "entropy, which is not among its reported_metrics()" in err, err


def collapsing(names: dict[str, str]) -> list[dict]:
    """Rows whose entropy (under names['entropy']) falls to a tenth at step 5."""
    return [{"step": i, "node": "learner", "reward": 0.5,
             "train": {names["entropy"]: 1.0 if i < 5 else 0.1, names["mismatch"]: 1e-6}} for i in range(STEPS)]


def test_the_detector_reads_the_declared_names_and_only_those():
    own = collapsing({"entropy": "policy_entropy", "mismatch": "logp_gap"})
    builtin = collapsing({"entropy": "entropy", "mismatch": "mismatch_logprob_mean"})
    assert [e["step"] for e in replay(own, {"learner": ROLES})] == [5]
    assert replay(own, {}) == []  # declared nothing
    assert replay(own, None) == []  # a run from before declarations: the built-in names, absent here
    assert [e["step"] for e in replay(builtin, None)] == [5]
    assert replay(builtin, {"learner": ROLES}) == []
    # Without its policy_gradient metric a step is not judged; with none declared every step is.
    assert sum(len(Health(ROLES).update(r)) for r in collapsing({"entropy": "policy_entropy", "mismatch": "x"})) == 0
    ungated = MetricRoles(entropy="policy_entropy")
    detector = Health(ungated)
    assert [e["step"] for r in own for e in detector.update(r)] == [5]


def test_the_built_in_train_node_declares_what_the_fallback_reads():
    """BUILTIN_ROLES (how a run from before declarations is read) is the built-in train node's own."""
    import msgspec

    from flowrl_operators.config import TrainConfig
    from flowrl_operators.train import Train
    from flowrl_operators.training.reported import ROLES as TRAIN_ROLES
    from flowrl_operators.training.reported import TRAIN_METRICS

    assert Train.metric_roles(msgspec.convert({}, TrainConfig)) == TRAIN_ROLES == BUILTIN_ROLES
    assert set(BUILTIN_ROLES.names().values()) <= TRAIN_METRICS
