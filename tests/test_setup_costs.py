"""What a run's set-up must not pay for (tools/bench_setup.py measures the time): checking a
training engine's name loads no engine (`flowrl validate` stays free of the trainer's imports), and
the embedded engine builds its model without importing torch._dynamo (a random init on the meta
device did: ~1.8 s). Each check runs in a fresh interpreter, since this one has imported everything."""

from __future__ import annotations

import subprocess
import sys

import pytest


def fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_checking_an_engine_name_loads_no_engine() -> None:
    out = fresh(
        "import sys\n"
        "from flowrl_operators.training.engine import check_name\n"
        "assert check_name('fsdp2') is None\n"
        "print(check_name('fsdp'))\n"
        "print('flowrl_operators.training.trainer' in sys.modules)\n"
    )
    problem, loaded = out.splitlines()
    assert "unknown training engine 'fsdp'" in problem and "did you mean 'fsdp2'" in problem
    assert loaded == "False"


@pytest.mark.parametrize("model", ["builtin:tiny-qwen2", "builtin:tiny-llama"])
def test_the_engine_model_loads_without_torch_dynamo(model: str) -> None:
    out = fresh(
        "import sys, torch\n"
        "from flowrl_operators.engine.embedded.load import load_model\n"
        "from flowrl_operators.models import resolve_model\n"
        f"m = load_model(resolve_model({model!r}), torch.float32, 'cpu')\n"
        "w = m.model.embed_tokens.weight\n"
        "print('torch._dynamo' in sys.modules, w.device.type, bool(w.abs().sum() > 0))\n"
    )
    assert out == "False cpu True"  # and the embedding holds the checkpoint's weights, not zeros
