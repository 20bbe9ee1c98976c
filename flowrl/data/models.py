"""Model folders as the engine sees them: a local Hugging Face folder, or `builtin:<name>`.

Built-in models are entry points of the group `flowrl.models` (the operator library registers its
own in pyproject.toml, as a plugin package would): each name loads to a function `name -> folder`
that builds the model on first use. flowrl needs the folder only for a data source that asks for
the pipeline model's tokenizer, and the names for `flowrl validate`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flowrl import plugins

GROUP = "flowrl.models"
PREFIX = "builtin:"


def builtin_names() -> list[str]:
    """Every registered built-in model, without importing any of them."""
    return sorted(plugins.targets(GROUP))


def folder(path: str) -> Path:
    """The local folder of `path`: `builtin:<name>` built (or found in the cache) by its registrant."""
    if not path.startswith(PREFIX):
        return Path(path).expanduser()
    name = path.removeprefix(PREFIX)
    build = plugins.load(GROUP).get(name)
    if build is None:
        raise ValueError(unknown(path))
    return Path(build(name))


def unknown(path: str) -> str:
    """Why `builtin:<name>` names no model: its entry point did not load, or none is registered."""
    why = plugins.broken(GROUP).get(path.removeprefix(PREFIX))
    known = ", ".join(PREFIX + n for n in builtin_names())
    return f"built-in model '{path}' cannot be loaded: {why}" if why else f"unknown built-in model '{path}'; known: {known}"


def load_tokenizer(path: str) -> Any:
    """The tokenizer of the model at `path`, offline, without Hugging Face's progress bars."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(str(folder(path)), local_files_only=True)
