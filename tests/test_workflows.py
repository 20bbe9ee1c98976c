"""Workflows on the real embedded engine: exact token ids, loss masks and turn boundaries of
multi-turn (guess-the-number) trajectories, single-turn and supervised workflows, workflow names."""

from __future__ import annotations

import asyncio
import os

import pytest
from engines import embedded_engine

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flowrl_operators.inference import GenerateRequest, SamplingParams  # noqa: E402
from flowrl_operators.tasks import GuessNumberEnv, calculator, guess_number, reverse_digits  # noqa: E402
from flowrl_operators.workflows import (  # noqa: E402
    EnvironmentWorkflow,
    WorkflowContext,
    continuation_ids,
    load_workflow,
    single_turn,
    supervised,
)
from flowrl_operators.workflows.base import derive_seed  # noqa: E402

MODEL = "builtin:tiny-qwen2"


@pytest.fixture(scope="module")
def engine(loop):
    yield from embedded_engine(loop, MODEL, 16)


@pytest.fixture(scope="module")
def tok():
    from flowrl_operators.models import load_tokenizer

    return load_tokenizer(MODEL)


def context(engine, tok, sample_id="0:0", episode=0, **sampling) -> WorkflowContext:
    return WorkflowContext(engine=engine, tokenizer=tok, sampling=SamplingParams(**sampling),
                           sample_id=sample_id, episode=episode, seed=7)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_guess_number_token_ids_masks_and_turns(loop, engine, tok):
    """Every model span is exactly what the engine samples for that prefix (replayed with the same
    seed); every other response token is the literal chat text of the environment's reply."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    source = guess_number(seed=3)
    workflow = load_workflow("builtin:guess_number", {"max_turns": 4})
    lengths_seen = set()
    for index in range(4):
        sample = source.sample(0, index)
        ctx = context(engine, tok, f"0:{index}", index % 2, temperature=1.0, max_new_tokens=5)
        t = loop.run_until_complete(workflow(ctx, sample))
        t.validate()
        assert t.prompt_ids == encode(tok, f"<|im_start|>user\n{sample['prompt']}<|im_end|>\n<|im_start|>assistant\n")
        env = GuessNumberEnv()
        env.reset(sample)
        rewards, cursor, observation = [], 0, None
        assert 1 <= len(t.turns) <= 4 and t.turns[0].start == 0
        for k, turn in enumerate(t.turns):
            if k:  # the environment's reply to turn k-1 fills the gap before turn k
                gap = t.response_ids[cursor:turn.start]
                closing = "\n" if t.response_ids[cursor - 1] == im_end else "<|im_end|>\n"
                assert gap == encode(tok, f"{closing}<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n")
                assert t.loss_mask[cursor:turn.start] == [0] * len(gap)
                assert t.behaviour_logprobs[cursor:turn.start] == [0.0] * len(gap)
            model_ids = t.response_ids[turn.start:turn.end]
            assert t.loss_mask[turn.start:turn.end] == [1] * len(model_ids) and model_ids
            replay = loop.run_until_complete(engine.generate(GenerateRequest(
                request_id=f"replay-{index}-{k}", input_ids=t.prompt_ids + t.response_ids[:turn.start],
                sampling=SamplingParams(temperature=1.0, max_new_tokens=5,
                                        seed=derive_seed(7, f"0:{index}", index % 2, k + 1)))))
            assert replay.output_ids == model_ids
            assert replay.logprobs == pytest.approx(t.behaviour_logprobs[turn.start:turn.end], abs=1e-4)
            assert t.versions[turn.start:turn.end] == replay.versions == [0] * len(model_ids)
            lengths_seen.add(model_ids[-1] == im_end)
            step = asyncio.run(env.step(tok.decode(model_ids, skip_special_tokens=True)))
            observation = step.observation
            rewards.append(step.reward)
            cursor = turn.end
        assert cursor == len(t.response_ids)  # nothing trails the last model turn
        assert t.turn_rewards == rewards and t.reward == pytest.approx(sum(rewards))
        assert t.metadata["turns"] == len(t.turns) and t.metadata["sample"] == sample
    assert False in lengths_seen  # a turn cut by max_new_tokens got the template's closing tokens


def test_continuation_after_stop_token_and_tool_messages(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    history = [{"role": "user", "content": "q"}]
    tool = [{"role": "tool", "content": "391"}]
    after_stop = continuation_ids(tok, history, tool, [7, im_end])
    assert after_stop == encode(tok, "\n<|im_start|>tool\n391<|im_end|>\n<|im_start|>assistant\n")
    cut = continuation_ids(tok, history, tool + [{"role": "user", "content": "go"}], [7, 8])
    assert cut == encode(tok, "<|im_end|>\n<|im_start|>tool\n391<|im_end|>\n<|im_start|>user\ngo<|im_end|>\n"
                              "<|im_start|>assistant\n")


def test_calculator_episode_interleaves_tool_messages(loop, engine, tok):
    sample = calculator(seed=1).sample(0, 0)
    t = loop.run_until_complete(load_workflow("builtin:calculator", {"max_turns": 3})(
        context(engine, tok, temperature=1.0, max_new_tokens=4), sample))
    spans = [(turn.start, turn.end) for turn in t.turns]
    mask = [0] * len(t.response_ids)
    for start, end in spans:
        mask[start:end] = [1] * (end - start)
    assert t.loss_mask == mask and len(t.turn_rewards) == len(t.turns) == len(spans)


def test_single_turn_and_supervised(loop, engine, tok):
    sample = reverse_digits(seed=0).sample(0, 0)
    ctx = context(engine, tok, temperature=0.0, max_new_tokens=8)
    t = loop.run_until_complete(single_turn(ctx, sample))
    assert t.prompt_ids == encode(tok, sample["prompt"]) and len(t.turns) == 1
    greedy = loop.run_until_complete(engine.generate(GenerateRequest(
        request_id="greedy", input_ids=t.prompt_ids, sampling=SamplingParams(temperature=0.0, max_new_tokens=8))))
    assert t.response_ids == greedy.output_ids and t.loss_mask == [1] * len(t.response_ids)
    s = loop.run_until_complete(supervised(ctx, sample))
    assert s.response_ids == encode(tok, sample["target"]) + [tok.eos_token_id]
    assert s.loss_mask == [1] * len(s.response_ids) and s.versions == [engine.version] * len(s.response_ids)
    assert [(turn.start, turn.end) for turn in s.turns] == [(0, len(s.response_ids))]
    chat = reverse_digits(seed=0, chat=True).sample(0, 0)
    assert loop.run_until_complete(single_turn(ctx, chat)).prompt_ids == encode(
        tok, f"<|im_start|>user\n<{chat['digits']}><|im_end|>\n<|im_start|>assistant\n")


def test_prompt_ids_are_tokenised_once_per_group(engine, tok):
    """Episodes of one group share the generate node's cache: one tokenisation per sample object,
    a copy for each caller, and another sample object is never served a cached prompt."""
    calls = []

    class Counting:  # the real tokenizer, with its encode calls counted
        def __getattr__(self, name):
            return getattr(tok, name)

        def encode(self, text, **kwargs):
            calls.append(text)
            return tok.encode(text, **kwargs)

    cache: dict = {}
    sample = reverse_digits(seed=0).sample(0, 0)
    contexts = [WorkflowContext(engine=engine, tokenizer=Counting(), sampling=SamplingParams(), sample_id="0:0",
                                episode=i, prompt_cache=cache) for i in range(3)]
    ids = [c.prompt_ids(sample) for c in contexts]
    assert ids[0] == encode(tok, sample["prompt"]) and ids[0] == ids[1] == ids[2] and ids[0] is not ids[1]
    assert calls == [sample["prompt"]]
    ids[0].append(0)  # a caller's copy: the cache is untouched
    assert contexts[1].prompt_ids(sample) == encode(tok, sample["prompt"])
    other = reverse_digits(seed=0).sample(0, 1)
    assert contexts[0].prompt_ids(other) == encode(tok, other["prompt"]) and len(calls) == 2


class Counter:
    """A custom environment: counts to 3. Used through `module:attr`."""

    def reset(self, sample):
        self.n = 0
        return "count"

    def step(self, action):
        self.n += 1
        return "more", 1.0, self.n >= 3


def test_load_workflow_names():
    assert load_workflow("single_turn") is single_turn and load_workflow("supervised") is supervised
    assert load_workflow("builtin:reverse_digits") is single_turn
    env = load_workflow("test_workflows:Counter", {"max_turns": 5})
    assert isinstance(env, EnvironmentWorkflow) and env.make_env is Counter and env.max_turns == 5
    assert isinstance(load_workflow("environment", {"env": "test_workflows:Counter"}), EnvironmentWorkflow)
    for name, message in [("nope", "unknown workflow"), ("builtin:nope", "unknown built-in task"),
                          ("agent", "workflow_args.agent")]:
        with pytest.raises(ValueError, match=message):
            load_workflow(name)


def test_custom_sync_environment_runs_to_done(loop, engine, tok):
    t = loop.run_until_complete(load_workflow("test_workflows:Counter", {"max_turns": 5})(
        context(engine, tok, temperature=1.0, max_new_tokens=3), {}))
    assert len(t.turns) == 3 and t.turn_rewards == [1.0, 1.0, 1.0] and t.metadata["done"]
    assert t.finish_reason in ("stop", "length")
