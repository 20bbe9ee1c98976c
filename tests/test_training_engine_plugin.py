"""The training-engine seam (operators/training/engine.py): the built-in FSDP2 engine satisfies the
protocol in every role, and an engine shipped by a plugin package is chosen from YAML by the train,
reference and critic nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl_operators.training.engine import TrainingEngine, ValueEngine, build, engines

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = '''
"""An engine that is FSDP2 underneath and logs every call the nodes make."""
import json
import os

from flowrl_operators.training.engine import EngineEntry
from flowrl_operators.training.trainer import FSDP2


class Logged:
    def __init__(self, inner, role):
        self.inner, self.role = inner, role
        self.rank, self.world_size = inner.rank, inner.world_size

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def call(*args, **kwargs):
            with open(os.environ["ACME_ENGINE_LOG"], "a") as f:
                f.write(json.dumps([self.role, name]) + "\\n")
            return method(*args, **kwargs)

        return call


ENTRY = EngineEntry("logged", lambda path, config, role: Logged(FSDP2.build(path, config, role), role))
'''


def test_fsdp2_is_registered_and_satisfies_the_protocol_in_every_role() -> None:
    assert "fsdp2" in engines()
    for role in ("policy", "reference", "value"):
        engine = build("fsdp2", "builtin:tiny-qwen2", None, role)
        assert isinstance(engine, ValueEngine if role == "value" else TrainingEngine), role
    with pytest.raises(ValueError, match="unknown training engine 'fsdp'.*did you mean 'fsdp2'"):
        build("fsdp", "builtin:tiny-qwen2", None, "policy")


@pytest.fixture
def plugin_site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    (site / "acme_engine").mkdir(parents=True)
    (site / "acme_engine/__init__.py").write_text(PLUGIN)
    info = site / "acme_engine-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-engine\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[flowrl.training_engines]\nlogged = acme_engine:ENTRY\n")
    return site


def test_a_plugin_engine_trains_a_real_pipeline(plugin_site: Path, tmp_path: Path) -> None:
    log = tmp_path / "calls.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_site), os.environ.get("PYTHONPATH", "")]),
           "ACME_ENGINE_LOG": str(log)}
    short = ["run.steps=2", "data.batch_size=2", "nodes.rollout.group_size=2", "nodes.rollout.sampling.max_new_tokens=4",
             "nodes.learner.engine=logged", "nodes.ref.engine=logged", "nodes.value.engine=logged"]
    done = subprocess.run([sys.executable, "-m", "flowrl.cli", "run", str(ROOT / "pipelines/ppo_critic.yaml"), *short,
                           "--run-dir", str(tmp_path / "run"), "--quiet"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    calls = {tuple(json.loads(line)) for line in log.read_text().splitlines()}
    assert {("policy", "forward_backward"), ("policy", "step"), ("policy", "named_weights"),
            ("policy", "export_hf"), ("reference", "compute_logprobs"), ("value", "compute_values"),
            ("value", "forward_backward")} <= calls
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
