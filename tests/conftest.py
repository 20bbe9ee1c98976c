"""Shared fixtures."""

from __future__ import annotations

import asyncio
import os

import pytest


@pytest.fixture(scope="module")
def ray_nodes():
    """A head (1 CPU) and worker nodes `a` and `b` (1 CPU each) started with `ray start` on
    127.0.0.1 (tests/ray_cluster.py); stopped after the module's tests, whatever they did."""
    pytest.importorskip("ray")
    from ray_cluster import LocalCluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = LocalCluster({"a": 1, "b": 1}).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def loop():
    """One event loop for a test module whose engine (a module fixture) lives across its tests."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()

