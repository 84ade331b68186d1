"""The multi-host testbed itself (tests/netns.py): hosts talk TCP across the switch and the operator reaches them,
the token bucket holds the rate, netem adds its delay, a cut link cuts and comes back, nothing is left behind (also
after a failing test or a crashed run), sshd in a host takes a key login checked against known_hosts, and the
benchmark script brings a testbed up and down. Needs root and iproute2 (the tests skip with the reason otherwise);
the speed measurements carry the ``speed`` marker (left out of the default run; ``pytest -m speed`` runs them)."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import pytest

import netns
from netns import (  # noqa: F401 - fixtures
    Testbed,
    TestbedBusy,
    TestbedError,
    leftovers,
    make_testbed,
    open_testbed,
    pick_subnet,
    require_netem,
    require_sshd,
    require_testbed,
    start_sshd,
    sweep,
    sweep_stale,
    testbed,
)

pytestmark = pytest.mark.netns

ROOT = Path(__file__).resolve().parents[1]

# Programs run inside the hosts (argv lists; each prints one line when it is ready).
ECHO = textwrap.dedent("""
    import socket, sys, threading
    s = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("ready", flush=True)
    def serve(c):
        with c:
            while data := c.recv(65536):
                c.sendall(data)
    while True:
        c, _ = s.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
""")
SINK = textwrap.dedent("""
    import json, socket, sys, time
    s = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("ready", flush=True)
    for _ in range(int(sys.argv[3])):
        c, _ = s.accept()
        first = c.recv(1 << 20)
        t0, n = time.perf_counter(), 0
        while data := c.recv(1 << 20):
            n += len(data)
        t1 = time.perf_counter()
        print(json.dumps({"bytes": n, "seconds": t1 - t0}), flush=True)
        c.close()
""")
SEND = textwrap.dedent("""
    import socket, sys
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as c:
        c.sendall(bytes(int(sys.argv[3])))
""")
RTT = textwrap.dedent("""
    import json, socket, sys, time
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = []
        for _ in range(int(sys.argv[3])):
            t = time.perf_counter(); c.sendall(b"x"); c.recv(1); out.append(time.perf_counter() - t)
    print(json.dumps(out))
