"""A time-compressed Bursted window replayed live through smg and the btbctl gateway (not a test; never gates CI).

    python benchmarks/bench_live_window.py [--runs 3] [--quick] [--netns auto|on|off] [--format json]

What it does, per run and per router (``--routers``; default smg cache_aware, then the btbctl gateway with
cache_aware, btb, btb_plus and least_load), each on a **fresh** fleet (new worker processes, so no prefix cache
carries over from one router to the next):

1. Generates one Bursted window (:func:`~btbctl.engine.trace.generate.generate_bursted`, the published recipe of
   REFERENCE.md s3 scaled down in count, not in shape): ``--bursts`` bursts of ``--burst-size`` requests, each
   burst sharing its own ``--prefix-tokens`` prefix (65,536 tokens = 256 blocks by default) plus a unique
   256-token suffix and 1 output token, burst ``k`` at ``20 s + 40 s x k`` +-2 s, its requests spread evenly
   over ``--spread-s``; plus ``--decoys`` single requests with their own prefix of the same length, uniform over
   the window. The seed is the same for every router and run (``--seed``), so every router sees the same window.
2. Picks a time scale ``T = window length / --wall-s`` (model seconds per wall second): the emulated workers
   (``--time-scale T``) and the replay client (``BenchOptions.time_scale = T``) run T times faster than the model,
   so the whole window takes about ``--wall-s`` seconds of wall time. The gateway's detection window (BTB Z,
   1 model second) is given in wall seconds, ``1 / T``.
3. Starts ``--workers`` emulated Llama-3.3-70B workers (4 x H100 each, the default fleet), one per host of the
   namespace testbed (``tests/netns.py``), with the router in the root namespace; replays the window with
   ``btbctl bench``'s client; reads every worker's ``/metrics`` (prefill tokens computed = prompt tokens - cached
   tokens) and ``/btb/copies`` (copies sent, blocks, bytes).

**Copies take network time.** The emulated workers send scaled-down blocks (``kv_bytes_scale`` S) over TCP
without pacing them, so the pacing is the link's. Only the KV transfer traffic is paced (an ``htb`` qdisc on both
ends of every host's link sends TCP segments to the workers' transfer port, matched by a ``u32`` filter, through
a paced class; everything else -- requests and answers -- unshaped), because a request's prompt text is not
scaled down and would otherwise queue behind the scaled link. The arithmetic, for the defaults:

* real block (256 tokens of Llama-3.3-70B at 327,680 KV bytes per token) = 83,886,080 bytes; emulated block =
  83,886,080 / S bytes (S = 4096: 20,480 bytes). A copy of n blocks sends n x 83,886,080 / S bytes.
* pretended NIC: 4 x H100 at 400 Gbit/s each = 1.6 Tbit/s = 200 GB/s per replica (the cost model's
  ``nic_bytes_per_s``); a copy of n blocks takes ``n x 83,886,080 / 200e9`` model seconds, i.e. that / T wall
  seconds.
* equal wall time needs link rate L (bytes/s) with ``n x 83,886,080 / S / L = n x 83,886,080 / 200e9 / T``, so
  ``L = 200e9 x T / S`` bytes/s = ``1.6e12 x T / S`` bit/s. For T = 3 and S = 4096: 1.17 Gbit/s. A 256-block
  prefix (21.5 GB real, 5.2 MB emulated) then takes 0.107 model s = 36 ms wall, against a 7.5 model-s prefill.
  Framing (a few dozen bytes per 20 KB block) and TCP/IP headers add ~3%, the token bucket's burst (128 KiB) lets
  the first 2.5% of a copy through at once; both are left as they are.

Without the testbed (``--netns off``, or ``auto`` without root/iproute2) the workers run on loopback and copies
are not paced (they take less time than on the pretended hardware); the report says which was used.

Reported per router and run: TTFT mean/p95/p99 in **model seconds** (wall TTFT x T), prefill tokens computed,
copies and bytes copied (bytes at the real, unscaled size; ``wire_bytes``: what crossed the link), errors. Then
the ratios btb_plus / smg cache_aware for TTFT mean, p95 and prefill tokens per run and their median, against
the targets (0.5, 0.7, 0.6). Client, gateway and workers share this machine's cores, so the numbers depend on its
load; the report records the load average before and after each round.

A floor on prefill tokens, whatever the router: every burst prefix once, every suffix, and every decoy whole
(a decoy's prefix is its own), ``bursts x prefix + bursts x burst_size x 256 + decoys x (prefix + 256)``. With the
published ratio of 15 decoys per burst the decoys are about 90% of it, so the total ratio against any router can
only drop well below 1 if that router recomputes burst prefixes many times; ``prefill_tokens_by_kind`` (prompt
minus the cached tokens each answer reported) and the ``burst_prefill_tokens`` ratio show the bursts alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bench_router import SMG_VERSION, Fleet, copy_timeline, worker_counters

from btbctl.engine.errors import BtbctlError
from btbctl.engine.httpclient import urlopen
from btbctl.engine.launcher.bench import BenchOptions, replay
from btbctl.engine.launcher.cluster import WorkerSpec, emulated_argv
from btbctl.engine.trace.generate import BurstedParams, generate_bursted
from btbctl.engine.worker.config import make_config

ROUTERS = ("smg cache_aware", "btbctl cache_aware", "btbctl btb", "btbctl btb_plus", "btbctl least_load")
TARGETS = {"mean": 0.5, "p95": 0.7, "prefill_tokens": 0.6}
#: Transfer port of every worker inside its host (each host is its own namespace, so they may all use one).
TRANSFER_PORT = 7000
HTTP_PORT = 30000
MODEL = "llama-3.3-70b"
PAGE = 256


# -- the window --------------------------------------------------------------------------------------------------


def window_params(args) -> BurstedParams:
    last = 20.0 + 40.0 * (args.bursts - 1) + 2.0 + args.spread_s
    return BurstedParams(
        bursts=args.bursts,
        burst_size=args.burst_size,
        spread_s=args.spread_s,
        prefix_tokens=args.prefix_tokens,
        decoys=args.decoys,
        decoy_start_s=14.0,
        decoy_end_s=max(14.0, last),
    )


def time_scale_for(params: BurstedParams, wall_s: float) -> float:
    """Model seconds per wall second so that the window lasts ``wall_s`` of wall time."""
    return params.window_end_s() / wall_s


# -- the paced links ---------------------------------------------------------------------------------------------


def block_sizes(kv_bytes_scale: int) -> tuple[int, int]:
    """``(real block bytes, emulated block bytes)`` of the fleet's model and page size."""
    cfg = make_config(model_path=MODEL, page_size=PAGE, kv_bytes_scale=kv_bytes_scale)
    emu = cfg.block_bytes()
    return emu * kv_bytes_scale, emu


