"""``btbctl replicate`` and ``btbctl prewarm`` through the real commands against a gateway with fake workers
in-process: exit statuses, the "already held" answer, the prompt file's shapes."""

from __future__ import annotations

import asyncio
import io
import json

import pytest

from btbctl.commands.app import main
from btbctl.engine.control.client import ControlClient
from btbctl.engine.control.steering import read_prompt
from btbctl.engine.errors import BtbctlError
from gateway_fakes import GatewayEnv

TEXT = "manual prefix " * 10  # 35 pseudo-tokens: 8 blocks of 4
CONSTANTS = {"prefix_blocks": 4, "threshold": 100, "window_s": 5.0, "replicas": 3}


async def _cli(env: GatewayEnv, monkeypatch, capsys, *args: str, stdin: bytes | None = None) -> tuple[int, str, str]:
    """Run ``btbctl ARGS`` against ``env``'s control API (in a thread: the command blocks): exit status, stdout,
    stderr."""
    import btbctl.engine.launcher.control as control_mod

    monkeypatch.setattr(control_mod, "client_for_run", lambda *a, **k: ControlClient(env.control, "test-token"))
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin)))

    def run() -> int:
        try:
            main(list(args))
        except SystemExit as e:
            return int(e.code or 0)
        return 0

    capsys.readouterr()
    code = await asyncio.to_thread(run)
    out = capsys.readouterr()
    return code, out.out, out.err


async def test_replicate_says_already_held_and_exits_0_when_every_worker_holds_the_prefix(monkeypatch, capsys):
    async with GatewayEnv(3, policy="round_robin", constants=CONSTANTS) as env:
        assert (await env.post("/generate", {"text": TEXT}))[0] == 200
        pid = env.fleet[0].chain_of("/generate", {"text": TEXT})[3]
        code, out, err = await _cli(env, monkeypatch, capsys, "replicate", "--prefix", pid[:10], "--replicas", "2")
        assert code == 0, err
        assert "to 2 workers: done" in out and "copy " in err
        code, out, err = await _cli(env, monkeypatch, capsys, "replicate", "--prefix", pid[:10], "-n", "3")
        assert code == 0, err
        assert out.strip() == f"prefix {pid[:12]} already held by 3 workers: w0, w1, w2"  # ids as `prefixes` shows them
        code, out, _ = await _cli(env, monkeypatch, capsys, "replicate", "--prefix", pid, "-n", "1", "--format", "json")
        res = json.loads(out)
        assert code == 0 and res["status"] == "held" and res["targets"] == [] and len(res["holders"]) == 3
        # real errors stay errors: exit 2, one line
        code, out, err = await _cli(env, monkeypatch, capsys, "replicate", "--prefix", "0123456789abcdef")
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "unknown prefix" in err
        code, _, err = await _cli(env, monkeypatch, capsys, "replicate", "--prefix", pid, "--replicas", "0")
        assert code == 2 and "-n/--replicas must be an integer >= 1" in err


async def test_prewarm_computes_then_copies_from_a_file_or_stdin(monkeypatch, capsys, tmp_path):
    async with GatewayEnv(4, policy="round_robin", constants=CONSTANTS) as env:
        f = tmp_path / "system.txt"
        f.write_text(TEXT)
        code, out, err = await _cli(env, monkeypatch, capsys, "prewarm", str(f), "-n", "2")
        assert code == 0, err
        computer = next(w for w in env.fleet if w.requests)
        chain = computer.chain_of("/generate", {"text": TEXT})
        name = f"w{env.fleet.index(computer)}"
        assert f"computed 35 tokens (8 blocks) on {name}; prefix {chain[-1][:12]}" in err
        # and the id `btbctl prefixes` lists it under (its first prefix_blocks blocks), so the two can be matched
        assert f"(btbctl prefixes tracks it as {chain[3][:12]}: its first 4 blocks)" in err
        assert f"prefix {chain[-1][:12]} from " in out and "to 2 workers: done" in out
        assert sum(chain[-1] in w.held for w in env.fleet) == 3
        # the same prompt once the whole fleet holds it: nothing to do, exit 0
        code, out, err = await _cli(env, monkeypatch, capsys, "prewarm", str(f), "--replicas", "5")
        assert code == 0 and "to 1 worker: done" in out
        code, out, err = await _cli(env, monkeypatch, capsys, "prewarm", str(f), "--format", "json")
        res = json.loads(out)
        assert code == 0 and res["status"] == "held" and res["computed_by"] and res["prefix_blocks"] == 8
        # a chat from stdin
        chat = [{"role": "system", "content": "Summarize each support ticket in one line. " * 2}]
        code, out, err = await _cli(
            env, monkeypatch, capsys, "prewarm", "-", "-n", "1", stdin=json.dumps(chat).encode()
        )
        assert code == 0, err
        assert any(p == "/v1/chat/completions" and b["messages"] == chat for w in env.fleet for p, b in w.requests)
        # a user error: one line, exit 2
        code, out, err = await _cli(env, monkeypatch, capsys, "prewarm", str(tmp_path / "missing.txt"))
        assert code == 2 and out == "" and err.startswith("btbctl: error: prompt ") and "No such file" in err


def test_read_prompt_takes_text_chats_and_token_ids(tmp_path):
    def f(text: str):
        p = tmp_path / "p"
        p.write_text(text)
        return str(p)

    chat = [{"role": "user", "content": "hi"}]
    assert read_prompt(f("plain words\n")) == {"text": "plain words\n"}
    assert read_prompt(f(json.dumps(chat))) == {"messages": chat}
    assert read_prompt(f(json.dumps({"messages": chat}))) == {"messages": chat}
    assert read_prompt(f("[1, 2, 3]")) == {"input_ids": [1, 2, 3]}
    assert read_prompt(f('{"input_ids": [4, 5]}'), "ids") == {"input_ids": [4, 5]}
    assert read_prompt(f('{"text": "t"}')) == {"text": "t"}
    assert read_prompt(f("[1, 2, 3]"), "text") == {"text": "[1, 2, 3]"}
    assert read_prompt("-", stdin=io.BytesIO(b"from stdin")) == {"text": "from stdin"}
    bad = [
        ("", "auto", "empty"),
        ("not json", "chat", "wants JSON"),
        ("[1, 2]", "chat", "JSON that is not a chat"),
        ('{"messages": []}', "ids", "--as ids, but the file holds 'messages'"),
        ('{"a": 1}', "auto", "JSON that is not a chat"),
        ("[true, false]", "ids", "JSON that is not token ids"),
    ]
    for text, kind, msg in bad:
        with pytest.raises(BtbctlError, match=msg):
            read_prompt(f(text), kind)
    (tmp_path / "bin").write_bytes(b"\xff\xfe")
    with pytest.raises(BtbctlError, match=r"^prompt .*bin: not UTF-8 text$"):
        read_prompt(str(tmp_path / "bin"))
    with pytest.raises(BtbctlError, match="over the limit"):
        read_prompt("-", stdin=io.BytesIO(b"x" * ((8 << 20) + 1)))