""")


def serve(host, code: str, *args) -> subprocess.Popen:
    proc = host.popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.strip() == "ready", f"{host.name}: server did not start ({proc.poll()})"
    return proc


def echo_once(address: str, port: int, timeout: float = 2.0) -> bytes:
    with socket.create_connection((address, port), timeout=timeout) as c:
        c.sendall(b"ping")
        return c.recv(4)


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# -- requirements (run anywhere) -----------------------------------------------------------------------------------


def test_skips_with_the_reason_when_not_root(monkeypatch):
    monkeypatch.setattr(netns.sys, "platform", "linux")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.skip.Exception, match=r"needs root for network namespaces \(ip netns\)"):
        require_testbed()
    with pytest.raises(TestbedError, match="needs root"):
        Testbed(1)


def test_skips_with_the_reason_when_a_tool_is_missing(monkeypatch):
    monkeypatch.setattr(netns.sys, "platform", "linux")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    real = netns.shutil.which
    monkeypatch.setattr(netns.shutil, "which", lambda t: None if t == "tc" else real(t))
    with pytest.raises(pytest.skip.Exception, match="needs iproute2: `tc` is not installed"):
        require_testbed()


def test_subnet_choice_avoids_everything_taken():
    net = ipaddress.ip_network
    assert pick_subnet([]) == net("198.18.0.0/24")
    assert pick_subnet([net("198.18.0.0/24"), net("198.18.1.128/25"), net("10.0.0.0/8")]) == net("198.18.2.0/24")
    with pytest.raises(TestbedError, match="overlaps"):
        pick_subnet([net("198.16.0.0/12")])


def test_shaping_commands(monkeypatch):
    calls = []
    monkeypatch.setattr(netns, "_tc", lambda ns, *args, check=True: calls.append((ns, *args)))
    netns._Port("h", "eth0").shape(1.0, 0, netem=False)
    netns._Port(None, "x-op").shape(None, 0, netem=False)
    assert calls == [
        (
            "h",
            "qdisc",
            "replace",
            "dev",
            "eth0",
            "root",
            "handle",
            "10:",
            "tbf",
            "rate",
            "1000000000bit",
            "burst",
            "131072",
            "latency",
            "20ms",
        ),
        (None, "qdisc", "del", "dev", "x-op", "root"),
    ]
    calls.clear()
    # with netem: the delay at the root, the token bucket as its child (the tree tc-netem(8) describes)
    netns._Port("h", "eth0").shape(10.0, 50, netem=True)
    assert calls == [
        ("h", "qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "netem", "delay", "50us", "limit", "100000"),
        (
            "h",
            "qdisc",
            "replace",
            "dev",
            "eth0",
            "parent",
            "1:1",
            "handle",
            "10:",
            "tbf",
            "rate",
            "10000000000bit",
            "burst",
            "1250000",
            "latency",
            "20ms",
        ),
    ]


# -- the network ---------------------------------------------------------------------------------------------------


def test_hosts_talk_tcp_and_the_operator_reaches_them(testbed):  # noqa: F811
    a, b = testbed.hosts
    op = testbed.operator
    net = testbed.subnet
    assert {ipaddress.ip_address(x) in net for x in (op.address, a.address, b.address)} == {True}
    assert a.netns == f"{testbed.prefix}-node0" and b.name == "node1"
    # the subnet does not collide with any route of the machine (but its own)
    routes = json.loads(
        subprocess.run(
            ["ip", "-j", "-4", "route", "show", "table", "all"], capture_output=True, text=True, check=True
        ).stdout
    )
    others = [r for r in routes if r.get("dst", "default") != "default" and r.get("dev") != op.interface]
    assert not any(net.overlaps(ipaddress.ip_network(r["dst"], strict=False)) for r in others)

    serve(b, ECHO, b.address, 7000)
    serve(a, ECHO, a.address, 7000)
    # host to host
    r = a.run(
        [
            sys.executable,
            "-c",
            (
                "import socket,sys; c=socket.create_connection((sys.argv[1],7000),timeout=2);"
                "c.sendall(b'hi'); print(c.recv(2).decode())"
            ),
            b.address,
        ],
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert r.stdout.strip() == "hi", r.stderr
    # the operator (this process, root namespace) to each host
    assert echo_once(a.address, 7000) == b"ping" and echo_once(b.address, 7000) == b"ping"
    # a host to the operator
    with socket.create_server((op.address, 0)) as srv:
        port = srv.getsockname()[1]
        code = "import socket,sys; socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=2).sendall(b'up')"
        r = a.popen([sys.executable, "-c", code, op.address, port])
        srv.settimeout(5)
        c, peer = srv.accept()
        with c:
            assert c.recv(2) == b"up" and peer[0] == a.address
        assert r.wait(5) == 0
    # a host reaches nothing outside the testbed (no default route)
    r = a.run(
        [sys.executable, "-c", "import socket; socket.create_connection(('192.0.2.1', 22), timeout=1)"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert r.returncode != 0 and "Network is unreachable" in r.stderr


@pytest.mark.speed
def test_rate_limit_holds_and_changes_while_running(make_testbed):  # noqa: F811
    tb = make_testbed(2, rate_gbit=1.0)
    a, b = tb.hosts
    sink = serve(b, SINK, b.address, 7001, 2)

    def transfer(nbytes: int) -> float:
        r = a.run([sys.executable, "-c", SEND, b.address, 7001, nbytes], timeout=30)
        assert r.returncode == 0
        m = json.loads(sink.stdout.readline())
        return m["bytes"] * 8 / m["seconds"] / 1e9

    gbit = transfer(48 << 20)
    print(f"\n1 Gbit/s link: {gbit:.3f} Gbit/s TCP payload")
    assert 0.85 <= gbit <= 1.15
    a.set_rate(0.5)  # one side slower: the path follows it
    gbit = transfer(24 << 20)
    print(f"0.5 Gbit/s link: {gbit:.3f} Gbit/s TCP payload")
    assert 0.425 <= gbit <= 0.575


@pytest.mark.speed
def test_delay_is_visible(make_testbed):  # noqa: F811
    require_testbed()
    if not netns.netem_available():  # a delay is refused with the reason, not silently dropped
        with pytest.raises(TestbedError, match="needs the netem qdisc"):
            make_testbed(2, delay_us=50)
        with make_testbed(1) as tb, pytest.raises(TestbedError, match="needs the netem qdisc"):
            tb.hosts[0].set_delay(50)
    require_netem()
    delay_us = 500
    tb = make_testbed(2, rate_gbit=10.0, delay_us=delay_us)
    a, b = tb.hosts
    serve(b, ECHO, b.address, 7002)
    r = a.run([sys.executable, "-c", RTT, b.address, 7002, 20], capture_output=True, text=True, timeout=20)
    rtt_us = min(json.loads(r.stdout)) * 1e6
    print(f"\nRTT host to host, {delay_us} us per link and direction: {rtt_us:.0f} us")
    assert rtt_us >= 2 * delay_us  # the path crosses two links each way: 4 x delay_us is expected
    a.set_delay(0)
    b.set_delay(0)
    r = a.run([sys.executable, "-c", RTT, b.address, 7002, 20], capture_output=True, text=True, timeout=20)
    assert min(json.loads(r.stdout)) * 1e6 < rtt_us / 2


def test_cut_link_drops_traffic_and_comes_back(testbed):  # noqa: F811
    b = testbed.hosts[1]
    serve(b, ECHO, b.address, 7003)
    assert echo_once(b.address, 7003) == b"ping"
    kept = socket.create_connection((b.address, 7003), timeout=2)
    with kept:
        b.set_link(up=False)
        assert not b.up
        with pytest.raises(OSError):  # noqa: PT011 - timeout (the switch port drops the SYN) or unreachable
            echo_once(b.address, 7003, timeout=0.5)
        kept.sendall(b"late")
        kept.settimeout(0.4)
        with pytest.raises(socket.timeout):
            kept.recv(4)
        b.set_link(up=True)
        assert echo_once(b.address, 7003, timeout=3) == b"ping"
        kept.settimeout(5)  # the established connection resumes (TCP retransmits)
        assert kept.recv(4) == b"late"


# -- cleanup -------------------------------------------------------------------------------------------------------


def test_close_removes_everything_and_kills_every_process():
    require_testbed()
    tb = open_testbed(2, rate_gbit=5.0)
    prefix = tb.prefix
    tracked = tb.hosts[0].popen(["sleep", "60"])
    # an untracked process: a detached grandchild in the other host
    detached = (
        "import subprocess; print(subprocess.Popen(['sleep', '60'], start_new_session=True, "
        "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"
    )
    r = tb.hosts[1].run([sys.executable, "-c", detached], capture_output=True, text=True, timeout=10)
    orphan = int(r.stdout)
    assert orphan in tb.hosts[1].pids()
    assert leftovers(prefix)
    tb.close()
    tb.close()  # idempotent
    assert leftovers(prefix) == []
    assert tracked.poll() is not None
    deadline = time.monotonic() + 5
    while not gone(orphan) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(orphan)
    assert not (netns.STATE_DIR / f"{prefix}.json").exists()


def test_close_after_the_body_raised():
    require_testbed()
    with pytest.raises(RuntimeError, match="boom"):
        with open_testbed(1) as tb:
            prefix = tb.prefix
            tb.hosts[0].popen(["sleep", "60"])
            raise RuntimeError("boom")
    assert leftovers(prefix) == []


@pytest.mark.slow  # end to end (processes, a fleet or an sshd): out of the main suite's time budget
def test_fixture_teardown_cleans_up_after_a_failed_test(tmp_path):
    require_testbed()
    (tmp_path / "test_inner.py").write_text(
        textwrap.dedent(f"""
        import json
        from netns import make_testbed, testbed

        def test_fails(testbed):
            p = testbed.hosts[0].popen(["sleep", "60"])
            with open({str(tmp_path / "out.json")!r}, "w") as f:
                json.dump({{"prefix": testbed.prefix, "pid": p.pid}}, f)
            assert False, "the test body failed"
    """)
    )
    # names of its own: another test's testbed may take the default ones the moment the inner run gives them back
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"), BTBT_TEST_PREFIX=f"btbf{os.getpid() % 100000}")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "the test body failed" in r.stdout, r.stdout + r.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert leftovers(out["prefix"]) == []
    assert gone(out["pid"])


CRASH = textwrap.dedent("""
    import os, signal, subprocess, sys
    sys.path.insert(0, sys.argv[1])
    import netns
    tb = netns.Testbed(2, rate_gbit=1.0, prefix=sys.argv[2])
    p = tb.hosts[1].popen(["sleep", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(p.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # crash: no close, no atexit
""")


def test_a_crashed_run_is_swept(tmp_path):
    require_testbed()
    prefix = f"btbtc{os.getpid()}"  # no other run of this test can sweep it meanwhile
    try:
        r = subprocess.run(
            [sys.executable, "-c", CRASH, str(ROOT / "tests"), prefix], capture_output=True, text=True, timeout=30
        )
        assert r.returncode == -signal.SIGKILL, r.stderr
        pid = int(r.stdout)
        left = leftovers(prefix)
        assert f"netns {prefix}-switch" in left and f"link {prefix}-op" in left and not gone(pid)
        removed = sweep_stale()  # what every fixture does first
        assert set(left) <= set(removed)
        assert leftovers(prefix) == [] and gone(pid)
        assert sweep(prefix) == []  # idempotent
        # a partly built crashed run (a lone namespace) is swept by the next testbed of that prefix
        subprocess.run(["ip", "netns", "add", f"{prefix}-node0"], check=True)
        with Testbed(1, prefix=prefix) as tb:
            assert tb.swept == [f"netns {prefix}-node0"]
            assert echo_ready(tb)
        assert leftovers(prefix) == []
    finally:
        sweep(prefix, include_persistent=True)


def echo_ready(tb) -> bool:
    h = tb.hosts[0]
    serve(h, ECHO, h.address, 7004)
    return echo_once(h.address, 7004) == b"ping"


def test_a_live_testbed_is_never_swept(testbed):  # noqa: F811
    with pytest.raises(TestbedBusy, match="in use"):
        sweep(testbed.prefix)
    with pytest.raises(TestbedBusy):
        Testbed(1, prefix=testbed.prefix)
    assert echo_ready(testbed)


# -- sshd in a host ------------------------------------------------------------------------------------------------


def test_sshd_in_a_host_takes_a_key_login_checked_against_known_hosts(testbed, tmp_path):  # noqa: F811
    require_sshd()
    import asyncssh

    a, b = testbed.hosts
    sa = start_sshd(a, tmp_path / "ssh")
    sb = start_sshd(b, tmp_path / "ssh")
    assert sa.known_hosts == sb.known_hosts and len(sa.known_hosts.read_text().splitlines()) == 2
    wrong = tmp_path / "known_hosts_wrong"  # node1's key under node0's address
    wrong.write_text(f"{a.address} {sb.known_hosts.read_text().splitlines()[1].split(' ', 1)[1]}\n")

    async def login(known_hosts: Path) -> str:
        async with asyncssh.connect(
            a.address,
            port=sa.port,
            username=sa.user,
            client_keys=[str(sa.client_key)],
            known_hosts=str(known_hosts),
            agent_path=None,
            connect_timeout=5,
        ) as conn:
            r = await conn.run("ip -4 -o addr show", check=True, timeout=10)
            return r.stdout

    out = asyncio.run(login(sa.known_hosts))
    assert f"inet {a.address}/24" in out and "192.0.2." not in out  # the command ran inside node0
    with pytest.raises(asyncssh.HostKeyNotVerifiable):
        asyncio.run(login(wrong))
    # the stock client works too (a benchmark may drive hosts with plain ssh)
    r = subprocess.run(
        [
            "ssh",
            "-F",
            "none",
            "-o",
            "BatchMode=yes",
            "-o",
            f"UserKnownHostsFile={sb.known_hosts}",
            "-o",
            "StrictHostKeyChecking=yes",
            "-i",
            str(sb.client_key),
            f"{sb.user}@{b.address}",
            "ip",
            "-4",
            "-o",
            "addr",
            "show",
            "dev",
            "eth0",
        ],
        capture_output=True,
        text=True,
        timeout=20,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0 and f"inet {b.address}/24" in r.stdout, r.stderr


# -- scripts/testbed.py --------------------------------------------------------------------------------------------


def script(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "testbed.py"), *args], capture_output=True, text=True, timeout=60
    )
    if check:
        assert r.returncode == 0, r.stderr
    return r


@pytest.mark.slow  # end to end (processes, a fleet or an sshd): out of the main suite's time budget
def test_script_up_exec_set_down(tmp_path):
    require_testbed()
    require_sshd()
    prefix = f"btbts{os.getpid()}"
    try:
        up = json.loads(
            script(
                "up",
                "--hosts",
                "2",
                "--rate-gbit",
                "2",
                "--delay-us",
                "0",
                "--prefix",
                prefix,
                "--sshd",
                str(tmp_path / "ssh"),
            ).stdout
        )
        assert [h["name"] for h in up["hosts"]] == ["node0", "node1"] and up["persistent"]
        node0, node1 = (h["address"] for h in up["hosts"])
        # it outlived the script; a test never sweeps it; status shows it; a second up refuses
        assert f"netns {prefix}-node1" in leftovers(prefix)
        with pytest.raises(TestbedBusy, match=r"scripts/testbed\.py down"):
            sweep(prefix)
        assert json.loads(script("status", "--prefix", prefix).stdout)["hosts"] == up["hosts"]
        again = script("up", "--prefix", prefix, check=False)
        assert again.returncode == 1 and "down --prefix" in again.stderr
        r = script("exec", "--prefix", prefix, "node1", "--", "ip", "-4", "-o", "addr", "show", "dev", "eth0")
        assert f"inet {node1}/24" in r.stdout
        assert script("exec", "--prefix", prefix, "node9", "--", "true", check=False).returncode == 1
        # sshd runs in every host, and hosts.toml holds [[hosts]] entries a cluster file can use as they are
        hosts = tomllib.loads(Path(up["ssh"]["hosts_toml"]).read_text())["hosts"]
        assert [(h["name"], h["address"], h["port"]) for h in hosts] == [("node0", node0, 22), ("node1", node1, 22)]
        h0 = hosts[0]
        r = subprocess.run(
            [
                "ssh",
                "-F",
                "none",
                "-o",
                "BatchMode=yes",
                "-o",
                f"UserKnownHostsFile={h0['known_hosts']}",
                "-o",
                "StrictHostKeyChecking=yes",
                "-i",
                h0["identity_file"],
                f"{h0['user']}@{node0}",
                "true",
            ],
            capture_output=True,
            text=True,
            timeout=20,
            stdin=subprocess.DEVNULL,
        )
        assert r.returncode == 0, r.stderr
        # links change while it runs
        st = json.loads(script("set", "--prefix", prefix, "node1", "--rate-gbit", "0.5", "--link", "down").stdout)
        assert [(h["rate_gbit"], h["up"]) for h in st["hosts"]] == [(2.0, True), (0.5, False)]
        qd = subprocess.run(
            ["tc", "-n", f"{prefix}-switch", "qdisc", "show", "dev", "node1"], capture_output=True, text=True
        ).stdout
        assert "rate 500Mbit" in qd
        with pytest.raises(OSError):  # noqa: PT011 - refused, unreachable or timed out: any of them
            socket.create_connection((node1, 22), timeout=0.5)
        script("set", "--prefix", prefix, "node1", "--link", "up")
        socket.create_connection((node1, 22), timeout=3).close()
        sshd_pids = list(up["ssh"]["sshd_pids"].values())
        down = json.loads(script("down", "--prefix", prefix).stdout)
        assert f"netns {prefix}-switch" in down["removed"]
        assert leftovers(prefix) == [] and all(gone(p) for p in sshd_pids)
        assert json.loads(script("down", "--prefix", prefix).stdout)["removed"] == []  # idempotent
    finally:
        sweep(prefix, include_persistent=True)
