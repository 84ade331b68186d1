"""``btbctl``: the root Typer app and the one error funnel.

User errors (:class:`btbctl.engine.errors.BtbctlError`, and click's usage errors through :class:`FullHelpGroup`)
print one line ``btbctl: error: ...`` on stderr and exit 2; ``BTBCTL_DEBUG=1`` re-raises btbctl's with the traceback.
Command modules register themselves here, on :class:`BtbTyper` apps (help in one placeholder style).
"""

from __future__ import annotations

import errno
import importlib
import os
import re
import sys
from typing import Any

import typer
import typer.core

from btbctl import __version__

#: The exceptions of the click that typer runs on (typer >= 0.23 carries its own copy of click).
_click_errors = importlib.import_module(
    typer.core.TyperCommand.__mro__[1].__module__.rpartition(".")[0] + ".exceptions"
)

#: What click raises for a group called without a command (click >= 8.2): shown as help, not as an error.
_NO_ARGS_IS_HELP: tuple[type, ...] = tuple(
    c for c in (getattr(_click_errors, "NoArgsIsHelpError", None),) if isinstance(c, type)
)

#: Placeholders of parameters without a metavar of their own, in one style (upper case, as FILE, DIR, URL elsewhere):
#: typer's ``<int>``, ``<float>``, ``<str>``, ``<list[str]>`` become these; a choice ``<a|b>`` becomes ``[a|b]``.
METAVARS = {"int": "N", "float": "NUM", "str": "TEXT", "path": "PATH", "bool": "BOOL"}


def _plain_metavar(label: str) -> str:
    inner = label[1:-1] if label.startswith("<") and label.endswith(">") else label
    m = re.fullmatch(r"list\[(.*)\]", inner)
    if m:  # a repeatable option: the help says "repeat"
        inner = m.group(1)
    if inner in METAVARS:
        return METAVARS[inner]
    if "|" in inner:
        return f"[{inner}]"
    return inner.upper() if label.startswith("<") else label


def _plain_record(param: Any, record: tuple[str, str]) -> tuple[str, str]:
    """A parameter's help row in the one placeholder style: an option's typer type ``<int>`` as ``N``; an argument
    by its upper-case name alone (typer adds its type: ``NAME <str>``)."""
    name, text = record
    if param.param_type_name == "argument":
        return _argument_name(param), text
    name = re.sub(r"<[^<>]*>", lambda m: _plain_metavar(m.group(0)), name)
    if param.metavar is None:  # a file or a folder says so, whatever its type
        long = max(param.opts, key=len)
        for suffix, placeholder in _PLACEHOLDER_BY_SUFFIX.items():
            if long.endswith(suffix):
                name = re.sub(r" (TEXT|PATH)$", f" {placeholder}", name)
    return name, text


#: Placeholders that an option's name implies: ``--token-file FILE``, ``--file-dir DIR``.
_PLACEHOLDER_BY_SUFFIX = {"-file": "FILE", "-dir": "DIR"}


def _plain_usage_piece(param: Any, piece: str) -> str:
    """An argument in the usage line: ``NAME`` when required, ``[NAME]`` when not (typer writes ``{NAME}`` and the
    lower-case ``[name]``)."""
    if not param.param_type_name == "argument":
        return piece
    name = _argument_name(param)
    return name if param.required else f"[{name}]"


def _argument_name(param: Any) -> str:
    """``NAME``, ``NAME...`` when it takes several (a metavar of its own may say so already)."""
    name = param.metavar or (param.name or "").upper()
    return name if param.nargs == 1 or name.endswith("...") else f"{name}..."


def _format_params(cmd: Any, ctx: Any, formatter: Any) -> None:
    """The Arguments and Options sections of ``cmd``'s help, rows in the one placeholder style."""
    sections: dict[str, list[tuple[str, str]]] = {"Arguments": [], "Options": []}
    for param in cmd.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is not None:
            sections["Arguments" if param.param_type_name == "argument" else "Options"].append(
                _plain_record(param, record)
            )
    for title, rows in sections.items():
        if rows:
            with formatter.section(title):
                formatter.write_dl(rows)


def error_line(message: str) -> str:
    """The one line a user error prints on stderr, ours and click's alike: ``btbctl: error: MESSAGE``."""
    return f"btbctl: error: {message}\n"


