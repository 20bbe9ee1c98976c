"""The interpreter-lock probe (flowrl/runtime/lockprobe.py) on work whose share is known: Python code
holds the lock, sleeping and torch kernels do not; it knocks only while a span is open."""

import threading
import time

import pytest

from flowrl.runtime.lockprobe import LockProbe


def python_loop(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def share(work, seconds: float = 0.6) -> float:
    probe = LockProbe(mean_gap_s=0.002)
    try:
        opened = probe.open()
        work(seconds)
        held = probe.close(opened)
    finally:
        probe.stop()
    assert held is not None
    return held


def test_python_code_holds_the_lock_and_a_sleep_does_not():
    busy, idle = share(python_loop), share(time.sleep)
    assert busy > 0.8
    assert idle < busy - 0.4  # a loaded machine wakes a sleeper late too: the gap is what is asserted


def test_a_native_kernel_releases_the_lock():
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    a = torch.randn(384, 384)

    def matmuls(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            a @ a

    assert share(matmuls) < share(python_loop) - 0.4


def test_no_knock_outside_an_open_span_and_stop_ends_the_thread():
    before = threading.active_count()
    probe = LockProbe(mean_gap_s=0.001)
    assert threading.active_count() == before  # no span yet, no thread
    probe.close(probe.open())
    time.sleep(0.05)
    knocked = probe.counts
    time.sleep(0.05)
    assert probe.counts[1] <= knocked[1] + 1  # nothing open: the thread waits, it does not knock
    first = probe.open()
    second = probe.open()  # two spans open at once (nested): knocks until both close
    time.sleep(0.05)
    assert probe.close(first) is not None
    time.sleep(0.05)
    knocks = probe.counts[1]
    assert probe.close(second) is not None and knocks > 30
    time.sleep(0.05)
    assert probe.counts[1] <= knocks + 1  # at most the knock in flight when the last span closed
    probe.stop()
    assert threading.active_count() == before


def test_a_span_with_no_knock_measures_nothing():
    probe = LockProbe(mean_gap_s=60.0)
    try:
        assert probe.close(probe.open()) is None
    finally:
        probe.stop()
