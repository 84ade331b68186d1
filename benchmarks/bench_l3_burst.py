"""BTB's copy modes against cache-aware routing on one burst (not a test; never gates CI).

For each replication mode (``l3``: node agents and warm-up proofs, the path of stock SGLang fleets; ``push``: the
emulated workers' own copies) and each run: a fresh fleet of 4 emulated Llama-3.3-70B workers on 4 x H100 (TP 4,
page size 256) with ``[btb] prefix_blocks = 64, threshold = 2, window_s = 1.0, warm_replicas = 4`` and the gateway's
default policy, started with ``btbctl up -d``; one burst (``btbctl trace gen --bursts 1 --burst-size 200
--prefix-tokens 16384 --suffix-tokens 256 --output-tokens 4 --spread-s 4 --decoys 0``) replayed with ``btbctl bench``;
then ``btbctl tune policy=cache_aware`` and a fresh burst of the same shape (another seed) on the same fleet. Reported
per mode, as the median over ``--runs`` runs: TTFT p50 / p95 / mean of both policies and their ratios (default /
cache_aware, in the same run), the requests each worker served under the default policy, and the copies: their
outcome and the time from the copy's start (the detector's fire) to a usable replica (``usable_s``; push: every
block verified at the target; l3: the target's warm-up proved the prefix from L3).

    python benchmarks/bench_l3_burst.py                   # both modes, 3 runs each
    python benchmarks/bench_l3_burst.py --modes l3 --runs 1 --format json
    sudo python benchmarks/bench_l3_burst.py --hosts 2 --link-gbit 10     # the namespace testbed (below)
    sudo python benchmarks/bench_l3_burst.py --hosts 2 --prefix-tokens 65536 --kv-bytes-scale 256
    python benchmarks/bench_l3_burst.py --warm-source     # one worker holds the prefix before the burst
    python benchmarks/bench_l3_burst.py --modes l3 --gateways 2   # 2 gateways vs 1 on the same burst

``--gateways 2``: per run, the default policy's burst on a fresh fleet with one gateway, then the same burst (same
seed) on a fresh fleet with two (``[gateway] replicas = 2``, sharing the fleet through a local redis-server), split
by alternating requests over the two gateways' URLs, one ``btbctl bench --target`` process each, started together;
their ``--requests-out`` lines are merged for TTFT p50 / p95 / mean. The one-gateway burst is split the same way
over two client processes (both to that gateway), so the client side is the same and only the gateways differ.
Reported: the medians of both and of the per-run ratios (2 gateways / 1). Needs redis-server.

Two shapes of burst. By default the prefix is cold: the burst's first request computes it, and a copy can only
trail that prefill (push: block by block; l3: page by page once each prefill chunk is written through, then the
target's proof), so on idle workers a copy cannot land before a recompute started at the burst's second request
and ``btb_plus`` recomputes there instead (rule 4). ``--warm-source`` sends one request of the prefix (its own
suffix) before each burst and waits for its answer, so one worker holds the prefix when the burst begins, as when
a job's system prompt or shared document was used shortly before: copies then start from a complete source.

Workers, gateway, agents and the client share this machine's cores, so absolute times depend on it; the ratios
are taken within one run.

On one machine all four workers share one node agent (one L3 tier), which is not how a 16-GPU fleet is laid out.
``--hosts N`` (2 or 4) runs the same shape on the namespace testbed of ``tests/netns.py``: N hosts, each with its
sshd, 4 / N of the workers and (``l3``) its own node agent, every link paced at ``--link-gbit`` Gbit/s, the fleet
started over SSH by ``btbctl up -d`` from the operator side (the gateway and the client stay in the root namespace,
behind the operator's link). Copies between hosts then move their bytes agent to agent (``l3``) or worker to worker
(``push``) across the links. The worker settings are the single-machine ones (time scale 1, the worker's default
``kv_bytes_scale``); at that scale a 64-block prefix is 82 kB (1,280 bytes a page), far too little for the link to
pace it (``--kv-bytes-scale`` moves more bytes a page). Between the two bursts the benchmark waits until no
copy is in flight, and the copies are read from ``GET /control/transfers`` (every copy that finished since the
default policy's burst began, whether or not the client was still replaying). Each copy that crossed a link reports
its hosts, ``bytes``, ``send_s`` (the source agent's seconds of sending), ``overlap_s`` and the achieved rate
``bytes * 8 / send_s`` against the link rate. Push copies have no ``send_s`` (nor, today, a ``transfer_s``): their
rate is taken over ``duration_s``, plan to every block verified, which includes waiting for the source's prefill, so
it is a lower bound on the rate while sending (``rate_over`` names the time used). Needs root, iproute2 (``ip``,
``tc``) and OpenSSH's sshd; exits with the reason otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The workers of one fleet (spread evenly over ``--hosts``).
WORKERS = 4
#: Host counts ``--hosts`` takes besides 0 (one machine): those that spread :data:`WORKERS` evenly.
TESTBED_HOSTS = (2, 4)

CLUSTER = """
[gateway]
port = 0
control_port = 0

