"""The code-tool agent path (issue #45): the proxy's tool route in front of a real sandbox service,
prefix drift and chain breaks measured per call, the code_arith task and its agent, and a pipeline
run of smollm2_code.yaml's graph on the tiny built-in model."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import msgspec
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402

from flowrl.data.trajectory import Trajectory  # noqa: E402
from flowrl.operator import OperatorContext  # noqa: E402
from flowrl_operators.chat.template import chat_ids  # noqa: E402
from flowrl_operators.config import GenerateConfig  # noqa: E402
from flowrl_operators.generate import Generate  # noqa: E402
from flowrl_operators.inference import SamplingParams  # noqa: E402
from flowrl_operators.tasks import code_arith  # noqa: E402
from flowrl_operators.tasks.code_arith import code_block, exact  # noqa: E402
from flowrl_operators.workflows.proxy import Call, assemble, drift_tokens  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def node(loop):
    """A generate node serving the agent proxy with a sandbox behind it (real engine, real service)."""
    import torch

    torch.set_num_threads(1)
    config = msgspec.convert({"group_size": 2, "workflow": "agent",
                              "workflow_args": {"agent": "flowrl_operators.tasks.code_arith:agent"},
                              "sampling": {"temperature": 1.0, "max_new_tokens": 4},
                              "tools": {"sandbox": {"workers": 2, "wall_s": 5}}}, GenerateConfig)
    op = Generate(config, OperatorContext(node="rollout", model={"path": "builtin:tiny-qwen2"}, seed=3))
    loop.run_until_complete(op.setup())
    yield op
    loop.run_until_complete(op.close())


def post(url: str, body: object) -> httpx.Response:
    return httpx.post(url, json=body, timeout=30)


def test_the_tool_route_runs_code_in_the_sandbox_and_records_the_call(node, loop):
    proxy = node.services["proxy"]
    base = proxy.open_session("tools-1")

    async def calls():
        def run():
            ok = post(f"{base}/tools/sandbox", {"code": "print(47 * 38 + 12)"})
            bad = post(f"{base}/tools/sandbox", {"code": "1/0"})
            return ok, bad
        return await asyncio.to_thread(run)

    ok, bad = loop.run_until_complete(calls())
    assert ok.status_code == 200 and ok.json()["stdout"] == "1798\n" and ok.json()["ok"] is True
    assert set(ok.json()["timing"]) == {"queue_s", "start_s", "run_s"}
    # The code's own error is a result, not a failed request.
    assert bad.status_code == 200 and bad.json()["error"] == "exception" and "ZeroDivisionError" in bad.json()["stderr"]
    session = proxy.end_session("tools-1")
    assert [(t.tool, t.ok) for t in session.tool_calls] == [("sandbox", True), ("sandbox", False)]
    assert all(t.seconds >= t.timing["run_s"] > 0 for t in session.tool_calls)


@pytest.mark.parametrize(("path", "body", "status", "message"), [
    ("tools/shell", {"code": "print(1)"}, 404, "no tool 'shell': this generate node serves sandbox"),
    ("tools/sandbox", {"cmd": "ls"}, 400, "a tool call's body is"),
    ("tools/sandbox", {"code": "print(1)", "env": {}}, 400, "unknown key(s) env"),
    ("tools/sandbox", {"code": "print(1)", "timeout_s": -1}, 400, "timeout_s must be a positive number"),
    ("tools/sandbox", {"code": "print(1)", "timeout_s": True}, 400, "timeout_s must be a positive number"),
])
def test_a_bad_tool_request_is_refused_with_a_message(node, loop, path, body, status, message):
    proxy = node.services["proxy"]
    base = proxy.open_session("tools-bad")
    try:
        response = loop.run_until_complete(asyncio.to_thread(post, f"{base}/{path}", body))
    finally:
        session = proxy.end_session("tools-bad")
    assert response.status_code == status and message in response.json()["error"]["message"]
    assert session.tool_calls == []  # nothing ran


def test_a_closed_session_has_no_tools(node, loop):
    proxy = node.services["proxy"]
    base = proxy.open_session("tools-closed")
    proxy.end_session("tools-closed")
    response = loop.run_until_complete(asyncio.to_thread(post, f"{base}/tools/sandbox", {"code": "print(1)"}))
    assert response.status_code == 404 and "no open session" in response.json()["error"]["message"]


def test_drift_counts_the_tokens_a_plain_re_rendering_changes(node):
    """Spliced prompts keep the sampled ids of a reply; where those are not what the tokenizer makes of
    the reply's text (BPE merges a sampler need not follow), a plain re-rendering changes every token
    from that point on: that count is the call's drift."""
    proxy, tokenizer = node.services["proxy"], node.tokenizer
    messages = [{"role": "user", "content": "What is 47 * 38 + 12?"}, {"role": "assistant", "content": "print(1798)"},
                {"role": "user", "content": "again"}]
    canonical = chat_ids(tokenizer, messages)
    assert proxy.drift(messages, None, canonical) == 0
    at = len(chat_ids(tokenizer, messages[:1])) + 2  # inside the reply
    sampled = canonical[:at] + [canonical[at] + 1] + canonical[at + 1:]
    assert proxy.drift(messages, None, sampled) == len(canonical) - at
    assert drift_tokens([1, 2, 3], [1, 2, 3]) == 0 and drift_tokens([1, 2, 3], [1, 9, 3, 4]) == 3
    assert drift_tokens([1, 2], [1, 2, 5]) == 1


