"""A loss and an advantage estimator shipped by a plugin package: one module and two entry points
(`flowrl.losses`, `flowrl.advantages`), selected from YAML with their own keys; `flowrl run` trains
the real tiny model with them, `flowrl algorithms` lists them, `flowrl validate` locates a misspelt
name with a suggestion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = '''
"""A scaled REINFORCE loss and a best-of-group baseline, each logging its calls to ACME_LOG."""
import json
import os

import torch

from flowrl_operators.config import AdvantageConfig, LossConfig
from flowrl_operators.training.registry import Algorithm


def log(**record):
    with open(os.environ["ACME_LOG"], "a") as f:
        f.write(json.dumps(record) + "\\n")


class ScaledReinforce(LossConfig):
    """l = -scale A logp."""

    scale: float = 1.0  # multiplies the REINFORCE term


def scaled_reinforce(logprobs, old, advantages, mask, config):
    log(loss=config.scale, tokens=int(mask.sum()))
    return -config.scale * advantages * logprobs, torch.zeros_like(logprobs)


class BestBaseline(AdvantageConfig):
    """A = R - max_g R + offset on every model token."""

    offset: float = 0.0  # added to every advantage


def best_baseline(x, config):
    scores = x.rewards.sum(dim=1)
    best = torch.stack([scores[x.group_index == g].max() for g in x.group_index])
    log(estimator=config.offset, rows=int(scores.numel()))
    advantages = (scores - best + config.offset)[:, None] * x.mask
    return advantages, advantages


SCALED = Algorithm("scaled_reinforce", ScaledReinforce, scaled_reinforce, frozenset({"advantages"}))
BEST = Algorithm("best_baseline", BestBaseline, best_baseline)
'''
PIPELINE = """flowrl: 1
name: plugin-algorithms
model: {path: builtin:tiny-qwen2}
data: {source: builtin:reverse_digits, batch_size: 2}
run: {steps: 3}
nodes:
  rollout: {op: generate, group_size: 2, sampling: {max_new_tokens: 4}}
  score: {op: reward, fn: builtin:reverse_digits}
  learner:
    op: train
    advantage: {estimator: best_baseline, offset: 0.25}
    loss: {kind: LOSS, scale: 0.5, aggregation: seq_mean_token_mean}
    optim: {lr: 1.0e-3}
  publish: {op: sync}
edges:
  - rollout -> score
  - score -> learner
  - learner -> publish
  - publish -> rollout: {kind: weights}
"""


@pytest.fixture
def plugin_site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    (site / "acme_algos").mkdir(parents=True)
    (site / "acme_algos/__init__.py").write_text(PLUGIN)
    info = site / "acme_algos-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-algos\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[flowrl.losses]\nscaled_reinforce = acme_algos:SCALED\n\n"
                                          "[flowrl.advantages]\nbest_baseline = acme_algos:BEST\n")
    return site


def flowrl(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "ACME_LOG": str(site.parent / "calls.jsonl"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "flowrl.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def pipeline(tmp_path: Path, loss: str) -> Path:
    path = tmp_path / f"{loss}.yaml"
    path.write_text(PIPELINE.replace("LOSS", loss))
    return path


def test_a_plugin_loss_and_estimator_train_from_yaml(plugin_site: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = flowrl(plugin_site, "run", str(pipeline(tmp_path, "scaled_reinforce")), "--run-dir", str(run_dir), "--quiet")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    # Each step estimates once over the batch (2 samples x 2 trajectories), with the YAML's offset,
    # and runs the loss on its micro-batch with the YAML's scale.
    assert [c for c in calls if "estimator" in c] == [{"estimator": 0.25, "rows": 4}] * 3
    losses = [c for c in calls if "loss" in c]
    assert len(losses) >= 3 and all(c["loss"] == 0.5 and c["tokens"] > 0 for c in losses)


def test_plugin_entries_are_listed_with_their_keys(plugin_site: Path) -> None:
    listed = flowrl(plugin_site, "algorithms")
    assert listed.returncode == 0, listed.stderr
    assert "scaled_reinforce  (acme_algos:ScaledReinforce)" in listed.stdout
    assert "l = -scale A logp." in listed.stdout and "multiplies the REINFORCE term" in listed.stdout
    assert "best_baseline  (acme_algos:BestBaseline)" in listed.stdout and "added to every advantage" in listed.stdout


def test_a_misspelt_plugin_loss_is_a_located_error(plugin_site: Path, tmp_path: Path) -> None:
    bad = pipeline(tmp_path, "scaled_reinforc")
    proc = flowrl(plugin_site, "validate", str(bad))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"{bad}:12:" in proc.stderr
    assert "nodes.learner.loss.kind: unknown loss 'scaled_reinforc'" in proc.stderr
    assert "did you mean 'scaled_reinforce'?" in proc.stderr
    # Without the plugin package its names are unknown, and its keys too.
    proc = flowrl(tmp_path, "validate", str(pipeline(tmp_path, "scaled_reinforce")))
    assert proc.returncode == 1 and "unknown loss 'scaled_reinforce'" in proc.stderr


def test_a_plugin_entry_that_does_not_import_is_a_located_error(plugin_site: Path, tmp_path: Path) -> None:
    """A broken entry point costs only its own name: a spec that names it gets a located error,
    one that does not still validates, and `flowrl algorithms` lists the others and names it."""
    info = plugin_site / "acme_algos-0.1.dist-info/entry_points.txt"
    info.write_text(info.read_text() + "\n[flowrl.kl]\nbroken = acme_algos:MISSING\n")
    spec = str(pipeline(tmp_path, "scaled_reinforce"))
    assert flowrl(plugin_site, "validate", spec).returncode == 0
    proc = flowrl(plugin_site, "validate", spec, "nodes.learner.loss.kl={coef: 0.0, estimator: broken}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert ("nodes.learner.loss.kl.estimator: KL estimator 'broken' cannot be loaded: entry point broken = "
            "acme_algos:MISSING (flowrl.kl): AttributeError") in proc.stderr, proc.stderr
    listed = flowrl(plugin_site, "algorithms")
    assert listed.returncode == 1 and "scaled_reinforce" in listed.stdout and "Traceback" not in listed.stderr
    assert "cannot be loaded: entry point broken = acme_algos:MISSING" in listed.stderr
