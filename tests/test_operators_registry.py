"""The operator registry: the contract every registered operator keeps, and third-party plugins
registered by entry point and by module:attr path, exactly as a user would ship them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from flowrl import registry
from flowrl.operator import KINDS, PORT_TYPES, CostShape, Knobs, Operator
from flowrl.spec.describe import fields

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = {"generate", "reward", "reference", "train", "sync", "critic"}


def test_builtin_node_kinds_are_registered_by_entry_point() -> None:
    assert BUILTIN <= set(registry.names())
    kinds = {registry.resolve(n).kind for n in BUILTIN}
    assert {"generate", "reward", "reference", "train", "sync"} <= kinds


@pytest.mark.parametrize("name", registry.names())
def test_operator_contract(name: str) -> None:
    """Every registered operator: an Operator subclass with a known kind, typed ports, a strict
    msgspec Config whose keys are all documented, positive resources and a one-line summary."""
    op = registry.resolve(name)
    assert issubclass(op, Operator) and op.kind in KINDS
    assert set(op.inputs.values()) | set(op.outputs.values()) <= set(PORT_TYPES)
    assert op.outputs, "an operator must produce something"
    assert issubclass(op.Config, msgspec.Struct)
    assert op.Config.__struct_config__.forbid_unknown_fields, "unknown keys must be errors"
    assert op.resources.cpus > 0 and op.resources.replicas >= 1
    assert (op.__doc__ or "").strip(), "the first docstring line is shown by `flowrl operators`"
    for f in fields(op.Config):
        assert f.type
    knobs = op.knobs(msgspec.convert({}, op.Config)) if _defaults_suffice(op) else None
    assert knobs is None or (isinstance(knobs, Knobs) and knobs.concurrency >= 1)
    if op.kind == "generate":  # the knobs are the config's, not the defaults
        config = msgspec.convert({"max_concurrency": 3, "partial_rollout": True}, op.Config)
        assert op.knobs(config) == Knobs(concurrency=3, partial_rollout=True)
    if knobs is not None:  # what plan simulates is what the runtime drives
        shape = op.cost_shape(msgspec.convert({}, op.Config))
        assert isinstance(shape, CostShape)
        assert (shape.concurrency, shape.partial_rollout) == (knobs.concurrency, knobs.partial_rollout)
        assert shape.group_size >= 1 and (shape.slots is None or shape.slots >= 1)


def test_built_in_cost_shapes_are_their_configs() -> None:
    """The shapes `flowrl plan` reads, declared from each built-in's own keys."""
    generate, train = registry.resolve("generate"), registry.resolve("train")
    config = msgspec.convert({"group_size": 4, "engine": {"max_batch": 8}, "max_concurrency": 5}, generate.Config)
    assert generate.cost_shape(config) == CostShape(concurrency=5, group_size=4, slots=8, threads=1)
    for engine, threads in [({"threads": 2}, 2), ({"threads": 2, "device": "cuda"}, None), ("sglang", None)]:
        assert generate.cost_shape(msgspec.convert({"engine": engine}, generate.Config)).threads == threads
    assert generate.cost_shape(msgspec.convert({}, generate.Config)).slots == 32  # the embedded engine's default
    assert train.cost_shape(msgspec.convert({"own_process": {"threads": 2}}, train.Config)).process_threads == 2
    assert train.cost_shape(msgspec.convert({}, train.Config)).process_threads is None
    # Passes over a step's tokens, in forward-pass units: a forward and a backward per epoch, one more
    # forward with gradient checkpointing, the proximal policy's forward once (or each epoch).
    passes = [train.cost_shape(msgspec.convert(c, train.Config)).passes for c in [
        {}, {"epochs": 2}, {"gradient_checkpointing": True},
        {"loss": {"kind": "ppo_clip", "decoupled": True, "correction": {"kind": "tis", "threshold": 2.0}}},
        {"loss": {"kind": "ppo_clip", "correction": {"kind": "tis", "threshold": 2.0}}, "epochs": 2},
        {"loss": {"kind": "sft", "correction": {"kind": "tis", "threshold": 2.0}}}]]
    assert passes == [3.0, 6.0, 4.0, 4.0, 7.0, 3.0]  # sft: no behaviour policy, no proximal


