"""Every command's --help: one placeholder style, whole first lines, one description of --format, one default per
option (typer's), and usage errors in the same one-line form as btbctl's own errors."""

from __future__ import annotations

import functools
import re

import pytest
import typer.main
from typer.testing import CliRunner

from btbctl.commands.app import app, main
from btbctl.commands.options import FORMAT_HELP
from btbctl.engine.launcher.cluster import DEFAULT_CONTROL_PORT, DEFAULT_GATEWAY_PORT


def _commands(group, prefix=()):
    """Every command path, subcommands of groups (``trace gen``, ``deploy render``) included."""
    for name, cmd in group.commands.items():
        yield (*prefix, name)
        if hasattr(cmd, "commands"):
            yield from _commands(cmd, (*prefix, name))


@functools.cache
def _all_helps() -> tuple[tuple[tuple[str, ...], str], ...]:
    """``(command path, its --help)`` of every command, rendered once for the module's tests."""
    runner = CliRunner()
    out = []
    for path in _commands(typer.main.get_command(app)):
        res = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert res.exit_code == 0, (path, res.output)
        out.append((path, res.output))
    return tuple(out)


def _helps():
    return iter(_all_helps())


def _options(text: str) -> list[tuple[str, str]]:
    """``(names and placeholder, help text)`` of each option and argument row of a --help page, the help text
    flattened."""
    rows: list[tuple[str, str]] = []
    for section in re.split(r"\n(?=[A-Z][a-z]+:\n)", text):
        if not section.startswith(("Arguments:", "Options:")):
            continue
        body = section.split("\n", 1)[1].split("\n\n", 1)[0]  # up to a blank line: an epilog follows it
        for row in re.split(r"\n(?=  \S)", body):
            if not row.strip():
                continue
            head, _, rest = row.strip().partition("  ")
            rows.append((head.strip(), " ".join(rest.split())))
    return rows


def test_every_help_uses_upper_case_placeholders():
    helps = dict(_helps())
    assert len(helps) > 15 and ("trace", "gen") in helps and ("deploy", "render") in helps
    for path, text in helps.items():
        assert not re.search(r"<[a-z][a-z_\[\]|]*>", text), (path, text)
        assert "{path}" not in text, path
        usage = text.split("\n", 1)[0]
        # arguments in the usage line: NAME when required, [NAME] when not (not {NAME} or [name])
        assert not re.search(r"[{}]", usage) and not re.search(r"\[[a-z]", usage), (path, usage)
        for head, _ in _options(text):
            words = [w for w in head.split() if not w.startswith("-") and w != "/"]
            # one placeholder, upper case (N, NUM, FILE, DIR, URL, HOST:PORT, A,B,..), or a choice [a|b]
            assert len(words) <= 1, (path, head)
            for w in words:
                assert w == w.upper() or re.fullmatch(r"\[[a-z0-9_|-]+\]", w), (path, head)
            # files and folders say so, whatever the option's type; PATH is not a second word for FILE
            if re.search(r"--[\w-]+-file\b", head):
                assert head.endswith(" FILE"), (path, head)
            if re.search(r"--[\w-]+-dir\b", head):
                assert head.endswith(" DIR"), (path, head)
            assert not head.endswith(" PATH") or not head.startswith("-"), (path, head)


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
    """Where typer shows ``[default: X]`` the help text says nothing more of a default (no ``(default: 4)`` beside
    ``[default: 4.0]``, no "by default"); where it shows none, the text says ``default: X``, with the colon."""
    seen = 0
    for path, text in _helps():
        for head, flat in _options(text):
            own = re.sub(r"\s*\[[^\[\]]*\]$", "", flat)
            if "[default:" in flat:
                seen += 1
                assert not re.search(r"\bdefault\b", own, re.I), (path, head, flat)
            assert not re.search(r"\(default [^:]", own), (path, head, flat)
    assert seen > 20


def test_output_format_is_described_one_way():
    """Every command that reports takes ``--format [human|json]`` with the same description; ``logs`` too (its old
    ``--json`` is a hidden alias)."""
    with_format = set()
    for path, text in _helps():
        for head, flat in _options(text):
            assert not head.startswith("--json"), (path, head)
            if head.startswith("--format"):
                with_format.add(path)
                assert head == "--format [human|json]" and flat == f"{FORMAT_HELP} [default: human]", (path, flat)
    assert {("logs",), ("status",), ("bench",), ("replicate",), ("dry-run",), ("trace", "gen")} <= with_format


def test_first_lines_are_whole_sentences():
    """Typer cuts a command's summary at its first period: no summary stops at an abbreviation, and groups list
    their commands' whole first lines too."""
    root = typer.main.get_command(app)
    for path in _commands(root):
        cmd = root
        for name in path:
            cmd = cmd.commands[name]
        summary = cmd.get_short_help_str(limit=10_000)
        assert not re.search(r"\b(e\.g|i\.e|etc|vs)\.$", summary), (path, summary)
    flush = root.commands["flush"].get_short_help_str(limit=10_000)
    assert flush.startswith("Empty every worker's KV cache") and flush.endswith("(busy: try again).")
    res = CliRunner().invoke(app, ["trace", "--help"], env={"COLUMNS": "80"})
    assert "..." not in res.output.split("Commands:")[1]


def test_usage_errors_look_like_btbctl_errors(capsys):
    """An unknown option, a missing or malformed value, an unknown command: one line ``btbctl: error: ...`` naming
    the command's help, exit status 2, as a user error of btbctl's own (the console script's entry point)."""
    with pytest.raises(SystemExit) as ours:
        main(["bench", "--time-scale", "0", "--target", "http://127.0.0.1:9"])
    err = capsys.readouterr().err
    assert ours.value.code == 2 and err.startswith("btbctl: error: ") and err.count("\n") == 1, err
    for args, says in (
        (("up", "--nope"), "No such option: --nope (see '"),
        (("replicate",), "Missing option '--prefix' (see '"),
        (("bench", "--time-scale", "x"), "Invalid value for '--time-scale'"),
        (("trace", "gen", "--nope"), " trace gen --help')"),
        (("nosuch",), "No such command 'nosuch'"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(list(args))
        err = capsys.readouterr().err
        assert exit_.value.code == 2, (args, err)
        assert err.startswith("btbctl: error: ") and err.count("\n") == 1, (args, err)
        assert says in err and "Error:" not in err and "Usage:" not in err, err
    assert " up --help')" in _usage_error(capsys, "up", "--nope")
    for group in ((), ("trace",)):  # a group without a command shows its help, not an error
        err = _usage_error(capsys, *group)
        assert err.startswith("Usage: ") and "Commands:" in err and "btbctl: error" not in err, err


def _usage_error(capsys, *args: str) -> str:
    with pytest.raises(SystemExit):
        main(list(args))
    return capsys.readouterr().err
