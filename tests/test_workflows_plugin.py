"""An operator plugin written as a user would (tests/plugins/countdown: its own pyproject, a custom
environment, a data source and a registered reward operator) installs with pip and trains through
`flowrl run` without any change to flowrl."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = Path(__file__).parent / "plugins" / "countdown"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """`pip install` of the plugin into a private folder (a copy, so the source tree stays clean)."""
    base = tmp_path_factory.mktemp("plugin")
    source = base / "src"
    shutil.copytree(PLUGIN, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(base / "site"), str(source)], check=True, timeout=300)
    return base / "site"


def flowrl(site: Path | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(site) if site else "", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "flowrl.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_plugin_operator_is_registered_and_validates(site):
    listed = flowrl(site, "operators")
    assert listed.returncode == 0, listed.stderr
    assert "countdown_score" in listed.stdout and "token_cost" in listed.stdout
    spec = str(PLUGIN / "countdown.yaml")
    assert flowrl(site, "validate", spec).returncode == 0
    missing = flowrl(None, "validate", spec)
    assert missing.returncode == 1 and "unknown operator 'countdown_score'" in missing.stderr


def test_plugin_trains_through_flowrl_run(site, tmp_path):
    run_dir = tmp_path / "run"
    proc = flowrl(site, "run", str(PLUGIN / "countdown.yaml"), "--run-dir", str(run_dir), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("node") == "learner"]
    assert [r["step"] for r in steps] == [0, 1]
    for r in steps:  # the shipped train node updated the policy on the plugin's trajectories
        assert r["groups"] == 2 and r["reward"] is not None
        assert r["train"]["tokens"] > 0 and r["train"]["grad_norm"] > 0 and r["train"]["trajectories"] == 4
