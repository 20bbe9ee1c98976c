"""Spec loading and compiling: every malformed spec under tests/specs/bad gives a located error.

Each bad spec starts with `# expect: LINE:COL KEY.PATH | MESSAGE`: `flowrl validate` must exit 1,
print a line that starts with `FILE:LINE:COL KEY.PATH` and contains MESSAGE, and no traceback.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flowrl.cli import main
from flowrl.graph.compile import compile_file
from flowrl.spec.errors import SpecError

ROOT = Path(__file__).resolve().parents[1]
BAD = sorted((ROOT / "tests/specs/bad").glob("*.yaml"))
PIPELINES = sorted((ROOT / "pipelines").glob("*.yaml"))


def expectation(file: Path) -> tuple[str, str]:
    header = file.read_text().splitlines()[0]
    assert header.startswith("# expect: "), f"{file} lacks its '# expect:' header"
    location, _, message = header.removeprefix("# expect: ").partition(" | ")
    return location.strip(), message.strip()


def test_enough_malformed_specs() -> None:
    assert len(BAD) >= 25


@pytest.mark.parametrize("file", BAD, ids=lambda f: f.stem)
def test_bad_spec_gives_located_error(file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    location, message = expectation(file)
    rel = file.relative_to(ROOT)
    assert main(["validate", str(rel)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if message in line]
    assert lines, f"no line mentions {message!r}:\n{err}"
    assert lines[0].startswith(f"{rel}:{location}"), f"expected location {rel}:{location}, got:\n{err}"


@pytest.mark.parametrize("name", ["wrong_type", "invalid_yaml", "unknown_op"])
def test_validate_process_exits_1_without_traceback(name: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "validate", f"tests/specs/bad/{name}.yaml"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert f"tests/specs/bad/{name}.yaml:" in proc.stderr


# Pipelines whose model folder the user builds first (README, "A real model"): validated with a tiny local model there.
# (every pipeline whose model.path is a folder under models/, read from the file itself)
BUILT_MODELS = {f.stem: path for f in PIPELINES
                if str(path := (yaml.safe_load(f.read_text()).get("model") or {}).get("path", "")).startswith("models/")}


@pytest.mark.parametrize("file", PIPELINES, ids=lambda f: f.stem)
def test_shipped_pipelines_validate_silently(file: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    overrides = []
    if file.stem in BUILT_MODELS:
        from test_engine import make_checkpoint

        make_checkpoint("tiny-qwen2", tmp_path / BUILT_MODELS[file.stem], seed=0)
        overrides = [f"model.path={tmp_path / BUILT_MODELS[file.stem]}"]
    monkeypatch.chdir(ROOT)  # data files are relative to the working directory
    assert main(["validate", str(file), *overrides]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_override_changes_config_and_is_located_when_wrong() -> None:
    base = str(ROOT / "tests/specs/good/base.yaml")
    plan = compile_file(base, ["nodes.learner.optim.lr=3e-4", "run.steps=7"]).plan
    assert plan.nodes["learner"].config["optim"]["lr"] == pytest.approx(3e-4)
    assert plan.run["steps"] == 7
    with pytest.raises(SpecError) as info:
        compile_file(base, ["nodes.learner.optim.lr=fast"])
    assert str(info.value) == ("command-line override 'nodes.learner.optim.lr=fast' "
                               "nodes.learner.optim.lr: expected float, got 'fast'")


def test_run_executor_flag_reaches_the_graph_checks(tmp_path: Path) -> None:
    """`flowrl run --executor ray` is checked like `run.executor: ray` in the file: before anything starts."""
    spec = ROOT / "tests/specs/bad/inprocess_transport_under_ray.yaml"
    text = spec.read_text().replace("run: {executor: ray}", "run: {executor: inprocess}")
    file = tmp_path / "pipeline.yaml"
    file.write_text(text)
    compile_file(str(file))  # one process: fine
    from flowrl import launch

    with pytest.raises(SpecError, match="transport: inprocess needs the stages in one process"):
        launch.start(str(file), [], tmp_path / "run", executor="ray", progress=False)
    assert not (tmp_path / "run").exists()


def test_interpolation_resolves(tmp_path: Path) -> None:
    text = (ROOT / "tests/specs/good/base.yaml").read_text()
    text = text.replace("    optim: {lr: 1.0e-3}", "    optim: {lr: '${lr}'}") + "description: ${name}-run\n"
    text = "lr: 0.5\n" + text
    spec = tmp_path / "p.yaml"
    spec.write_text(text)
    with pytest.raises(SpecError, match="unknown key 'lr'"):  # top-level helper keys are not allowed...
        compile_file(str(spec))
    spec.write_text(text.replace("lr: 0.5\n", "").replace("'${lr}'", "'${data.batch_size}'"))
    plan = compile_file(str(spec)).plan  # ...but interpolating existing keys is
    assert plan.nodes["learner"].config["optim"]["lr"] == 4.0


def test_async_edge_gets_default_staleness_and_order(tmp_path: Path) -> None:
    text = (ROOT / "pipelines/grpo_async.yaml").read_text()
    plan = compile_file(str(ROOT / "pipelines/grpo_async.yaml")).plan
    edge = next(e for e in plan.edges if e.dst == "learner")
    assert (edge.mode, edge.max_staleness) == ("async", 2)
    assert plan.order == ["rollout", "score", "learner", "publish"]
    spec = tmp_path / "p.yaml"
    spec.write_text(text.replace("{mode: async, max_staleness: 2}", "{mode: async}"))
    edge = next(e for e in compile_file(str(spec)).plan.edges if e.dst == "learner")
    assert edge.max_staleness == 1


def test_phase_sets_an_edge_by_its_text(tmp_path: Path) -> None:
    from flowrl.spec.load import load
    from flowrl.spec.phases import expand

    spec = tmp_path / "p.yaml"
    spec.write_text((ROOT / "tests/specs/good/base.yaml").read_text() + (
        "phases:\n"
        "  - {name: warmup, steps: 2, set: {edges.score ->learner: {mode: async, max_staleness: 3}}}\n"
        "  - {name: main, steps: 2}\n"))
    (_, warmup), (_, main) = expand(load(str(spec)))
    assert warmup.data["edges"][1] == {"score -> learner": {"mode": "async", "max_staleness": 3}}
    assert main.data["edges"][1] == "score -> learner"  # one phase's edit stays in its phase
    assert warmup.spec.edges[0] == "rollout -> score"


def test_all_problems_reported_together(tmp_path: Path) -> None:
    text = (ROOT / "tests/specs/good/base.yaml").read_text()
    text = text.replace("op: generate", "op: genrate").replace("{lr: 1.0e-3}", "{lr: fast}")
    spec = tmp_path / "p.yaml"
    spec.write_text(text)
    with pytest.raises(SpecError) as info:
        compile_file(str(spec))
    messages = [d.message for d in info.value.diagnostics]
    assert any("unknown operator 'genrate'" in m for m in messages)
    assert any("expected float, got 'fast'" in m for m in messages)
