"""Built-in models and checkpoint resolution (operators/models.py)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
import torch

from flowrl_operators import models


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _digest(folder) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def test_builtin_builds_once_into_the_cache_and_loads_offline(cache):
    folder = models.resolve_model("builtin:tiny-qwen2")
    assert folder == cache / "models" / "tiny-qwen2"
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert models.resolve_model("builtin:tiny-qwen2") == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    model = models.load_hf_model(folder)
    params = sum(p.numel() for p in model.parameters())
    assert 300_000 < params < 700_000, params
    assert model.config.model_type == "qwen2" and model.config.hidden_size == 128
    assert not list(cache.joinpath("models").glob(".*")), "scratch folders left behind"


def test_concurrent_builds_are_safe_and_deterministic(tmp_path, monkeypatch):
    """Two processes race to build into one cache; this process builds alone: same bytes everywhere."""
    code = "from flowrl_operators.models import resolve_model; print(resolve_model('builtin:tiny-qwen3'))"
    env = dict(os.environ, FLOWRL_CACHE=str(tmp_path / "shared"), HF_HUB_OFFLINE="1")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path / "alone"))
    alone = models.resolve_model("builtin:tiny-qwen3")
    outs = [p.communicate()[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] == str(tmp_path / "shared" / "models" / "tiny-qwen3")
    assert [p.name for p in (tmp_path / "shared" / "models").iterdir()] == ["tiny-qwen3"]
    assert _digest(models.Path(outs[0])) == _digest(alone)
    assert models.load_config(outs[0]).model_type == "qwen3"


def test_tokenizer_is_character_level_with_chat_template(cache):
    for name in ("tiny-qwen2", "tiny-llama"):
        tok = models.load_tokenizer(f"builtin:{name}")
        text = "Reverse: 1234\nanswer = 4321!"
        ids = tok.encode(text)
        assert len(ids) == len(text)
        assert tok.decode(ids) == text
        assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
        chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                       tokenize=False)
        assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        chat_ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
        if not isinstance(chat_ids, list):
            chat_ids = chat_ids["input_ids"]
        assert chat_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
        assert tok.convert_tokens_to_ids("<|im_end|>") in models.load_config(f"builtin:{name}").eos_token_id


def test_plain_paths_and_errors(cache, tmp_path):
    with pytest.raises(ValueError, match="known: builtin:tiny-qwen2"):
        models.resolve_model("builtin:no-such-model")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        models.resolve_model(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        models.resolve_model(tmp_path)
    # A copy of a built-in checkpoint loads like any local checkpoint.
    src = models.resolve_model("builtin:tiny-qwen2")
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in src.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert models.resolve_model(str(copy)) == copy
    a, b = models.load_hf_model(src), models.load_hf_model(copy)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb)