def _defaults_suffice(op: type) -> bool:
    try:
        msgspec.convert({}, op.Config)
    except msgspec.ValidationError:  # a required key (e.g. a judge's engine)
        return False
    return True


def test_module_attr_resolution_errors_are_plain() -> None:
    with pytest.raises(registry.OperatorError, match="not of the form module:attr"):
        registry.import_path("nocolon")
    with pytest.raises(registry.OperatorError, match="has no attribute 'Nope'"):
        registry.resolve("flowrl_operators.generate:Nope")
    with pytest.raises(registry.OperatorError, match="unknown operator 'nope'"):
        registry.resolve("nope")


PLUGIN = '''
"""A third-party operator package, as a user would write it."""
import msgspec
from flowrl.operator import TRAJECTORIES, Operator, Resources


class KeepLongConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    min_tokens: int = 4  # drop trajectories shorter than this


class KeepLong(Operator):
    """Drops trajectories with fewer than min_tokens response tokens."""

    kind = "transform"
    Config = KeepLongConfig
    inputs = {"trajectories": TRAJECTORIES}
    outputs = {"trajectories": TRAJECTORIES}
    resources = Resources(cpus=0.1)
'''


@pytest.fixture
def plugin_site(tmp_path: Path) -> Path:
    """A throwaway installed distribution: the package plus a dist-info with its entry point."""
    (tmp_path / "acme_ops").mkdir()
    (tmp_path / "acme_ops/__init__.py").write_text(PLUGIN)
    info = tmp_path / "acme_ops-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-ops\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[flowrl.operators]\nkeep_long = acme_ops:KeepLong\n")
    return tmp_path


def flowrl(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(site), os.environ.get("PYTHONPATH"))))}
    return subprocess.run([sys.executable, "-m", "flowrl.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def spec_with_filter(tmp_path: Path, op: str, extra: str = "") -> Path:
    text = (ROOT / "tests/specs/good/base.yaml").read_text()
    text = text.replace("  publish:\n", f"  keep:\n    op: {op}\n{extra}  publish:\n")
    text = text.replace("  - score -> learner\n", "  - score -> keep\n  - keep -> learner\n")
    path = tmp_path / f"with_{op.replace(':', '_')}.yaml"
    path.write_text(text)
    return path


def test_plugin_listed_by_operators(plugin_site: Path) -> None:
    proc = flowrl(plugin_site, "operators")
    assert proc.returncode == 0, proc.stderr
    assert "keep_long  kind transform  (acme_ops:KeepLong)" in proc.stdout
    assert "Drops trajectories with fewer than min_tokens response tokens." in proc.stdout
    assert "min_tokens" in proc.stdout and "drop trajectories shorter than this" in proc.stdout


@pytest.mark.parametrize("op", ["keep_long", "acme_ops:KeepLong"])
def test_plugin_accepted_by_validate(plugin_site: Path, tmp_path: Path, op: str) -> None:
    good = spec_with_filter(tmp_path, op, "    min_tokens: 2\n")
    proc = flowrl(plugin_site, "validate", str(good))
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    bad = spec_with_filter(tmp_path, op, "    min_tokns: 2\n")
    proc = flowrl(plugin_site, "validate", str(bad))
    assert proc.returncode == 1
    assert f"{bad}:21:5 nodes.keep.min_tokns: unknown key 'min_tokns'; did you mean 'min_tokens'?" in proc.stderr


def test_plugin_unknown_without_its_package(tmp_path: Path) -> None:
    proc = flowrl(tmp_path, "validate", str(spec_with_filter(tmp_path, "keep_long")))
    assert proc.returncode == 1 and "unknown operator 'keep_long'" in proc.stderr
