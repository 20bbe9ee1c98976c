"""The algorithm registries' contract: pyproject.toml registers every built-in entry, each loads to
an Algorithm of its name whose config subclasses the concept's config class and documents its
formula; `flowrl algorithms` lists them all."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import tomllib

from flowrl.cli import main
from flowrl_operators.training.registry import REGISTRIES, Algorithm, AlgorithmError

ROOT = Path(__file__).resolve().parents[1]
DECLARED = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]


@pytest.mark.parametrize("registry", REGISTRIES, ids=lambda r: r.group)
def test_every_built_in_entry_loads_and_documents_itself(registry) -> None:
    declared = DECLARED[registry.group]
    assert registry.default in declared
    entries = registry.entries()
    assert set(declared) <= set(entries)
    for name in declared:
        entry = entries[name]
        assert isinstance(entry, Algorithm) and entry.name == name
        assert issubclass(entry.config, registry.base) and entry.config is not registry.base
        assert len(entry.doc) > 10, name  # the formula and its source
        required = [f.name for f in msgspec.structs.fields(entry.config) if f.required]
        if required:  # e.g. reject's checks, seq_mean_token_sum_norm's norm_length
            with pytest.raises(msgspec.ValidationError, match=f"missing required field `{required[0]}`"):
                registry.config(name)
        else:  # its defaults are a valid config
            assert getattr(registry.config(name), registry.key) == name
    with pytest.raises(AlgorithmError, match=f"unknown {registry.concept} 'nope'"):
        registry.get("nope")


def test_flowrl_algorithms_lists_every_entry(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["algorithms"]) == 0
    out = capsys.readouterr().out
    for registry in REGISTRIES:
        for name, entry in registry.entries().items():
            assert f"{name}  ({entry.config.__module__}:{entry.config.__qualname__})" in out
