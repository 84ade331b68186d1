"""``btbctl``: the root Typer app and the one error funnel.

User errors (:class:`btbctl.engine.errors.BtbctlError`) print one line ``btbctl: error: ...`` on stderr and exit 2;
``BTBCTL_DEBUG=1`` re-raises them with the traceback. Command modules register themselves here.
"""

from __future__ import annotations

import os
import sys

import typer

from btbctl import __version__

app = typer.Typer(
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
    except KeyboardInterrupt:
        if debug:
            raise
        sys.stderr.write("btbctl: interrupted\n")
        sys.exit(130)
