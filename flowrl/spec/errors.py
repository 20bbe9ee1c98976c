"""Located spec errors: `file:line:col key.path: message`."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass

Path = tuple[str | int, ...]


def format_path(path: Path) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier():
            out += ("." if out else "") + part
        else:
            out += f'["{part}"]'
    return out


@dataclass(frozen=True)
class Diagnostic:
    file: str
    line: int  # 1-based; 0 when the problem has no place in the file (a command-line override)
    col: int
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}:{self.col}" if self.line else self.file
        return f"{where} {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


class SpecError(Exception):
    """One or more located problems in a pipeline spec."""

    def __init__(self, diagnostics: Iterable[Diagnostic]) -> None:
        self.diagnostics = list(diagnostics)
        super().__init__("\n".join(str(d) for d in self.diagnostics))


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


class UserError(Exception):
    """A mistake the user can fix that has no place in a spec file (a missing run directory, say):
    the command line prints its message alone, with no traceback."""