def _call(prompt: list[int], output: list[int], drift: int = 0) -> Call:
    return Call(prompt, output, [-0.5] * len(output), [0] * len(output), "stop", SamplingParams(), [], drift)


def test_assemble_records_drift_chain_breaks_and_tools():
    from flowrl_operators.workflows.proxy import ToolCall

    first = _call([1, 2], [3, 4])
    second = _call([1, 2, 3, 4, 5], [6], drift=2)  # extends the first
    stray = _call([9], [7], drift=1)  # a conversation of its own
    tools = [ToolCall("sandbox", 0.25, True, {"queue_s": 0.1, "start_s": 0.05, "run_s": 0.08}),
             ToolCall("sandbox", 0.5, False, {"queue_s": 0.0, "start_s": 0.04, "run_s": 0.4})]
    chain, other = assemble([first, second, stray], version=0, tool_calls=tools)
    assert chain.metadata["drift_tokens"] == 2 and other.metadata["drift_tokens"] == 1
    assert chain.metadata["chain_breaks"] == other.metadata["chain_breaks"] == 1
    assert chain.metadata["tool_calls"] == 2 and chain.metadata["tool_s"] == 0.75
    assert chain.metadata["tool_timing"] == [{"seconds": 0.25, "queue_s": 0.1, "start_s": 0.05, "run_s": 0.08},
                                             {"seconds": 0.5, "queue_s": 0.0, "start_s": 0.04, "run_s": 0.4}]
    (alone,) = assemble([first, second], version=0)
    assert alone.metadata["chain_breaks"] == 0 and alone.metadata["tool_calls"] == 0
    assert alone.metadata["tool_timing"] == []


@pytest.mark.parametrize(("text", "code"), [
    ("Here:\n```python\nprint(6 * 7)\n```\nDone.", "print(6 * 7)\n"),
    ("```py\nx = 6\nprint(x * 7)\n```", "x = 6\nprint(x * 7)\n"),
    ("```python\nprint(6 * 7)", "print(6 * 7)"),  # cut by max_new_tokens: runs to the end
    ("```\nprint(1)\n```", "print(1)\n"),
    ("print(6 * 7)", None),
    ("```python\n\n```", None),
])
def test_code_block(text, code):
    assert code_block(text) == code


