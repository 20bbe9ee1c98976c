"""The teacher node (on-policy distillation): on trajectories the real embedded engine sampled from
builtin:tiny-qwen2 at temperature 0.7, its token rewards equal the teacher's (builtin:tiny-qwen2-large)
logprob of each token at that temperature, computed here by hand with Hugging Face, minus the
engine's behaviour logprob; the task reward is added as documented; a teacher with another
tokenizer is refused with a message naming the key."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import msgspec
import pytest
import torch

from flowrl.cli import main
from flowrl.data.trajectory import Group, Trajectory
from flowrl.operator import ConfigError, OperatorContext
from flowrl_operators.config import GenerateConfig
from flowrl_operators.generate import Generate
from flowrl_operators.models import load_hf_model, resolve_model
from flowrl_operators.tasks import reverse_digits
from flowrl_operators.teacher import Teacher, TeacherConfig, check_vocabulary

STUDENT, TEACHER = "builtin:tiny-qwen2", "builtin:tiny-qwen2-large"
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def sampled() -> list[Trajectory]:
    """Two groups of 4 from the student on the embedded engine, one token marked as an environment
    token (loss mask 0), with sequence rewards."""
    async def main() -> list[Trajectory]:
        config = msgspec.convert({"group_size": 4, "sampling": {"temperature": TEMPERATURE, "max_new_tokens": 8}},
                                 GenerateConfig)
        gen = Generate(config, OperatorContext(node="rollout", model={"path": STUDENT}, seed=3))
        await gen.setup()
        try:
            task = reverse_digits(seed=0)
            groups = [await gen.generate(task.sample(0, k), step=0, sample_id=f"0:{k}") for k in range(2)]
        finally:
            await gen.close()
        return [t for g in groups for t in g.trajectories]

    torch.set_num_threads(1)
    trajectories = asyncio.run(main())
    assert all(t.sampling and t.sampling[0].temperature == TEMPERATURE for t in trajectories)
    long = next(t for t in trajectories if len(t.response_ids) >= 3)
    long.loss_mask[1] = 0  # as if the environment had written it: no KL reward there
    for i, t in enumerate(trajectories):
        t.reward = 0.25 * i
    return trajectories


def teacher_logprobs_by_hand(trajectories: list[Trajectory]) -> list[list[float]]:
    model = load_hf_model(TEACHER).eval()
    out = []
    with torch.no_grad():
        for t in trajectories:
            ids = torch.tensor([t.prompt_ids + t.response_ids])
            logits = model(input_ids=ids).logits[0, len(t.prompt_ids) - 1 : -1] / TEMPERATURE
            out.append(torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(t.response_ids)[:, None])[:, 0].tolist())
    return out


def score(trajectories: list[Trajectory], **config) -> tuple[list[Trajectory], dict[str, float]]:
    async def main() -> tuple[list[Trajectory], dict[str, float]]:
        op = Teacher(msgspec.convert({"model": {"path": TEACHER}, **config}, TeacherConfig),
                     OperatorContext(node="teach", seed=1, model={"path": STUDENT}))
        await op.setup()
        copies = [msgspec.structs.replace(t, loss_mask=list(t.loss_mask)) for t in trajectories]
        out = await op.process({"trajectories": Group(id="g", step=0, trajectories=copies)})
        return out["trajectories"].trajectories, op.metrics()

    return asyncio.run(main())


def test_token_rewards_are_teacher_minus_behaviour_logprobs(sampled: list[Trajectory]) -> None:
    expected = teacher_logprobs_by_hand(sampled)
    scored, metrics = score(sampled, coef=2.0)
    kl, tokens = 0.0, 0
    for t, teacher in zip(scored, expected, strict=True):
        by_hand = [2.0 * (lp - b) if m else 0.0 for lp, b, m in zip(teacher, t.behaviour_logprobs, t.loss_mask, strict=True)]
        assert t.token_rewards is not None
        assert max(abs(a - b) for a, b in zip(t.token_rewards, by_hand, strict=True)) < 1e-4
        kl += sum(b - lp for lp, b, m in zip(teacher, t.behaviour_logprobs, t.loss_mask, strict=True) if m)
        tokens += sum(t.loss_mask)
    assert any(m == 0 for t in scored for m in t.loss_mask)  # the environment token got 0
    # A random teacher and student disagree: the rewards are far from 0, and the KL estimate is reported.
    assert max(abs(r) for t in scored for r in t.token_rewards or []) > 0.5
    assert metrics["teacher/tokens"] == tokens
    assert metrics["teacher/reverse_kl"] == pytest.approx(kl / tokens, abs=1e-4)
    assert [t.reward for t in scored] == [t.reward for t in sampled]  # the task's score is left as it was


def test_task_reward_is_added_on_the_last_model_token(sampled: list[Trajectory]) -> None:
    alone, _ = score(sampled)
    mixed, _ = score(sampled, coef=1.0, task_coef=0.5)
    for a, m, t in zip(alone, mixed, sampled, strict=True):
        last = max(i for i, keep in enumerate(t.loss_mask) if keep)
        added = [x - y for x, y in zip(m.token_rewards or [], a.token_rewards or [], strict=True)]
        assert added == pytest.approx([0.5 * t.reward if i == last else 0.0 for i in range(len(added))], abs=1e-6)


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path: Path) -> None:
    student = resolve_model(STUDENT)
    check_vocabulary(TEACHER, STUDENT, "teach")  # same tokenizer: accepted
    wider = tmp_path / "wider"
    shutil.copytree(student, wider)
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 8}))
    with pytest.raises(ConfigError, match=r"nodes\.teach\.model\.path: the teacher .* vocabulary of \d+ ids"):
        check_vocabulary(str(wider), STUDENT, "teach")
    swapped = tmp_path / "swapped"
    shutil.copytree(student, swapped)
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["0"], vocab["1"] = vocab["1"], vocab["0"]
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError, match=r"nodes\.teach\.model\.path: .* tokenize differently \(first differing token '[01]'\)"):
        check_vocabulary(str(swapped), STUDENT, "teach")


def test_a_run_with_a_wrong_teacher_stops_at_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wider = tmp_path / "wider"
    shutil.copytree(resolve_model(STUDENT), wider)
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 8}))
    spec = tmp_path / "p.yaml"
    spec.write_text(f"""flowrl: 1
name: wrong-teacher
model: {{path: {STUDENT}}}
data: {{source: builtin:reverse_digits, batch_size: 2}}
cluster: {{cpus: 2}}
run: {{steps: 1}}
nodes:
  rollout: {{op: generate, group_size: 2, sampling: {{max_new_tokens: 4}}}}
  score: {{op: reward, fn: builtin:reverse_digits}}
  teach: {{op: teacher, model: {{path: {wider}}}}}
  learner: {{op: train}}
  publish: {{op: sync}}
edges: [rollout -> score, score -> teach, teach -> learner, learner -> publish, {{publish -> rollout: {{kind: weights}}}}]
""")
    assert main(["run", str(spec), "--run-dir", str(tmp_path / "run"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{spec}:10:38 nodes.teach.model.path: the teacher ({wider}) has a vocabulary of")
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_config_rejects_a_node_that_credits_nothing() -> None:
    with pytest.raises(msgspec.ValidationError, match="would credit nothing"):
        msgspec.convert({"model": {"path": TEACHER}, "coef": 0.0}, TeacherConfig)