class HelpCommand(typer.core.TyperCommand):
    """Every command: help rows and the usage line in the one placeholder style."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            pieces.extend(_plain_usage_piece(param, p) for p in param.get_usage_pieces(ctx))
        return pieces

    def format_options(self, ctx: Any, formatter: Any) -> None:
        _format_params(self, ctx, formatter)


class FullHelpGroup(typer.core.TyperGroup):
    """A command group: each command listed with the whole first sentence of its description (click cuts it to
    the terminal's width with '...'; the formatter wraps long ones), options in the one placeholder style; and, as
    the program's entry point, usage errors (an unknown option, a missing value) printed as one line in the same
    form as btbctl's own errors (:func:`error_line`, exit status 2) instead of click's ``Error: ...`` block."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        _format_params(self, ctx, formatter)
        self.format_commands(ctx, formatter)

    def format_commands(self, ctx, formatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is None or cmd.hidden:
                continue
            rows.append((name, cmd.get_short_help_str(limit=10_000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # type: ignore[override]
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _click_errors.ClickException as e:
            if isinstance(e, _NO_ARGS_IS_HELP):  # `btbctl` alone: its help, as click prints it
                e.show()
            else:
                sys.stderr.write(error_line(_click_message(e)))
            sys.exit(e.exit_code)
        except typer.Abort:
            sys.stderr.write("btbctl: interrupted\n")
            sys.exit(130)
        # without standalone mode an explicit exit (typer.Exit, --help) comes back as its status; a command's return
        # value is None
        sys.exit(code if isinstance(code, int) else 0)


def _click_message(e: Any) -> str:
    """Click's error as one line: its message, and for a usage error where to read the command's help."""
    message = e.format_message().rstrip(".")
    if isinstance(e, _click_errors.UsageError) and e.ctx is not None:
        help_name = e.ctx.help_option_names[-1] if e.ctx.help_option_names else "--help"
        message += f" (see '{e.ctx.command_path} {help_name}')"
    return message


class BtbTyper(typer.Typer):
    """A Typer app whose groups are :class:`FullHelpGroup` and whose commands are :class:`HelpCommand` (every
    command module registers on one of these)."""

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("cls", FullHelpGroup)
        super().__init__(**kwargs)

    def command(self, *args, **kwargs):  # type: ignore[override]
        kwargs.setdefault("cls", HelpCommand)
        return super().command(*args, **kwargs)


app = BtbTyper(
    name="btbctl",
    help="Burst-aware LLM serving: simulate, run and steer BTB predictive KV-cache replication.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from btbctl.engine.compiled import core_build

        typer.echo(f"btbctl {__version__} (routing core: {core_build()})")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Burst-aware LLM serving: simulate, run and steer BTB predictive KV-cache replication."""


def _register() -> None:
    # Each command module adds its commands to ``app`` on import (they import engine modules lazily).
    import importlib

    for mod in (
        "trace",
        "presets",
        "dryrun",
        "worker",
        "gateway",
        "tui",
        "fleet",
        "steer",
        "bench",
        "sweep",
        "report",
        "logs",
        "doctor",
        "agent",
        "deploy",
    ):
        importlib.import_module(f"btbctl.commands.{mod}")


_register()


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point with the error funnel."""
    from btbctl.engine.errors import BtbctlError

    debug = os.environ.get("BTBCTL_DEBUG", "") not in ("", "0")
    try:
        app(args=argv, standalone_mode=True)
    except BtbctlError as e:
        if debug:
            raise
        sys.stderr.write(error_line(_located(e)))
        sys.exit(e.exit_code)
    except OSError as e:
        # The machine, not btbctl, failed (a full disk during `up`, descriptors exhausted): one line naming the
        # file. Other OSErrors are bugs and keep their traceback.
        if debug or e.errno not in _ENVIRONMENT_ERRNOS:
            raise
        where = f"{e.filename}: " if e.filename else ""
        sys.stderr.write(error_line(f"{where}{e.strerror or e}"))
        sys.exit(1)
    except KeyboardInterrupt:
        if debug:
            raise
        sys.stderr.write("btbctl: interrupted\n")
        sys.exit(130)


def _located(e: Exception) -> str:
    """``str(e)``; for a bad key of a TOML file, with the line it is on: ``FILE:LINE: key: what is valid``."""
    from btbctl.engine.errors import ConfigError

    if isinstance(e, ConfigError) and e.path and e.key != "file" and str(e.path).endswith(".toml"):
        from btbctl.engine.config import toml_key_line

        line = toml_key_line(e.path, e.key)
        if line is not None:
            return f"{e.path}:{line}: {e.key}: {e.reason}"
    return str(e)


#: OSError numbers that describe the machine's state rather than a bug: shown as one line by :func:`main`.
_ENVIRONMENT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EMFILE, errno.ENFILE, errno.ENOMEM}
)