[btb]
prefix_blocks = 64
threshold = 2
window_s = 1.0
warm_replicas = 4

[replication]
mode = "{mode}"
arena_mib = 256

[[workers]]
name = "w"
count = {workers}
model = "llama-3.3-70b"
gpu = "h100"
tp_size = 4
page_size = 256
ready_timeout_s = 60.0
"""


def _btbctl(*args: str, timeout: float = 600.0) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("BTBCTL_RUN_DIR", "BTBCTL_DEBUG")}
    proc = subprocess.run(
        [sys.executable, "-m", "btbctl", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )
    if proc.returncode != 0:
        raise SystemExit(f"btbctl {' '.join(args[:2])} exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
    return proc.stdout


#: Tokens of the burst's shared prefix (``--prefix-tokens``; the shape's 16k by default).
PREFIX_TOKENS = 16384


def _trace(path: Path, seed: int, prefix_tokens: int = PREFIX_TOKENS) -> Path:
    _btbctl(
        "trace", "gen", "-o", str(path), "--bursts", "1", "--burst-size", "200", "--prefix-tokens", str(prefix_tokens),
        "--suffix-tokens", "256", "--output-tokens", "4", "--spread-s", "4", "--decoys", "0",
        "--first-burst-s", "0", "--jitter-s", "0", "--seed", str(seed),
    )  # fmt: skip
    return path


def warm_source_trace(trace: Path, out: Path) -> Path:
    """``out``: one request of ``trace``'s shared prefix (its first request's leading blocks, up to the blocks it
    shares with the second) with a suffix block of its own, sent at 0 (:func:`one_run`'s ``warm_source``)."""
    lines = trace.read_text().splitlines()
    first, second = (json.loads(x) for x in lines[:2])
    shared = 0
    for a, b in zip(first["hash_ids"], second["hash_ids"], strict=False):
        if a != b:
            break
        shared += 1
    page = first["input_length"] // len(first["hash_ids"])
    prelude = dict(first, arrival_s=0.0, hash_ids=[*first["hash_ids"][:shared], "warm-source"])
    prelude["input_length"] = page * (shared + 1)
    out.write_text(json.dumps(prelude) + "\n")
    return out


def _testbed_path() -> None:
    """Put this checkout and its ``tests/`` (the namespace testbed's helpers) first on ``sys.path``."""
    for p in (str(ROOT / "tests"), str(ROOT)):
        if p in sys.path:
            sys.path.remove(p)
        sys.path.insert(0, p)


def testbed_cluster(hosts: list[dict], mode: str, kv_bytes_scale: int | None = None) -> str:
    """The cluster file (TOML text) of the single-machine shape (:data:`CLUSTER`) on the testbed ``hosts``
    (``[[hosts]]`` entries): :data:`WORKERS` workers spread evenly over them, the gateway's default policy, the
    same ``[btb]``, arena and worker settings. Raises ValueError when the hosts cannot share the workers evenly."""
    _testbed_path()
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    from netns_fleet import fleet_toml

    if not hosts or WORKERS % len(hosts):
        raise ValueError(f"{len(hosts)} hosts cannot share {WORKERS} workers evenly")
    one = tomllib.loads(CLUSTER.format(mode=mode, workers=WORKERS))
    worker = {k: v for k, v in one["workers"][0].items() if k not in ("name", "count")}
    if kv_bytes_scale is not None:
        worker["kv_bytes_scale"] = kv_bytes_scale
    return fleet_toml(
        hosts,
        mode,
        policy=one["gateway"].get("policy"),
        workers_per_host=WORKERS // len(hosts),
        base_worker={},
        worker=worker,
        replication={k: v for k, v in one["replication"].items() if k != "mode"},
        prefix_blocks=one["btb"]["prefix_blocks"],
        max_retries=one["gateway"].get("max_retries"),
    )


def copy_row(c: dict, host_of: Callable[[str], str | None], link_gbit: float | None) -> dict:
    """One copy of a bench result's ``copies`` (or :func:`btbctl.engine.launcher.bench.copies_during`) as the
    benchmark reports it; ``host_of``: the testbed host of a worker URL (None: not on a testbed). A copy whose
    source and target are on different hosts ``crossed`` the link; if it moved bytes, ``gbit_s`` is ``bytes * 8 /
    send_s`` (l3; push copies have no ``send_s`` and use ``transfer_s``, else ``duration_s``; ``rate_over`` names
    the one used) and ``link_ratio`` that rate over ``link_gbit``."""
    src, dst = host_of(c["source"]), host_of(c["target"])
    row = {
        "outcome": c.get("outcome") or c["state"],
        "error": c.get("error"),
        "usable_s": c.get("usable_s"),
        "phases_s": c.get("phases_s"),
        "proof_storage_tokens": c.get("proof_storage_tokens"),
        "covered_tokens": c.get("covered_tokens"),
        "bytes": c.get("bytes") or 0,
        "send_s": c.get("send_s"),
        "transfer_s": c.get("transfer_s"),
        "duration_s": c.get("duration_s"),
        "overlap_s": c.get("overlap_s"),
        "source_host": src,
        "target_host": dst,
        "crossed": src is not None and dst is not None and src != dst,
    }
    over = "send_s" if c.get("send_s") else None
    if over is None and c.get("mode") == "push":
        over = next((k for k in ("transfer_s", "duration_s") if c.get(k)), None)
    if row["crossed"] and row["bytes"] and over and link_gbit:
        gbit = row["bytes"] * 8 / c[over] / 1e9
        row.update(rate_over=over, gbit_s=gbit, link_ratio=gbit / link_gbit)
    return row


def _local_host(url: str) -> str | None:
    return None


def one_run(mode: str, run: int, tmp: Path, prefix_tokens: int = PREFIX_TOKENS, warm_source: bool = False) -> dict:
    """One fresh fleet in ``mode``: the default policy's burst, then cache_aware's on a fresh prefix (each after
    one request of its prefix, answered, with ``warm_source``)."""
    cfg = tmp / f"cluster-{mode}.toml"
    cfg.write_text(CLUSTER.format(mode=mode, workers=WORKERS))
    rd = tmp / f"run-{mode}-{run}"
    _btbctl("up", "-d", "-c", str(cfg), "--run-dir", str(rd), timeout=300)
    try:
        out = {}
        for policy, seed in (("default", 100 + 2 * run), ("cache_aware", 101 + 2 * run)):
            if policy != "default":
                _btbctl("tune", "--run-dir", str(rd), f"policy={policy}")
            trace = _trace(tmp / f"trace-{mode}-{run}-{policy}.jsonl", seed, prefix_tokens)
            if warm_source:
                warm = warm_source_trace(trace, tmp / f"warm-{mode}-{run}-{policy}.jsonl")
                _btbctl("bench", "--run-dir", str(rd), "--trace", str(warm), "--format", "json")
            rep = json.loads(_btbctl("bench", "--run-dir", str(rd), "--trace", str(trace), "--format", "json"))
            out[policy] = rep
        out["copies"] = [copy_row(c, _local_host, None) for c in out["default"]["copies"] or []]
        return out
    finally:
        _btbctl("down", "--run-dir", str(rd), timeout=120)


def _gateway_cluster(mode: str, gateways: int) -> str:
    """:data:`CLUSTER` in ``mode`` with ``[gateway] replicas = gateways`` (several gateways share the fleet)."""
    text = CLUSTER.format(mode=mode, workers=WORKERS)
    return text.replace("[gateway]\n", f"[gateway]\nreplicas = {gateways}\n", 1) if gateways > 1 else text


def split_trace(trace: Path, parts: int, tmp: Path) -> list[Path]:
    """``trace`` split by alternating lines into ``parts`` files (arrival times kept), request ``i`` in part
    ``i % parts``."""
    lines = trace.read_text().splitlines()
    out = []
    for k in range(parts):
        p = tmp / f"{trace.stem}-part{k}.jsonl"
        p.write_text("".join(line + "\n" for line in lines[k::parts]))
        out.append(p)
    return out


def replay_split(urls: list[str], trace: Path, tmp: Path) -> dict:
    """Replay ``trace`` split half/half (one part a URL, :func:`split_trace`) with one ``btbctl bench --target``
    process per gateway, all started together; their ``--requests-out`` lines merged. Returns ``ttft_s`` (the
    summary of the merged answered requests' TTFTs, seconds), ``requests``, ``errors`` and ``per_gateway`` (requests
    each part sent)."""
    from btbctl.engine.stats import summarize as summarize_s

    env = {k: v for k, v in os.environ.items() if k not in ("BTBCTL_RUN_DIR", "BTBCTL_DEBUG")}
    parts = split_trace(trace, len(urls), tmp)
    procs = []
    for k, (url, part) in enumerate(zip(urls, parts, strict=True)):
        res = tmp / f"{trace.stem}-part{k}-requests.jsonl"
        argv = [sys.executable, "-m", "btbctl", "bench", "--target", url, "--trace", str(part), "--format", "json"]
        procs.append((res, subprocess.Popen([*argv, "--requests-out", str(res)], cwd=ROOT, env=env, text=True,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)))  # fmt: skip
    rows: list[dict] = []
    per_gateway = []
    for res, proc in procs:
        _, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"btbctl bench exited {proc.returncode}: {err.strip()[-800:]}")
        got = [json.loads(line) for line in res.read_text().splitlines() if line.strip()]
        per_gateway.append(len(got))
        rows += got
    ok = [r for r in rows if r["status"] == "ok" and r.get("ttft_s") is not None]
    return {
        "ttft_s": summarize_s(r["ttft_s"] for r in ok),
        "requests": len(rows),
        "errors": len(rows) - len(ok),
        "per_gateway": per_gateway,
    }


