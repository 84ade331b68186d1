#!/usr/bin/env python3
"""Bring a multi-host testbed (hosts as network namespaces behind a shaped switch, see tests/netns.py) up and down
for benchmarks. Needs root and iproute2, and this checkout's test extras (``pip install -e '.[test]'``).

    scripts/testbed.py up --hosts 2 --rate-gbit 10 --delay-us 0    # prints the layout as JSON
    scripts/testbed.py up --hosts 2 --sshd /tmp/tb                 # ... with sshd in every host, and
                                                                   # /tmp/tb/hosts.toml: their [[hosts]] entries
    scripts/testbed.py exec node0 -- python -m btbctl worker ...   # run a command inside a host
    scripts/testbed.py set node1 --rate-gbit 1 | --delay-us 50 | --link down|up
    scripts/testbed.py status                                      # the layout again
    scripts/testbed.py down                                        # remove it (idempotent)
    scripts/testbed.py sweep                                       # remove every testbed a crashed run left

The testbed stays up after ``up`` returns (until ``down``; tests never sweep it). The operator side is this
machine's root namespace, reaching the hosts through the link ``<prefix>-op``; hosts reach only each other and the
operator. ``--prefix`` (default ``btbt``) names the testbed, so several can be up at once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import netns


def _rate(text: str) -> float | None:
    if text.lower() in ("none", "unlimited", "0"):
        return None
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive (or 'none')")
    return value


def _fail(msg: str) -> int:
    print(f"testbed: error: {msg}", file=sys.stderr)
    return 1


def _emit(data) -> None:
    print(json.dumps(data, indent=1))


def cmd_up(args) -> int:
    try:
        tb = netns.Testbed(
            args.hosts,
            rate_gbit=args.rate_gbit,
            delay_us=args.delay_us,
            prefix=args.prefix,
            subnet=args.subnet,
            persistent=True,
        )
    except netns.TestbedBusy as e:
        return _fail(
            f"{e}"
            if "down --prefix" in str(e)
            else f"{e}; if it is left over, run: scripts/testbed.py down --prefix {args.prefix}"
        )
    except (netns.TestbedError, ValueError) as e:
        return _fail(str(e))
    out = tb.describe()
    if args.sshd:
        try:
            out["ssh"] = _start_sshds(tb, Path(args.sshd).resolve())
        except (netns.TestbedError, OSError, subprocess.CalledProcessError) as e:
            tb.close()
            return _fail(f"sshd: {e}")
    tb.release()
    _emit(out)
    return 0


def _toml(v) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + " }"
    return json.dumps(v)


def _start_sshds(tb: netns.Testbed, folder: Path) -> dict:
    """sshd in every host (detached, so it outlives this script; `down` stops it) and ``folder/hosts.toml``: a
    ``[[hosts]]`` entry per host, running this checkout with this Python."""
    servers = [netns.start_sshd(h, folder, detach=True) for h in tb.hosts]
    root = Path(__file__).resolve().parents[1]
    lines = [f"# [[hosts]] of testbed {tb.prefix!r} (scripts/testbed.py up --sshd); paste into a cluster file", ""]
    for s in servers:
        entry = {
            "name": s.host.name,
            "address": s.host.address,
            "port": s.port,
            "user": s.user,
            "identity_file": str(s.client_key),
            "known_hosts": str(s.known_hosts),
            "python": sys.executable,
            "workdir": str(folder / "remote" / s.host.name),
            "env": {"PYTHONPATH": str(root)},
        }
        lines += ["[[hosts]]", *(f"{k} = {_toml(v)}" for k, v in entry.items()), ""]
    hosts_toml = folder / "hosts.toml"
    hosts_toml.write_text("\n".join(lines))
    first = servers[0]
    return {
        "port": first.port,
        "user": first.user,
        "identity_file": str(first.client_key),
        "known_hosts": str(first.known_hosts),
        "hosts_toml": str(hosts_toml),
        "sshd_pids": {s.host.name: s.proc.pid for s in servers},
    }


def cmd_down(args) -> int:
    try:
        removed = netns.sweep(args.prefix, include_persistent=True)
    except (netns.TestbedError, ValueError) as e:
        return _fail(str(e))
    _emit({"prefix": args.prefix, "removed": removed})
    return 0


def cmd_sweep(args) -> int:
    _emit({"removed": netns.sweep_stale()})
    return 0


def _attached(args) -> netns.Testbed | None:
    try:
        return netns.Testbed.attach(args.prefix)
    except netns.TestbedError as e:
        _fail(str(e))
        return None


def cmd_status(args) -> int:
    tb = _attached(args)
    if tb is None:
        return 1
    _emit(tb.describe())
    return 0


def cmd_exec(args) -> int:
    tb = _attached(args)
    if tb is None:
        return 1
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        return _fail("exec needs a command: exec HOST -- ARGV...")
    try:
        host = tb.operator if args.host == "operator" else tb.host(args.host)
    except KeyError as e:
        return _fail(str(e.args[0]))
    full = host.argv(argv)
    sys.stdout.flush()
    os.execvp(full[0], full)


def cmd_set(args) -> int:
    tb = _attached(args)
    if tb is None:
        return 1
    try:
        eps = tb.endpoints() if args.host == "all" else [tb.operator if args.host == "operator" else tb.host(args.host)]
        for ep in eps:
            if args.rate_gbit is not None:
                ep.set_rate(None if args.rate_gbit == "none" else _rate(args.rate_gbit))
            if args.delay_us is not None:
                ep.set_delay(args.delay_us)
            if args.link is not None:
                ep.set_link(up=args.link == "up")
    except KeyError as e:
        return _fail(str(e.args[0]))
    except (netns.TestbedError, ValueError, argparse.ArgumentTypeError) as e:
        return _fail(str(e))
    tb.update_record()
    _emit(tb.describe())
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/testbed.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(name: str, help: str):
        sp = sub.add_parser(name, help=help)
        sp.add_argument("--prefix", default=netns.DEFAULT_PREFIX, help="testbed name (default: %(default)s)")
        return sp

    up = add("up", "build a testbed and leave it up; prints its layout as JSON")
    up.add_argument("--hosts", type=int, default=2, help="number of hosts (default: %(default)s)")
    up.add_argument(
        "--rate-gbit",
        type=_rate,
        default=10.0,
        help="rate of every link, each direction, Gbit/s; 'none' = unlimited (default: %(default)s)",
    )
    up.add_argument(
        "--delay-us",
        type=float,
        default=0.0,
        help="one-way delay of every link, each direction, microseconds (needs the kernel's netem; "
        "default: %(default)s)",
    )
    up.add_argument("--subnet", help="a /24 to use instead of the first free one of 198.18.0.0/15")
    up.add_argument(
        "--sshd",
        metavar="DIR",
        help="run sshd in every host (keys, known_hosts and a hosts.toml of [[hosts]] entries go to DIR)",
    )
    up.set_defaults(func=cmd_up)
    down = add("down", "remove the testbed and every process in it (nothing to remove is fine)")
    down.set_defaults(func=cmd_down)
    sw = sub.add_parser("sweep", help="remove every testbed whose owner is gone (not those left up by `up`)")
    sw.set_defaults(func=cmd_sweep)
    st = add("status", "print the layout of a testbed that is up")
    st.set_defaults(func=cmd_status)
    ex = add("exec", "run a command inside a host (its exit status is the command's)")
    ex.add_argument("host", help="host name or address ('operator': the root namespace)")
    ex.add_argument("argv", nargs=argparse.REMAINDER, help="-- ARGV...")
    ex.set_defaults(func=cmd_exec)
    se = add("set", "change a host's link while it runs")
    se.add_argument("host", help="host name or address, 'operator', or 'all'")
    se.add_argument("--rate-gbit", help="Gbit/s, or 'none' for unlimited")
    se.add_argument("--delay-us", type=float)
    se.add_argument("--link", choices=("up", "down"))
    se.set_defaults(func=cmd_set)
    args = p.parse_args(argv)
    why = netns.missing_requirements()
    if why:
        return _fail(why)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
