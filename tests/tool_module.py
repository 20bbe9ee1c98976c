"""A script of tools/ as a module, for the tests of the benchmarks and tools (tools/ is no package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def tool(name: str) -> ModuleType:
    """tools/NAME.py, executed afresh as module NAME."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