def _answered(sample: dict, final: str | None) -> Trajectory:
    info = {} if final is None else {"final": final}
    return Trajectory(id="t", group_id="g", sample_id="s", prompt_ids=[1], response_ids=[2], loss_mask=[1],
                      behaviour_logprobs=[-0.1], versions=[0],
                      metadata={"sample": sample, "info": info, "text": "reply " + sample["answer"]})


def test_the_task_draws_disjoint_splits_and_scores_the_printed_answer():
    import re

    from flowrl_operators.tasks.code_arith import KINDS

    train = [code_arith(seed=1).sample(0, i) for i in range(300)]
    held = {code_arith().eval_sample(i)["question"] for i in range(300)}
    assert not held & {s["question"] for s in train}
    assert {s["kind"] for s in train} == set(KINDS)
    for sample in train[:50]:  # the value is the question's: recomputed from the numbers in its text
        a, b, c = (int(x) for x in re.findall(r"\d+", sample["question"]))
        assert sample["answer"] == str(a * b + c if sample["kind"] == "plus" else a * b - c)
        assert sample["prompt"].startswith(sample["question"])
    sample = train[0]
    value = sample["answer"]
    assert code_arith.reward(_answered(sample, value)) == exact(_answered(sample, value)) == 1.0
    assert code_arith.reward(_answered(sample, f"The result is {value}")) == 1.0  # the computation counts
    assert exact(_answered(sample, f"The result is {value}")) == 0.0  # not the value alone
    assert code_arith.reward(_answered(sample, f"1{value}")) == 0.0 and code_arith.reward(_answered(sample, "")) == 0.0
    # A one-reply trajectory (the validate probe's) is scored on its text.
    assert code_arith.reward(_answered(sample, None)) == 1.0 and exact(_answered(sample, None)) == 0.0
    with pytest.raises(ValueError, match="low <= high"):
        code_arith(low=50, high=10)


@pytest.mark.slow
def test_the_pipeline_runs_the_agent_through_proxy_and_sandbox(tmp_path):
    """smollm2_code.yaml's graph on the tiny model: episodes, the reward node on the agent's answer,
    the evaluation with its second score, and the proxy's counts in the metrics."""
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "flowrl.cli", "run", str(ROOT / "pipelines/smollm2_code.yaml"),
                    "model.path=builtin:tiny-qwen2", "run.steps=2", "data.eval.samples=4", "data.eval.every=2",
                    "nodes.rollout.sampling.max_new_tokens=8", "nodes.rollout.group_size=2", "data.batch_size=2",
                    "nodes.learner.freeze=[]", "--run-dir", str(run_dir), "--quiet"],
                   check=True, cwd=ROOT, timeout=600)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    generate = rows[-1]["operators"]["rollout"]
    assert generate["generate/episodes"] >= 8 and generate["generate/episode_errors"] == 0
    assert generate["generate/chain_breaks"] == 0  # every call extended its episode's conversation
    assert "generate/drift_tokens" in generate and "generate/tool_calls" in generate
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, 2] and all("exact" in e["scores"] for e in evals)


SMOLLM2 = Path(__file__).resolve().parents[1] / "models/smollm2-135m-instruct"


@pytest.mark.slow
@pytest.mark.skipif(not (SMOLLM2 / "config.json").exists(), reason="models/smollm2-135m-instruct not built "
                    "(python tools/get_smollm2.py)")
def test_the_temperature_probe_reports_rates_per_temperature() -> None:
    """tools/probe_code_arith.py (the screening behind smollm2_code.yaml's temperature), cut small."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "tools/probe_code_arith.py", str(SMOLLM2), "--prompts", "2", "--group", "2",
                           "--temperatures", "0.5,1.0", "--max-new-tokens", "24", "--sample-seed", "3"],
                          cwd=SMOLLM2.parents[1], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [line["temperature"] for line in lines] == [0.5, 1.0]
    assert all(0.0 <= line["mean_reward"] <= 1.0 and 0.0 <= line["informative_groups"] <= 1.0 for line in lines)
