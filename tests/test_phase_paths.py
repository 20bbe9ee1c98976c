"""Phases and model paths: a phase that sets `model.path` starts from it instead of the previous
phase's policy, and `phase:<name>` names an earlier phase's exported policy (checked while
validating, substituted while running)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.spec.errors import SpecError
from flowrl.spec.load import load
from flowrl.spec.phases import expand

ROOT = Path(__file__).resolve().parents[1]
PHASES = """phases:
  - {name: big, steps: 2, set: {model.path: builtin:tiny-qwen2-large}}
  - {name: small, steps: 2, set: {model.path: builtin:tiny-qwen2}}
  - name: after
    steps: 2
    set:
      nodes.ref: {op: reference, model: "phase:big"}
      edges: [rollout -> score, score -> ref, ref -> learner, learner -> publish, {publish -> rollout: {kind: weights}}]
"""


def spec(tmp_path: Path, phases: str = PHASES) -> Path:
    file = tmp_path / "p.yaml"
    file.write_text((ROOT / "tests/specs/good/base.yaml").read_text() + phases)
    return file


def test_a_phase_with_its_own_model_path_is_not_chained(tmp_path: Path) -> None:
    loaded = load(str(spec(tmp_path)))
    exports = {"big": "/runs/x/phases/0-big/export/learner", "small": "/runs/x/phases/1-small/export/learner"}
    [(_, small)] = expand(loaded, exports["big"], 1, exports)
    assert small.spec.model.path == "builtin:tiny-qwen2"  # its own, not the big phase's export
    [(_, after)] = expand(loaded, exports["small"], 2, exports)
    assert after.spec.model.path == exports["small"]  # chained as before
    assert after.data["nodes"]["ref"]["model"] == exports["big"]  # phase:big, substituted


def test_validation_keeps_the_reference_and_the_graph_compiles(tmp_path: Path) -> None:
    from flowrl.graph.compile import compile_file

    [_, _, (_, after)] = expand(load(str(spec(tmp_path))))
    assert after.data["nodes"]["ref"]["model"] == "phase:big"
    compile_file(str(spec(tmp_path)))


@pytest.mark.parametrize(("value", "message"), [
    ("phase:bgi", "'phase:bgi': did you mean 'phase:big'?"),
    ("phase:after", "'phase:after': no earlier phase is named 'after' (earlier phases: big, small)"),
])
def test_a_reference_to_no_earlier_phase_is_located(tmp_path: Path, value: str, message: str) -> None:
    file = spec(tmp_path, PHASES.replace('"phase:big"', f'"{value}"'))
    with pytest.raises(SpecError) as info:
        expand(load(str(file)))
    [diagnostic] = info.value.diagnostics
    assert diagnostic.message == message and diagnostic.path == "nodes.ref.model"
    lines = file.read_text().splitlines()
    where = next(i for i, line in enumerate(lines, 1) if "nodes.ref:" in line)
    assert (diagnostic.line, diagnostic.col) == (where, lines[where - 1].index("{") + 1)  # the phase sets it there


def test_a_spec_without_phases_rejects_a_phase_reference(tmp_path: Path) -> None:
    file = tmp_path / "p.yaml"
    file.write_text((ROOT / "tests/specs/good/base.yaml").read_text().replace(
        "path: builtin:tiny-qwen2", "path: 'phase:warmup'"))
    with pytest.raises(SpecError) as info:
        expand(load(str(file)))
    [diagnostic] = info.value.diagnostics
    assert (diagnostic.path, diagnostic.line) == ("model.path", 3)
    assert "no earlier phase is named 'warmup' (earlier phases: none)" in diagnostic.message


def test_a_phase_that_exported_nothing_is_refused_while_running(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="phase big exported no policy"):
        expand(load(str(spec(tmp_path))), "x", 2, {"big": None, "small": "y"})


def test_a_command_line_override_of_a_phase_set_sets_one_dotted_key(tmp_path: Path) -> None:
    # `phases.2.set.nodes.rollout.group_size=2` is the phase's key `nodes.rollout.group_size`, not a
    # `nodes` table replacing every node of the phase.
    loaded = load(str(spec(tmp_path)), ["phases.2.set.nodes.rollout.group_size=2"])
    assert loaded.data["phases"][2]["set"]["nodes.rollout.group_size"] == 2
    exports = {"big": "/b", "small": "/s"}
    [(_, after)] = expand(loaded, "/s", 2, exports)
    assert after.data["nodes"]["rollout"]["group_size"] == 2 and "learner" in after.data["nodes"]


@pytest.mark.parametrize(("phase_set", "key", "message"), [
    ("{run.steps: 5}", 'phases[0].set["run.steps"]', "a phase cannot set run.steps"),
    ("{run.max_seconds: 5}", 'phases[0].set["run.max_seconds"]', "a phase cannot set run.max_seconds"),
    ("{run: {steps: 5}}", "phases[0].set.run", "a phase cannot set run.steps"),
    ("{run.run_dir: /tmp/elsewhere}", 'phases[0].set["run.run_dir"]', "RUN_DIR/phases/<i>-<name>"),
    ("{phases: []}", "phases[0].set.phases", "phases do not nest"),
    ("{name: ../../x}", "name", "cannot name a folder"),
])
def test_a_phase_cannot_set_what_it_would_ignore(tmp_path: Path, phase_set: str, key: str, message: str) -> None:
    """A phase's length is its own steps / seconds and its folder RUN_DIR/phases/<i>-<name>: a `set`
    of run.steps, run.max_seconds or run.run_dir (or of phases) would be silently overridden."""
    file = spec(tmp_path, f"phases:\n  - {{name: a, steps: 2, set: {phase_set}}}\n")
    with pytest.raises(SpecError) as info:
        expand(load(str(file)))
    [diagnostic] = info.value.diagnostics
    assert diagnostic.path == key and message in diagnostic.message and diagnostic.line == 27, diagnostic


def test_run_steps_beside_phases_is_refused_and_setting_run_keeps_the_phase_length(tmp_path: Path) -> None:
    file = spec(tmp_path, "phases:\n  - {name: a, steps: 2, set: {run: {seed: 3}}}\n  - {name: b, seconds: 9}\n")
    [(_, a), (_, b)] = expand(load(str(file)))
    assert (a.spec.run.steps, a.spec.run.seed, b.spec.run.max_seconds) == (2, 3, 9.0)
    with pytest.raises(SpecError) as info:
        expand(load(str(file), ["run.steps=100"]))
    [diagnostic] = info.value.diagnostics
    assert diagnostic.path == "run.steps" and "set phases.<i>.steps" in diagnostic.message
    assert diagnostic.file == "command-line override 'run.steps=100'"
