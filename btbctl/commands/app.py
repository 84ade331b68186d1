"""``btbctl``: the root Typer app and the one error funnel.

User errors (:class:`btbctl.engine.errors.BtbctlError`) print one line ``btbctl: error: ...`` on stderr and exit 2;
``BTBCTL_DEBUG=1`` re-raises them with the traceback. Command modules register themselves here.
"""

from __future__ import annotations

import errno
import os
import re
import sys

import typer
import typer.core

from btbctl import __version__

#: Placeholders of options without a metavar of their own, in one style (upper case, as FILE, DIR, URL elsewhere):
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


_display_type = typer.core._TyperParameter.display_type


def _display_type_plain(self, ctx):
    return _plain_metavar(_display_type(self, ctx))


# One placeholder style for every command's help (typer's own is ``<type>``).
typer.core._TyperParameter.display_type = _display_type_plain  # type: ignore[method-assign]


class FullHelpGroup(typer.core.TyperGroup):
    """The root group: each command listed with the whole first sentence of its description (click cuts it to
    the terminal's width with '...'); the formatter wraps long ones."""

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


app = typer.Typer(
    cls=FullHelpGroup,
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
        typer.echo(f"btbctl {__version__}")
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
        sys.stderr.write(f"btbctl: error: {e}\n")
        sys.exit(e.exit_code)
    except OSError as e:
        # The machine, not btbctl, failed (a full disk during `up`, descriptors exhausted): one line naming the
        # file. Other OSErrors are bugs and keep their traceback.
        if debug or e.errno not in _ENVIRONMENT_ERRNOS:
            raise
        where = f"{e.filename}: " if e.filename else ""
        sys.stderr.write(f"btbctl: error: {where}{e.strerror or e}\n")
        sys.exit(1)
    except KeyboardInterrupt:
        if debug:
            raise
        sys.stderr.write("btbctl: interrupted\n")
        sys.exit(130)


#: OSError numbers that describe the machine's state rather than a bug: shown as one line by :func:`main`.
_ENVIRONMENT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EMFILE, errno.ENFILE, errno.ENOMEM}
)
