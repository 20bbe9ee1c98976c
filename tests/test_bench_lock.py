"""tools/bench_lock.py: a tiny real invocation (the train pass and two embedded engines in threads of
this process) gives rates and a handoff efficiency that are ratios of its own timings, and the
command line refuses sizes below one."""

from __future__ import annotations

import json

import pytest
from tool_module import tool


def test_a_tiny_real_invocation(capsys):
    tool("bench_lock").main(["--rows", "4", "--length", "4", "--slots", "4", "--tokens", "4", "--calls", "2",
                             "--repeats", "1"])
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["train_rate"] == pytest.approx(result["train_alone_s"] / result["train_beside_s"], abs=2e-3)
    assert result["engine_rate"] == pytest.approx(result["engine_alone_s"] / result["engine_beside_s"], abs=2e-3)
    assert all(result[k] > 0 for k in ("train_alone_s", "train_beside_s", "engine_alone_s", "engine_beside_s",
                                       "handoff"))
    assert result["args"]["slots"] == 4 and "of the speed of taking turns" in out


def test_the_command_line_refuses_sizes_below_one(capsys):
    with pytest.raises(SystemExit):
        tool("bench_lock").main(["--slots", "0"])
    assert "at least 1 each" in capsys.readouterr().err
