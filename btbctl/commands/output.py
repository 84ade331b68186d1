"""The single output sink of the CLI: results to stdout (human or JSON), diagnostics to stderr."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from enum import Enum
from typing import Any


class Format(str, Enum):
    """Output format of commands that report."""

    human = "human"
    json = "json"


#: Width of a console that is not a terminal (piped, redirected): wide enough that no line is broken; tables are
#: only as wide as their content.
PIPE_WIDTH = 4096


def make_console(stderr: bool = False):
    """A rich console on stdout or stderr. On a terminal it takes the terminal's width; piped or redirected it
    breaks no line (rich's fallback would wrap at 80 columns mid-word), unless ``COLUMNS`` asks for a width."""
    import os

    from rich.console import Console

    con = Console(stderr=stderr, highlight=False)
    if not con.is_terminal and not os.environ.get("COLUMNS"):
        con = Console(stderr=stderr, highlight=False, width=PIPE_WIDTH)
    return con


class Output:
    """Where every command prints.

    ``result`` writes the command's result to stdout: JSON (stable keys, sorted as given, two-space indent) in
    ``json`` mode, else whatever ``human`` renders with a rich console. ``info``/``warn`` go to stderr.
    """

    def __init__(self, fmt: Format | str = Format.human, quiet: bool = False) -> None:
        self.format = Format(fmt)
        self.quiet = quiet
        self._out = None
        self._err = None

    @property
    def console(self):
        """Rich console on stdout (human results); see :func:`make_console` for its width."""
        if self._out is None:
            self._out = make_console(stderr=False)
        return self._out

    @property
    def err_console(self):
        """Rich console on stderr (diagnostics, progress)."""
        if self._err is None:
            self._err = make_console(stderr=True)
        return self._err

    def result(self, data: Any, human: Callable[[Any], None] | None = None) -> None:
        if self.format is Format.json or human is None:
            sys.stdout.write(json.dumps(data, indent=2, default=_json_default) + "\n")
            sys.stdout.flush()
        else:
            human(data)

    def info(self, message: str) -> None:
        """A diagnostic line on stderr, printed as plain text (square brackets are not markup)."""
        if not self.quiet:
            self.err_console.print(message, markup=False, soft_wrap=True)

    def warn(self, message: str) -> None:
        from rich.markup import escape

        self.err_console.print(f"[yellow]warning:[/yellow] {escape(message)}", soft_wrap=True)

    def progress(self, description: str, total: int, *, lines_when_piped: bool = False):
        """A context manager yielding ``advance(n)``: a rich progress bar on stderr when it is a terminal; when it
        is not, plain progress lines if ``lines_when_piped`` (long runs: a log shows they are alive), else
        nothing. Nothing with ``quiet``."""
        return _Progress(self, description, total, lines_when_piped)


class _Progress:
    def __init__(self, out: Output, description: str, total: int, lines_when_piped: bool = False) -> None:
        self.out, self.description, self.total = out, description, total
        self.lines_when_piped = lines_when_piped
        self._bar = None

    def __enter__(self):
        if self.out.quiet:
            return lambda n=1: None
        if not self.out.err_console.is_terminal:
            return self._lines() if self.lines_when_piped else (lambda n=1: None)
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            console=self.out.err_console,
            transient=True,
        )
        self._bar.__enter__()
        task = self._bar.add_task(self.description, total=self.total)
        return lambda n=1: self._bar.advance(task, n)

    def _lines(self):
        """Progress as plain lines on stderr (not a terminal: no bar to redraw): one at each tenth of the work and
        at the end, so a log or a CI job shows the command is alive."""
        done = 0
        step = max(1, self.total // 10)

        def advance(n: int = 1) -> None:
            nonlocal done
            before, done = done, done + n
            if done // step > before // step or done >= self.total > before:
                pct = f" ({100 * done / self.total:.0f}%)" if self.total else ""
                self.out.info(f"{self.description}: {done}/{self.total}{pct}")

        return advance

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)
        return False


def _json_default(o):
    if hasattr(o, "model_dump"):
        return o.model_dump()
    if hasattr(o, "as_dict"):
        return o.as_dict()
    if isinstance(o, Enum):
        return o.value
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