def nic_bytes_per_s() -> float:
    """The pretended replica NIC (cost model): bytes/s."""
    return make_config(model_path=MODEL).cluster().replica_cost().nic_bytes_per_s


def link_rate_bit(time_scale: float, kv_bytes_scale: int) -> float:
    """Bits/s of the paced transfer link so that a copy's wall time is its model time / ``time_scale`` (see the
    module docstring): ``NIC bytes/s x T x emulated block / real block x 8``."""
    real, emu = block_sizes(kv_bytes_scale)
    return nic_bytes_per_s() * time_scale * emu / real * 8


def pace_transfers(tb, rate_bit: float) -> None:
    """On both ends of every host's link: an ``htb`` qdisc whose class 1:1 (TCP to the transfer port) is paced at
    ``rate_bit``; all other traffic goes to class 1:2 (100 Gbit/s: unshaped in practice)."""
    import netns

    burst = str(max(int(rate_bit) // 8 // 1000, 131072))
    for h in tb.hosts:
        for port in (h._near, h._far):
            ns, dev = port.ns, port.dev
            tc = netns._tc
            tc(ns, "qdisc", "del", "dev", dev, "root", check=False)
            tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "2")
            rate = f"{int(rate_bit)}bit"
            paced = ["rate", rate, "ceil", rate, "burst", burst, "cburst", burst]
            tc(ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", *paced)
            tc(ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:2", "htb", "rate", "100gbit")
            match = ["match", "ip", "protocol", "6", "0xff", "match", "ip", "dport", str(TRANSFER_PORT), "0xffff"]
            tc(
                ns,
                "filter",
                "add",
                "dev",
                dev,
                "parent",
                "1:",
                "protocol",
                "ip",
                "prio",
                "1",
                "u32",
                *match,
                "flowid",
                "1:1",
            )


def paced_bytes(tb) -> int:
    """Bytes the paced class sent on the hosts' egress (each copy counted once, at its source)."""
    import netns

    total = 0
    for h in tb.hosts:
        out = netns._tc(h._near.ns, "-s", "class", "show", "dev", h._near.dev).stdout
        m = re.search(r"class htb 1:1 .*?\n\s*Sent (\d+) bytes", out)
        if m:
            total += int(m.group(1))
    return total


def open_netns(n_hosts: int):
    """A testbed of ``n_hosts`` hosts with unshaped links (the caller paces the transfer traffic)."""
    import netns

    return netns.open_testbed(n_hosts, rate_gbit=None)


def netns_missing() -> str | None:
    try:
        import netns
    except ImportError as e:  # pytest is a test extra
        return f"tests/netns.py cannot be imported: {e}"
    return netns.missing_requirements()


# -- the fleet ---------------------------------------------------------------------------------------------------


class LiveFleet(Fleet):
    """Emulated workers at time scale ``T`` (on testbed hosts, or loopback with ``tb`` None) and one router."""

    def __init__(self, logdir: Path, name: str, tb, time_scale: float, kv_bytes_scale: int, n: int) -> None:
        super().__init__(logdir, name)
        self.tb = tb
        self.time_scale = time_scale
        self.kv_bytes_scale = kv_bytes_scale
        self.n = n
        self.token_file = self.logdir / "worker-token"
        self.token_file.write_text("bench-" + os.urandom(8).hex())
        self.token_file.chmod(0o600)

    def start_workers(self) -> list[str]:
        spec = WorkerSpec(model=MODEL, time_scale=self.time_scale, kv_bytes_scale=self.kv_bytes_scale)
        token = str(self.token_file)
        if self.tb is None:
            return self.spawn_workers([emulated_argv(spec, 0, 0, token_file=token) for _ in range(self.n)])
        hosts = self.tb.hosts[: self.n]
        return self.spawn_workers(
            [h.argv(emulated_argv(spec, HTTP_PORT, TRANSFER_PORT, token_file=token, host=h.address)) for h in hosts]
        )

    def gateway(self, urls: list[str], policy: str, prefix_blocks: int, seed: int) -> str:
        window = f"{1.0 / self.time_scale:.6g}"
        extra = ("--window-s", window, "--seed", str(seed), "--worker-token-file", str(self.token_file))
        return self.btbctl_gateway(urls, policy, prefix_blocks, *extra, log_level="info")


# -- one round ---------------------------------------------------------------------------------------------------


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _copies_detail(urls: list[str]) -> list[dict]:
    """Source records of every worker's ``/btb/copies`` (bytes of the scaled store)."""
    out = []
    for u in urls:
        try:
            with urlopen(u + "/btb/copies", timeout=10) as r:
                recs = json.loads(r.read()).get("copies", [])
        except (OSError, ValueError):
            continue
        out += [c for c in recs if c.get("role") == "source"]
    return out


def live_round(router: str, run: int, args, trace, time_scale: float, tb, logdir: Path) -> dict:
    prefix_blocks = args.prefix_tokens // PAGE
    real_block, emu_block = block_sizes(args.kv_bytes_scale)
    load_before = loadavg()
    name = f"run{run}-{router.replace(' ', '-')}"
    paced0 = 0 if tb is None else paced_bytes(tb)
    with LiveFleet(logdir, name, tb, time_scale, args.kv_bytes_scale, args.workers) as fleet:
        urls = fleet.start_workers()
        if router == "smg cache_aware":
            target = fleet.smg(args.smg, urls)
        else:
            target = fleet.gateway(urls, router.split()[-1], prefix_blocks, args.seed + run)
        unix0 = time.time()
        report = replay(trace, BenchOptions(target, time_scale=time_scale, timeout_s=args.request_timeout_s))
        # let copies still in flight finish before reading the records
        time.sleep(0.5)
        rep = report.as_dict()
        counts = [worker_counters(u) for u in urls]
        timeline = copy_timeline(urls, unix0)
        detail = _copies_detail(urls)
    paced = None if tb is None else paced_bytes(tb) - paced0
    ok = [r for r in report.results if r.ttft_s is not None]

    def model_summary(rs) -> dict:
        vals = sorted(r.ttft_s * time_scale for r in rs)
        if not vals:
            return {"mean": None, "p50": None, "p95": None, "p99": None, "max": None}
        return {
            "mean": statistics.fmean(vals),
            "p50": _pct(vals, 50),
            "p95": _pct(vals, 95),
            "p99": _pct(vals, 99),
            "max": vals[-1],
        }

    blocks = sum(int(c.get("blocks") or 0) for c in detail if c.get("state") == "done")
    late = [r for r in report.results if r.sent_s - r.scheduled_s > 0.05]
    return {
        "router": router,
        "run": run,
        "requests": rep["requests"],
        "errors": rep["errors"],
        "errors_by_status": rep["errors_by_status"],
        "ttft_model_s": model_summary(ok),
        "ttft_model_s_by_kind": {k: model_summary([r for r in ok if r.kind == k]) for k in ("burst", "decoy")},
        "replay_wall_s": round(report.duration_s, 2),
        "sent_late_over_50ms": len(late),
        "served_per_worker": [c["requests"] for c in counts],
        "prefill_tokens_computed": sum(c["prompt_tokens"] - c["cached_tokens"] for c in counts),
        "prompt_tokens": sum(c["prompt_tokens"] for c in counts),
        "prefill_tokens_by_kind": {k: _prefill_of(ok, k) for k in ("burst", "decoy")},
        "copies": sum(1 for c in detail if c.get("state") == "done"),
        "copies_failed": sum(1 for c in detail if c.get("state") == "failed"),
        "copied_blocks": blocks,
        "copied_bytes": blocks * real_block,
        "wire_bytes": sum(int(c.get("bytes_sent") or 0) for c in detail),
        "paced_link_bytes": paced,
        "copy_wall_s": [
            round(c["finished_s"] - c["started_s"], 3) for c in timeline if c.get("finished_s") is not None
        ],
        "copy_timeline": timeline,
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
    }


def _prefill_of(ok, kind: str) -> int | None:
    """Prompt tokens minus the cached tokens the answers reported, over the answered requests of ``kind`` (None
    when an answer did not report its cached tokens)."""
    rs = [r for r in ok if r.kind == kind]
    if any(r.cached_tokens is None for r in rs):
        return None
    return sum(r.prompt_tokens - r.cached_tokens for r in rs)


def _pct(vals: list[float], q: float) -> float:
    """Linear-interpolated percentile of sorted ``vals``."""
    k = (len(vals) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


def ratios(rows: list[dict], runs: int) -> dict:
    """btb_plus / smg cache_aware per run (TTFT mean, p95, prefill tokens) and their medians, with the targets."""
    out: dict = {}
    num, den = "btbctl btb_plus", "smg cache_aware"
    for key, get in (
        ("mean", lambda r: r["ttft_model_s"]["mean"]),
        ("p95", lambda r: r["ttft_model_s"]["p95"]),
        ("prefill_tokens", lambda r: r["prefill_tokens_computed"]),
        ("burst_prefill_tokens", lambda r: r["prefill_tokens_by_kind"]["burst"]),
    ):
        per_run = []
        for run in range(runs):
            by = {r["router"]: r for r in rows if r["run"] == run}
            if num in by and den in by and get(by[den]) and get(by[num]) is not None:
                per_run.append(get(by[num]) / get(by[den]))
        if per_run:
            med = statistics.median(per_run)
            target = TARGETS.get(key)
            out[key] = {
                "runs": per_run,
                "median": med,
                "target": target,
                "met": None if target is None else med <= target,
            }
    return out


# -- main --------------------------------------------------------------------------------------------------------


def default_smg() -> str | None:
    """``smg`` on PATH, else the one installed beside this Python (a virtual environment not activated)."""
    beside = Path(sys.executable).parent / "smg"
    return shutil.which("smg") or (str(beside) if os.access(beside, os.X_OK) else None)


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smg", default=default_smg(), help="smg executable (default: smg on PATH or beside Python)")
    ap.add_argument(
        "--routers",
        type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
        default=None,
        help="comma-separated subset of: " + ", ".join(ROUTERS),
    )
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a small smoke window (2 bursts, ~15 s wall per round)")
    ap.add_argument("--netns", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--bursts", type=int, default=4)
    ap.add_argument("--burst-size", type=int, default=200)
    ap.add_argument("--spread-s", type=float, default=60.0, help="model seconds a burst's arrivals span")
    ap.add_argument("--prefix-tokens", type=int, default=65536)
    ap.add_argument("--decoys", type=int, default=60)
    ap.add_argument("--wall-s", type=float, default=60.0, help="wall seconds the window should take")
    ap.add_argument("--kv-bytes-scale", type=int, default=4096)
    ap.add_argument("--request-timeout-s", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--format", choices=("human", "json"), default="human")
    args = ap.parse_args(argv)
    if args.quick:
        args.bursts, args.burst_size, args.decoys, args.wall_s = 2, 40, 6, 15.0
        args.prefix_tokens = min(args.prefix_tokens, 16384)
        args.spread_s = min(args.spread_s, 10.0)
    if args.routers is None:
        args.routers = list(ROUTERS)
    return args


def run_bench(args) -> dict:
    unknown = [r for r in args.routers if r not in ROUTERS]
    if unknown or args.runs < 1 or args.prefix_tokens % PAGE:
        raise BtbctlError(
            f"unknown router(s) {unknown} (valid: {', '.join(ROUTERS)}); --runs >= 1; --prefix-tokens a multiple "
            f"of {PAGE}"
        )
    if "smg cache_aware" in args.routers and not args.smg:
        raise BtbctlError(
            f"smg not found: pip install smg=={SMG_VERSION} (or --smg PATH, or leave it out of --routers)"
        )
    params = window_params(args)
    trace = generate_bursted(params, seed=args.seed)
    ts = time_scale_for(params, args.wall_s)
    why = netns_missing() if args.netns != "off" else "--netns off"
    if why and args.netns == "on":
        raise BtbctlError(f"namespace testbed unavailable: {why}")
    rate = link_rate_bit(ts, args.kv_bytes_scale)
    real_block, emu_block = block_sizes(args.kv_bytes_scale)
    rows: list[dict] = []
    tb = None
    with tempfile.TemporaryDirectory(prefix="bench-live-") as tmp:
        try:
            if not why:
                tb = open_netns(args.workers)
                pace_transfers(tb, rate)
            for run in range(args.runs):
                for r in args.routers:
                    rows.append(live_round(r, run, args, trace, ts, tb, Path(tmp)))
        finally:
            if tb is not None:
                tb.close()
    return {
        "smg_version": SMG_VERSION if "smg cache_aware" in args.routers else None,
        "window": {
            **{k: v for k, v in params.as_dict().items() if not k.startswith("background")},
            "requests": len(trace.requests),
            "model_s": params.window_end_s(),
        },
        "fleet": {"workers": args.workers, "model": MODEL, "gpus": "4 x H100 per worker"},
        "time_scale": ts,
        "ttft_unit": "model seconds (wall seconds x time_scale)",
        "network": {
            "testbed": "netns" if tb is not None else "loopback",
            "why_not_netns": why,
            "transfer_link_gbit": rate / 1e9 if tb is not None else None,
            "nic_bytes_per_s": nic_bytes_per_s(),
            "kv_bytes_scale": args.kv_bytes_scale,
            "real_block_bytes": real_block,
            "emulated_block_bytes": emu_block,
        },
        "rows": rows,
        "ratios_btb_plus_over_smg": ratios(rows, args.runs),
    }


def _f(x, fmt=".2f") -> str:
    return "-" if x is None else format(x, fmt)


def print_human(res: dict) -> None:
    w, n = res["window"], res["network"]
    print(
        f"window: {w['bursts']} bursts x {w['burst_size']} (spread {w['spread_s']:g} s, prefix {w['prefix_tokens']} "
        f"tokens) + {w['decoys']} decoys = {w['requests']} requests over {w['model_s']:.0f} model s; "
        f"time scale {res['time_scale']:.3f}; {res['fleet']['workers']} x {res['fleet']['model']} (4xH100)"
    )
    if n["testbed"] == "netns":
        print(f"network: namespace testbed, transfer traffic paced at {n['transfer_link_gbit']:.3f} Gbit/s")
    else:
        print(f"network: loopback, copies NOT paced ({n['why_not_netns']})")
    print(f"TTFT in {res['ttft_unit']}")
    print(
        f"{'router':20} {'run':>3} {'mean':>7} {'p95':>7} {'p99':>7} {'burst mean':>10} {'prefill tok':>12} "
        f"{'burst prefill':>13} {'copies':>6} {'copied GB':>9} {'err':>4} {'served':>16} {'load before/after':>18}"
    )
    for r in res["rows"]:
        t = r["ttft_model_s"]
        print(
            f"{r['router']:20} {r['run']:>3} {_f(t['mean']):>7} {_f(t['p95']):>7} {_f(t['p99']):>7} "
            f"{_f(r['ttft_model_s_by_kind']['burst']['mean']):>10} {r['prefill_tokens_computed']:>12} "
            f"{_f(r['prefill_tokens_by_kind']['burst'], 'd'):>13} "
            f"{r['copies']:>6} {r['copied_bytes'] / 1e9:>9.1f} {r['errors']:>4} "
            f"{'/'.join(str(x) for x in r['served_per_worker']):>16} "
            f"{r['loadavg_before'][0]:>8.2f}/{r['loadavg_after'][0]:.2f}"
        )
    print()
    for k, v in res["ratios_btb_plus_over_smg"].items():
        runs = ", ".join(f"{x:.2f}" for x in v["runs"])
        verdict = (
            "no target" if v["target"] is None else f"target <= {v['target']}: " + ("met" if v["met"] else "MISSED")
        )
        print(f"btb_plus/smg {k:20}: runs {runs}; median {v['median']:.2f} ({verdict})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        res = run_bench(args)
    except BtbctlError as e:
        sys.stderr.write(f"bench_live_window: error: {e}\n")
        return 2
    if args.format == "json":
        print(json.dumps(res, indent=2))
    else:
        print_human(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
