"""glibc's mmap threshold (operators/memory.py) is fixed for models of SMALL_MODEL_BYTES and more
only: a small model's activations would each be mapped and page-faulted in again. In a fresh
interpreter, since the setting is process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flowrl_operators.memory import _libc


@pytest.mark.skipif(_libc() is None or "MALLOC_MMAP_THRESHOLD_" in os.environ, reason="needs glibc, unset env")
def test_the_threshold_is_fixed_for_large_models_only() -> None:
    code = (
        "from flowrl_operators import memory\n"
        "from flowrl_operators.training.trainer import Trainer\n"
        "Trainer('builtin:tiny-qwen2')\n"  # 2 MB of weights: left alone
        "print(memory._fix_threshold.cache_info().currsize, memory.configure(1 << 20))\n"
        "print(memory.configure(memory.SMALL_MODEL_BYTES), memory._fix_threshold.cache_info().currsize)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", "False", "True", "1"]