def gateways_run(mode: str, run: int, tmp: Path, prefix_tokens: int = PREFIX_TOKENS, warm_source: bool = False) -> dict:
    """One burst (the default policy's, seed ``100 + 2 * run``) on a fresh fleet with one gateway, then the same
    burst on a fresh fleet with two (``[gateway] replicas = 2``), the burst split half/half over two client
    processes either way (both to the one gateway, or one to each of the two). Returns
    ``{"1": ..., "2": ...}`` of :func:`replay_split`."""
    from btbctl.engine.launcher.rundir import RunDir

    trace = _trace(tmp / f"trace-{mode}-{run}-gw.jsonl", 100 + 2 * run, prefix_tokens)
    out = {}
    for n in (1, 2):
        cfg = tmp / f"cluster-{mode}-gw{n}.toml"
        cfg.write_text(_gateway_cluster(mode, n))
        rd = tmp / f"run-{mode}-{run}-gw{n}"
        _btbctl("up", "-d", "-c", str(cfg), "--run-dir", str(rd), timeout=300)
        try:
            state = RunDir(rd).load()
            urls = [p.url for p in state.processes if p.role == "gateway"]
            if len(urls) != n:
                raise SystemExit(f"expected {n} gateways in {rd}, found {len(urls)}")
            if warm_source:
                warm = warm_source_trace(trace, tmp / f"warm-{mode}-{run}-gw{n}.jsonl")
                _btbctl("bench", "--target", urls[0], "--trace", str(warm), "--format", "json")
            # two client processes either way (one a gateway, or both on the one), so only the gateways differ
            out[str(n)] = replay_split(urls * (2 // n), trace, tmp)
        finally:
            _btbctl("down", "--run-dir", str(rd), timeout=120)
    return out


def summarize_gateways(mode: str, runs: list[dict]) -> dict:
    """Medians over ``runs`` (of :func:`gateways_run`) of TTFT p50 / p95 / mean with 1 and 2 gateways, and of the
    per-run ratios (2 gateways / 1)."""

    def med(f) -> float:
        return statistics.median(f(r) for r in runs)

    return {
        "mode": mode,
        "runs": len(runs),
        **{
            f"gateways_{n}": {k: med(lambda r, n=n, k=k: r[n]["ttft_s"][k]) for k in ("p50", "p95", "mean")}
            for n in ("1", "2")
        },
        "ratio_p95": med(lambda r: r["2"]["ttft_s"]["p95"] / r["1"]["ttft_s"]["p95"]),
        "ratio_mean": med(lambda r: r["2"]["ttft_s"]["mean"] / r["1"]["ttft_s"]["mean"]),
        "ratios_p95": [r["2"]["ttft_s"]["p95"] / r["1"]["ttft_s"]["p95"] for r in runs],
        "errors": {n: sum(r[n]["errors"] for r in runs) for n in ("1", "2")},
        "per_gateway": [r["2"]["per_gateway"] for r in runs],
    }


def testbed_missing() -> str | None:
    """Why the namespace testbed cannot run here (root, iproute2, sshd), or None."""
    _testbed_path()
    try:
        import netns
    except ImportError as e:  # the testbed's helpers import pytest (the dev dependencies)
        return f"the testbed helpers need the dev dependencies ({e})"
    why = netns.missing_requirements()
    if why is None and (netns.sshd_binary() is None or netns.shutil.which("ssh-keygen") is None):
        why = "needs OpenSSH's sshd and ssh-keygen (apt-get install openssh-server openssh-client)"
    return why


def one_testbed_run(
    mode: str,
    run: int,
    tmp: Path,
    tb,
    servers,
    kv_bytes_scale: int | None,
    prefix_tokens: int = PREFIX_TOKENS,
    warm_source: bool = False,
) -> dict:
    """As :func:`one_run`, on the testbed ``tb`` (hosts reached through ``servers``' sshd): the copies of the
    default policy's burst come from ``GET /control/transfers`` once none is in flight."""
    from btbctl.engine.launcher.bench import copies_during
    from netns_fleet import Fleet, host_entry, stop_fleet

    cfg = tmp / f"cluster-{mode}-{run}.toml"
    cfg.write_text(testbed_cluster([host_entry(s) for s in servers], mode, kv_bytes_scale))
    rd = tmp / f"run-{mode}-{run}"
    fleet = None
    try:
        st = json.loads(_btbctl("up", "-d", "-c", str(cfg), "--run-dir", str(rd), "--format", "json", timeout=300))
        fleet = Fleet(st, rd, tb, tmp)
        out: dict = {}
        for policy, seed in (("default", 100 + 2 * run), ("cache_aware", 101 + 2 * run)):
            if policy != "default":
                _btbctl("tune", "--run-dir", str(rd), f"policy={policy}")
            trace = _trace(tmp / f"trace-{mode}-{run}-{policy}.jsonl", seed, prefix_tokens)
            if warm_source:
                warm = warm_source_trace(trace, tmp / f"warm-{mode}-{run}-{policy}.jsonl")
                _btbctl("bench", "--run-dir", str(rd), "--trace", str(warm), "--format", "json")
            before = fleet.transfers() if policy == "default" else None
            rep = json.loads(_btbctl("bench", "--run-dir", str(rd), "--trace", str(trace), "--format", "json"))
            out[policy] = rep
            if before is not None:  # the default policy's copies, once none is in flight (before the next burst)
                after = fleet.settle(timeout_s=120)
                out["copies"] = [
                    copy_row(c, fleet.host_of_url, tb.hosts[0].rate_gbit) for c in copies_during(before, after) or []
                ]
        return out
    finally:
        stop_fleet(fleet, rd)


def summarize(mode: str, runs: list[dict]) -> dict:
    def med(f) -> float:
        return statistics.median(f(r) for r in runs)

    def ttft(r: dict, policy: str, k: str) -> float:
        return r[policy]["ttft_s"][k]

    copies = [c for r in runs for c in r["copies"]]
    usable = [c["usable_s"] for c in copies if c.get("usable_s") is not None]
    crossed = [c for c in copies if c.get("crossed")]
    rated = [c for c in crossed if c.get("gbit_s") is not None]

    def cmed(rows: list[dict], key: str) -> float | None:
        xs = [c[key] for c in rows if c.get(key) is not None]
        return statistics.median(xs) if xs else None

    return {
        "mode": mode,
        "runs": len(runs),
        "default": {k: med(lambda r, k=k: ttft(r, "default", k)) for k in ("p50", "p95", "mean")},
        "cache_aware": {k: med(lambda r, k=k: ttft(r, "cache_aware", k)) for k in ("p50", "p95", "mean")},
        "ratio_p95": med(lambda r: ttft(r, "default", "p95") / ttft(r, "cache_aware", "p95")),
        "ratio_mean": med(lambda r: ttft(r, "default", "mean") / ttft(r, "cache_aware", "mean")),
        "errors": sum(r[p]["errors"] for r in runs for p in ("default", "cache_aware")),
        "workers_serving": [len(r["default"]["by_worker"]) for r in runs],
        "requests_per_worker": [sorted(r["default"]["by_worker"].values(), reverse=True) for r in runs],
        "copies": copies,
        "usable_s_median": statistics.median(usable) if usable else None,
        "phases_s_median": {k: cmed([c["phases_s"] or {} for c in copies], k) for k in ("source", "transfer", "proof")},
        "crossed": {
            "copies": len(crossed),
            "rated": len(rated),
            "bytes": cmed(rated, "bytes"),
            "seconds": statistics.median(c[c["rate_over"]] for c in rated) if rated else None,
            "rate_over": sorted({c["rate_over"] for c in rated}),
            "overlap_s": cmed(rated, "overlap_s"),
            "gbit_s": cmed(rated, "gbit_s"),
            "link_ratio": cmed(rated, "link_ratio"),
        },
    }


def _run_modes(args, tmp: Path) -> list[dict]:
    if args.gateways == 2:
        return [
            summarize_gateways(
                m, [gateways_run(m, i, tmp, args.prefix_tokens, args.warm_source) for i in range(args.runs)]
            )
            for m in args.modes.split(",")
        ]
    if not args.hosts:
        return [
            summarize(m, [one_run(m, i, tmp, args.prefix_tokens, args.warm_source) for i in range(args.runs)])
            for m in args.modes.split(",")
        ]
    from netns import open_testbed, start_sshd

    tb = open_testbed(args.hosts, rate_gbit=args.link_gbit)
    try:
        servers = [start_sshd(h, tmp / "ssh") for h in tb.hosts]
        return [
            summarize(
                m,
                [
                    one_testbed_run(m, i, tmp, tb, servers, args.kv_bytes_scale, args.prefix_tokens, args.warm_source)
                    for i in range(args.runs)
                ],
            )
            for m in args.modes.split(",")
        ]
    finally:
        tb.close()


def _ttft(t: dict) -> str:
    """TTFT ``p50/p95/mean`` of a summary, seconds."""
    return f"{t['p50']:.3f}/{t['p95']:.3f}/{t['mean']:.3f}"


def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="l3,push", help="comma-separated replication modes (default: l3,push)")
    ap.add_argument("--runs", type=int, default=3, help="fresh fleets per mode (default 3; medians are reported)")
    ap.add_argument(
        "--hosts",
        type=int,
        default=0,
        help=f"0: one machine (default); {' or '.join(map(str, TESTBED_HOSTS))}: hosts of the namespace testbed, "
        f"the {WORKERS} workers spread evenly over them, one node agent each (needs root, iproute2, sshd)",
    )
    ap.add_argument("--link-gbit", type=float, default=10.0, help="testbed: every link's rate, Gbit/s (default 10)")
    ap.add_argument(
        "--kv-bytes-scale",
        type=int,
        default=None,
        help="testbed: the workers' KV bytes divisor (default: the worker's own, as on one machine)",
    )
    ap.add_argument(
        "--prefix-tokens",
        type=int,
        default=PREFIX_TOKENS,
        help=f"tokens of the burst's shared prefix (default {PREFIX_TOKENS}; 256-token pages)",
    )
    ap.add_argument(
        "--warm-source",
        action="store_true",
        help="send one request of the prefix before each burst (answered), so one worker holds it when it begins",
    )
    ap.add_argument(
        "--gateways",
        type=int,
        choices=(1, 2),
        default=1,
        help="2: per run, the default policy's burst on a fleet with one gateway, then on one with two "
        "([gateway] replicas = 2, the burst split half/half over them); reports both and the p95 ratio",
    )
    ap.add_argument("--format", choices=("human", "json"), default="human")
    args = ap.parse_args(argv)
    if args.prefix_tokens < 256 or args.prefix_tokens % 256:
        ap.error("--prefix-tokens must be a positive multiple of 256 (the workers' page size)")
    if args.hosts and args.hosts not in TESTBED_HOSTS:
        ap.error(f"--hosts {args.hosts}: 0 (one machine) or {' or '.join(map(str, TESTBED_HOSTS))}")
    if args.link_gbit <= 0 or (args.kv_bytes_scale is not None and args.kv_bytes_scale < 1):
        ap.error("--link-gbit must be > 0 and --kv-bytes-scale >= 1")
    if args.kv_bytes_scale is not None and not args.hosts:
        ap.error("--kv-bytes-scale is for the testbed (--hosts 2 or 4); one machine keeps the worker's default")
    if args.gateways == 2 and args.hosts:
        ap.error("--gateways 2 runs on one machine only (no --hosts)")
    if args.hosts:
        why = testbed_missing()
        if why:
            print(f"bench_l3_burst: --hosts {args.hosts} needs the namespace testbed: {why}", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="btb-l3-bench-") as d:
        out = _run_modes(args, Path(d))
    if args.format == "json":
        print(json.dumps(out, indent=2))
        return 0
    where = (
        f"{args.hosts} hosts x {WORKERS // args.hosts} workers, links at {args.link_gbit:g} Gbit/s"
        if args.hosts
        else "one machine"
    )
    warm = ", warm on one worker before each burst" if args.warm_source else ""
    print(f"{where}; a {args.prefix_tokens}-token prefix{warm}; medians over {args.runs} run(s)")
    if args.gateways == 2:
        for s in out:
            one, two = s["gateways_1"], s["gateways_2"]
            print(
                f"{s['mode']:5} 1 gateway p50/p95/mean {_ttft(one)} s; "
                f"2 gateways {_ttft(two)} s; p95 x{s['ratio_p95']:.2f} "
                f"(runs {', '.join(f'x{x:.2f}' for x in s['ratios_p95'])}), mean x{s['ratio_mean']:.2f}; "
                f"errors {s['errors']['1']}/{s['errors']['2']}; requests per gateway {s['per_gateway']}"
            )
        return 0
    for s in out:
        d, ca = s["default"], s["cache_aware"]
        print(
            f"{s['mode']:5} default p50/p95/mean {_ttft(d)} s; cache_aware "
            f"{_ttft(ca)} s; p95 x{s['ratio_p95']:.2f}, "
            f"mean x{s['ratio_mean']:.2f}; errors {s['errors']}; requests per worker {s['requests_per_worker']}"
        )
        outcomes = sorted({c["outcome"] for c in s["copies"]})
        ph = s["phases_s_median"]
        print(
            f"      copies {len(s['copies'])} ({', '.join(outcomes)}), usable after {s['usable_s_median']} s (median); "
            f"phases source/transfer/proof {_f(ph['source'])}/{_f(ph['transfer'])}/{_f(ph['proof'])} s"
        )
        x = s["crossed"]
        if args.hosts:
            print(
                f"      across a link: {x['copies']} copies, {x['rated']} that sent bytes: "
                f"{_f(x['bytes'] and x['bytes'] / 1e6)} MB in "
                f"{_f(x['seconds'])} s of {'/'.join(x['rate_over']) or 'sending'}, {_f(x['gbit_s'])} Gbit/s "
                f"({_f(x['link_ratio'], '.2f')} x the link), {_f(x['overlap_s'])} s behind the source's prefill"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
