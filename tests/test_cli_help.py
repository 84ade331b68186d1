"""Every command's --help: one placeholder style, whole first lines at the top level, the gateway's defaults."""

from __future__ import annotations

import re

import click
import typer.main
from typer.testing import CliRunner

from btbctl.commands.app import app
from btbctl.engine.launcher.cluster import DEFAULT_CONTROL_PORT, DEFAULT_GATEWAY_PORT


def _commands(group: click.Group, prefix=()):
    for name, cmd in group.commands.items():
        yield (*prefix, name)
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*prefix, name))


def test_every_help_uses_upper_case_placeholders():
    runner = CliRunner()
    root = typer.main.get_command(app)
    paths = list(_commands(root))
    assert len(paths) > 15
    for path in paths:
        res = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert res.exit_code == 0, (path, res.output)
        assert not re.search(r"<[a-z][a-z_\[\]|]*>", res.output), (path, res.output)
        assert "{path}" not in res.output, path


def test_top_level_help_shows_whole_first_lines():
    res = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "80"})
    commands = res.output.split("Commands:")[1]
    assert res.exit_code == 0 and "..." not in commands
    assert "each worker's health." in " ".join(commands.split())


def test_gateway_defaults_to_ups_ports():
    res = CliRunner().invoke(app, ["gateway", "--help"], env={"COLUMNS": "200"})
    flat = " ".join(res.output.split())
    assert f"(default: {DEFAULT_GATEWAY_PORT}, as btbctl up)" in flat
    assert f"(default: {DEFAULT_CONTROL_PORT}, as btbctl up)" in flat
    assert "TOML file of gateway settings" in flat


def test_a_default_is_shown_once_and_one_way():
    """Where typer shows ``[default: X]`` the help text does not repeat it as ``(default: X)``."""
    runner = CliRunner()
    root = typer.main.get_command(app)
    for path in _commands(root):
        res = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "400"})
        for option in re.split(r"\n(?=\s{2}-)", res.output):
            flat = " ".join(option.split())
            assert not ("(default" in flat and "[default:" in flat), (path, flat)
