"""How a sample's prompt becomes tokens: a text prompt gets the special tokens the tokenizer's
post-processor adds (a model trained with <bos> keeps it), chat messages get the chat template
(with the generation prompt) and nothing more, and the built-in tiny tokenizer adds nothing, so the
quickstart's prompts are unchanged."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import AddedToken, Tokenizer
from tokenizers.processors import TemplateProcessing

from flowrl_operators.inference import SamplingParams
from flowrl_operators.models import load_tokenizer, resolve_model
from flowrl_operators.workflows import WorkflowContext


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory):
    """The tiny tokenizer with a <bos> token that its post-processor puts before every text."""
    folder = tmp_path_factory.mktemp("bos")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(resolve_model("builtin:tiny-qwen2") / name, folder / name)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<bos>", special=True)])
    bos = tok.token_to_id("<bos>")
    tok.post_processor = TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", bos)])
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<bos>"}))
    return load_tokenizer(folder), bos


def prompt_ids(tokenizer, sample) -> list[int]:
    ctx = WorkflowContext(engine=None, tokenizer=tokenizer, sampling=SamplingParams(), sample_id="0:0")
    return ctx.prompt_ids(sample)


def test_a_text_prompt_gets_the_post_processors_bos(bos_tokenizer):
    tokenizer, bos = bos_tokenizer
    plain = tokenizer.encode("12+3=", add_special_tokens=False)
    assert prompt_ids(tokenizer, {"prompt": "12+3="}) == [bos, *plain]


def test_chat_messages_get_the_template_and_no_extra_bos(bos_tokenizer):
    tokenizer, bos = bos_tokenizer
    ids = prompt_ids(tokenizer, {"messages": [{"role": "user", "content": "hi"}]})
    assert ids == tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert bos not in ids
    assert prompt_ids(tokenizer, {"prompt_ids": [5, 6]}) == [5, 6]  # given ids are used as they are


def test_the_builtin_tiny_tokenizer_adds_nothing_so_the_quickstart_is_unchanged():
    tokenizer = load_tokenizer("builtin:tiny-qwen2")
    assert prompt_ids(tokenizer, {"prompt": "1234="}) == tokenizer.encode("1234=", add_special_tokens=False)
