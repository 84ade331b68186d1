"""Evidence reports: run a declared matrix (setups x workloads x fidelities x policies) and write Markdown with
tables, plus PNG charts when matplotlib is installed.

A matrix is a TOML file (see ``examples/evidence-matrix.toml``)::

    title = "..."
    seed = 42
    setups = ["70b_h100x4", "qwen3_8b_h100x4"]          # btbctl.engine.setups.SETUPS
    policies = ["cache_aware", "btb", "btb_plus"]        # btbctl.engine.policies.POLICIES
    fidelities = ["infersim", "realistic"]

    [btb]                                                 # optional: BTB's four constants (published defaults)
    prefix_blocks = 256

    [[workloads]]
    name = "bursted-1s"
    description = "one Bursted window, each burst within 1 s"
    [workloads.trace.generate]                            # a dry-run trace section: a file or a generated window
    spread_s = 1.0

Relative trace paths resolve against the matrix file's folder. :func:`run_matrix` reads or generates each
workload's trace once, here, and runs every cell (one simulation per setup x workload x fidelity x policy) through
:func:`btbctl.engine.executor.run_batch` (this process, a local process pool, or Ray tasks; the matrix and its traces
travel once per worker, or once to Ray's object store); :func:`render_markdown` turns the results into Markdown;
:func:`write_report` writes it, with charts. Everything in the Markdown depends only on the matrix (no timings, not
where the runs went), so re-running it gives the same file.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from btbctl import __version__
from btbctl.engine.config import FIDELITIES, read_toml, validate
from btbctl.engine.constants import BtbConstants
from btbctl.engine.dryrun import DryRunConfig, TraceSource, _error, load_trace, round_floats
from btbctl.engine.errors import ConfigError
from btbctl.engine.executor import Executor, run_batch
from btbctl.engine.trace.model import Trace

#: The non-BTB policies a report compares BTB-style policies against (every policy of the matrix not in
#: :data:`BTB_POLICIES`).
BTB_POLICIES = ("btb", "btb_plus")
#: The reference policy whose mean TTFT is each cell's floor ("gap to floor"; realistic fidelity only).
FLOOR_POLICY = "clairvoyant"
#: The extra to install for PNG charts (``pyproject.toml``: ``report = ["matplotlib>=3.7"]``).
CHARTS_EXTRA = "pip install 'btbctl[report]'"


class WorkloadSpec(BaseModel):
    """One workload of a matrix: a name for tables and file names, and where its requests come from."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, strict=True, allow_inf_nan=False)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    """Short name (letters, digits, ``_.-``), used in headings and chart file names."""
    description: str = ""
    """One line saying what the workload is."""
    trace: TraceSource = Field(default_factory=TraceSource)
    """A trace file or a generated Bursted window, as a dry-run's ``[trace]`` section."""


class ReportMatrix(BaseModel):
    """A declared experiment matrix (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, strict=True, allow_inf_nan=False)

    title: str = "btbctl evidence report"
    """Heading of the report."""
    seed: int = 42
    """Seed of every simulation and of generated traces (unless a workload's trace sets its own)."""
    setups: list[str]
    """Named setups (``btbctl.engine.setups.SETUPS``), in report order."""
    policies: list[str]
    """Routing policies, in table order."""
    fidelities: list[str] = Field(default_factory=lambda: ["realistic"])
    """Simulator profiles (``realistic``, ``infersim``)."""
    workloads: list[WorkloadSpec]
    """Workloads, in report order."""
    btb: BtbConstants = Field(default_factory=BtbConstants)
    """BTB's four constants for every BTB-style policy."""
    notes: str = ""
    """Markdown printed after the summary (what the numbers mean, caveats)."""

    @field_validator("setups")
    @classmethod
    def _known_setups(cls, v: list[str]) -> list[str]:
        from btbctl.engine.setups import ALL_SETUPS

        return _known(v, ALL_SETUPS, "setup")

    @field_validator("policies")
    @classmethod
    def _known_policies(cls, v: list[str]) -> list[str]:
        from btbctl.engine.policies import SIM_POLICIES

        return _known(v, SIM_POLICIES, "policy")

    @field_validator("fidelities")
    @classmethod
    def _known_fidelities(cls, v: list[str]) -> list[str]:
        return _known(v, FIDELITIES, "fidelity")

    @field_validator("workloads")
    @classmethod
    def _unique_workloads(cls, v: list[WorkloadSpec]) -> list[WorkloadSpec]:
        if not v:
            raise _error("no_workloads", "at least one workload is needed")
        names = [w.name for w in v]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise _error("duplicate_workload", f"workload {dup!r} is listed twice")
        return v

    def dryrun_config(self, workload: WorkloadSpec, setup: str, fidelity: str) -> DryRunConfig:
        """The dry-run config of one cell (its policy aside)."""
        return DryRunConfig.model_validate(
            {
                "trace": workload.trace.model_dump(exclude_unset=True),
                "setup": setup,
                "seed": self.seed,
                "fidelity": fidelity,
                "btb": self.btb.model_dump(),
                "policies": list(self.policies),
            }
        )


def _known(v: list[str], valid, what: str) -> list[str]:
    if not v:
        raise _error(f"no_{what}", f"at least one {what} is needed; valid: {', '.join(valid)}")
    for name in v:
        if name not in valid:
            raise _error(f"unknown_{what}", f"unknown {what} {name!r}; valid: {', '.join(valid)}")
    if len(set(v)) != len(v):
        raise _error(f"duplicate_{what}", f"a {what} is listed twice")
    return v


def load_matrix(path: str | os.PathLike) -> ReportMatrix:
    """Read a matrix from TOML; relative workload trace paths resolve against the file's folder.

    Raises:
        ConfigError: unreadable file, invalid TOML (names the line), an unknown key or bad value (names the dotted
            key and what is valid), a workload whose generator settings disagree or whose trace file is missing.
    """
    spath = os.fspath(path)
    data = read_toml(spath, "matrix")
    matrix = validate(ReportMatrix, data, spath)
    folder = os.path.dirname(spath)
    for i, wl in enumerate(matrix.workloads):
        if wl.trace.path is not None and not os.path.isabs(wl.trace.path):
            wl.trace = wl.trace.model_copy(update={"path": os.path.normpath(os.path.join(folder, wl.trace.path))})
        if wl.trace.path is not None and not os.path.isfile(wl.trace.path):
            what = "is a directory, not a trace file" if os.path.isdir(wl.trace.path) else "no such trace file"
            raise ConfigError(f"workloads.{i}.trace.path", f"{wl.trace.path}: {what}", spath)
        try:
            matrix.dryrun_config(wl, matrix.setups[0], matrix.fidelities[0]).check()
        except ConfigError as e:
            raise ConfigError(f"workloads.{i}.{e.key}", e.reason, spath) from None
    return matrix


# -- running ---------------------------------------------------------------------------------------------------------

_TRACES: dict[tuple, Trace] = {}


def _trace(matrix: ReportMatrix, name: str) -> Trace:
    """The trace of workload ``name``, read or generated once per process (keyed by its settings and seed)."""
    wl = next(w for w in matrix.workloads if w.name == name)
    key = (wl.trace.model_dump_json(), matrix.seed)
    tr = _TRACES.get(key)
    if tr is None:
        tr = load_trace(matrix.dryrun_config(wl, matrix.setups[0], matrix.fidelities[0]))
        _TRACES[key] = tr
    return tr


def run_cell(matrix: ReportMatrix, setup: str, workload: str, fidelity: str, policy: str) -> dict:
    """Simulate one cell; its result fields (see :func:`run_matrix`)."""
    return _simulate_cell(matrix, _trace(matrix, workload), setup, workload, fidelity, policy)


def cell_task(shared: tuple[ReportMatrix, dict[str, Trace]], task: tuple[str, str, str, str]) -> dict:
    """One run of a batch (:func:`btbctl.engine.executor.run_batch`): ``shared`` is ``(matrix, {workload name:
    trace})``, ``task`` is ``(setup, workload, fidelity, policy)``."""
    matrix, traces = shared
    return _simulate_cell(matrix, traces[task[1]], *task)


def _simulate_cell(matrix: ReportMatrix, trace: Trace, setup: str, workload: str, fidelity: str, policy: str) -> dict:
    from btbctl.engine.setups import setup_cluster
    from btbctl.engine.sim import simulate

    res = simulate(trace, policy, setup_cluster(setup), matrix.btb, seed=matrix.seed, fidelity=fidelity)
    s = res.summary(replication_details=True)
    return {
        "setup": setup,
        "workload": workload,
        "fidelity": fidelity,
        "policy": policy,
        "requests": s["requests"],
        "ttft_s": s["ttft_s"],
        "by_kind": {
            k: {"requests": v["requests"], "mean": v["ttft_s"]["mean"], "p95": v["ttft_s"]["p95"]}
            for k, v in s["by_kind"].items()
        },
        "prefix_hit_ratio": s["prefix_hit_ratio"],
        "replications": s["replications"],
        "replicated_bytes": s["replicated_bytes"],
        "wasted_replications": s["wasted_replications"],
        "time_to_warm_s": s["time_to_warm_s"],
        "copies_refused": s["copies_refused"],
        "drain_s": max((r.finish_s for r in res.records), default=0.0) - trace.requests[-1].arrival_s
        if trace.requests
        else 0.0,
    }


def prefill_demand(trace: Trace, setup: str) -> float:
    """Offered prefill load of ``trace`` on ``setup`` with ideal prefix reuse, as a fraction of the fleet's compute
    over the trace's span (realistic cost model): every distinct block is computed once in the whole fleet, each
    request computes its blocks not seen before plus its prompt tokens without a block hash, at their context;
    sum of those prefill times / (replicas x span). No router does better, so above 1 the fleet must fall behind;
    below 1 it can still fall behind through decode work and imperfect reuse. NaN for a trace spanning no time."""
    from btbctl.engine.setups import setup_cluster

    cl = setup_cluster(setup)
    cost = cl.replica_cost()
    span = trace.span_s
    if span <= 0:
        return math.nan
    bt = trace.block_tokens
    seen: set = set()
    flops = 0.0
    for r in trace.requests:
        chain = r.block_hashes
        k = 0
        while k < len(chain) and chain[k] in seen:  # prefix-chained: a seen block means its prefix was seen
            k += 1
        seen.update(chain[k:])
        have = min(k * bt, r.input_tokens - 1)
        flops += cost.prefill_flops(r.input_tokens - have, have)
    return flops / (cost.flops * cost.mfu) / (cl.replicas * span)


def run_matrix(
    matrix: ReportMatrix,
    progress: Callable[[int], None] | None = None,
    *,
    jobs: int | None = None,
    ray: str | None = None,
) -> dict:
    """Run every cell of ``matrix``.

    Args:
        matrix: the experiment.
        progress: called with 1 each time a cell finishes.
        jobs: worker processes, or CPUs of a local Ray (default: the CPUs available; 1 without Ray runs in this
            process).
        ray: None to run on this machine's processes; ``"local"`` to start a Ray here; or the address of a running
            Ray cluster (see :class:`btbctl.engine.executor.Executor`).

    Returns:
        ``{"btbctl_version", "title", "seed", "notes", "constants", "setups", "policies", "fidelities",
        "workloads": [{"name", "description", "requests", "span_s", "block_tokens", "format",
        "prefill_demand": {setup: fraction}}],
        "cells": [{"setup", "workload", "fidelity", "policy", "requests", "ttft_s": {"mean", "p50", "p95", "p99",
        "max"}, "by_kind": {kind: {"requests", "mean", "p95"}}, "prefix_hit_ratio", "replications",
        "replicated_bytes", "wasted_replications", "time_to_warm_s": {...} or None, "copies_refused", "drain_s"
        (seconds from the last arrival to the last request's end)}, ...]
        (setups x workloads x fidelities x policies, in that nesting order),
        "timing": {"wall_s", "jobs", "executor"}}``; seconds, floats rounded as in dry-run reports; ``timing.jobs``
        counts worker processes (Ray: the cluster's CPUs), ``timing.executor`` is ``inline``, ``processes`` or
        ``ray``. Everything but ``timing`` depends only on the matrix.

    Raises:
        ConfigError: bad settings (``jobs``, ``ray``; ``ray`` set without Ray installed); TraceFormatError: an
            unreadable trace; BtbctlError: a Ray cluster that cannot be reached or a cell that failed there after
            its retries.
    """
    from btbctl.engine.policies import REFERENCE_POLICIES

    executor = Executor(jobs=jobs, ray=ray)
    executor.check()
    tasks = [
        (setup, wl.name, fid, pol)
        for setup in matrix.setups
        for wl in matrix.workloads
        for fid in matrix.fidelities
        for pol in matrix.policies
        if fid == "realistic" or pol not in REFERENCE_POLICIES  # reference policies run realistic only
    ]
    workloads = []
    traces = {}
    for wl in matrix.workloads:
        tr = traces[wl.name] = _trace(matrix, wl.name)
        workloads.append(
            {
                "name": wl.name,
                "description": wl.description,
                "requests": len(tr),
                "span_s": tr.span_s,
                "block_tokens": tr.block_tokens,
                "format": tr.format,
                "prefill_demand": {s: prefill_demand(tr, s) for s in matrix.setups},
            }
        )
    size = {wl["name"]: wl["requests"] for wl in workloads}
    # biggest traces first, so the pool's last tasks are short; results go back in task order
    order = sorted(range(len(tasks)), key=lambda i: (-size[tasks[i][1]], i))
    t0 = time.perf_counter()
    cells, info = run_batch(cell_task, (matrix, traces), tasks, executor, progress=progress, order=order)
    return round_floats(
        {
            "btbctl_version": __version__,
            "title": matrix.title,
            "seed": matrix.seed,
            "notes": matrix.notes,
            "constants": matrix.btb.as_dict(),
            "setups": list(matrix.setups),
            "policies": list(matrix.policies),
            "fidelities": list(matrix.fidelities),
            "workloads": workloads,
            "cells": cells,
            "timing": {"wall_s": time.perf_counter() - t0, "jobs": info["jobs"], "executor": info["executor"]},
        }
    )


# -- Markdown --------------------------------------------------------------------------------------------------------


def _t(x) -> str:
    """Seconds with 3 significant digits (at least 3 decimals below 1 s)."""
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def _cell_index(report: dict) -> dict:
    return {(c["setup"], c["workload"], c["fidelity"], c["policy"]): c for c in report["cells"]}


def comparison(report: dict, setup: str, workload: str, fidelity: str, policy: str = "btb_plus") -> dict | None:
    """``policy`` against the other policies of one (setup, workload, fidelity): ``{"policy", "mean", "p95",
    "best_other": {"mean": (name, value), "p95": (name, value)}, "cache_aware": {"mean", "p95"} or None,
    "vs_best_other": {"mean": fraction, "p95": fraction}, "vs_cache_aware": {...} or None}`` where a fraction is
    ``(policy - other) / other`` (negative = better). None when the policy or every non-BTB policy is missing."""
    idx = _cell_index(report)
    me = idx.get((setup, workload, fidelity, policy))
    others = [p for p in report["policies"] if p not in BTB_POLICIES and p != FLOOR_POLICY]
    rows = [idx[(setup, workload, fidelity, p)] for p in others if (setup, workload, fidelity, p) in idx]
    if me is None or not rows:
        return None
    out: dict[str, Any] = {
        "policy": policy,
        "mean": me["ttft_s"]["mean"],
        "p95": me["ttft_s"]["p95"],
        "best_other": {},
        "vs_best_other": {},
    }
    for m in ("mean", "p95"):
        best = min(rows, key=lambda c: c["ttft_s"][m])
        out["best_other"][m] = (best["policy"], best["ttft_s"][m])
        out["vs_best_other"][m] = (me["ttft_s"][m] - best["ttft_s"][m]) / best["ttft_s"][m]
    ca = idx.get((setup, workload, fidelity, "cache_aware"))
    out["cache_aware"] = None if ca is None else {m: ca["ttft_s"][m] for m in ("mean", "p95")}
    out["vs_cache_aware"] = (
        None if ca is None else {m: (me["ttft_s"][m] - ca["ttft_s"][m]) / ca["ttft_s"][m] for m in ("mean", "p95")}
    )
    return out


def gap_to_floor(report: dict, setup: str, workload: str, fidelity: str, policy: str) -> float | None:
    """``(policy mean TTFT - floor) / floor`` where the floor is :data:`FLOOR_POLICY`'s mean TTFT in the same
    (setup, workload, fidelity); None without both cells (or a zero floor)."""
    idx = _cell_index(report)
    me, floor = idx.get((setup, workload, fidelity, policy)), idx.get((setup, workload, fidelity, FLOOR_POLICY))
    if me is None or floor is None or not floor["ttft_s"]["mean"]:
        return None
    return (me["ttft_s"]["mean"] - floor["ttft_s"]["mean"]) / floor["ttft_s"]["mean"]


def render_markdown(report: dict, command: str, charts: dict[str, str] | None = None) -> str:
    """The report as Markdown.

    Args:
        report: :func:`run_matrix`'s result.
        command: the command line that regenerates the report (printed at the top).
        charts: chart file names (relative to the Markdown file) by ``"<setup>/<fidelity>"``; none when empty.
    """
    from btbctl.engine.setups import ALL_SETUPS as SETUPS

    charts = charts or {}
    idx = _cell_index(report)
    k = report["constants"]
    L: list[str] = [
        f"# {report['title']}",
        "",
        (
            f"Regenerate with `{command}` (btbctl {report['btbctl_version']}, seed {report['seed']}; BTB "
            f"constants Y = {k['prefix_blocks']} blocks, X = {k['threshold']}, Z = {k['window_s']:g} s, "
            f"M = {k['warm_replicas']}). Times are seconds of simulated time to first token (TTFT)."
        ),
        "",
    ]
    L += ["## Workloads", "", "| workload | what | requests | span s | block tokens |", "|---|---|---:|---:|---:|"]
    for wl in report["workloads"]:
        L.append(
            f"| {wl['name']} | {wl['description']} | {wl['requests']:,} | {wl['span_s']:,.0f} | {wl['block_tokens']} |"
        )
    fid = "realistic" if "realistic" in report["fidelities"] else report["fidelities"][0]
    L += [
        "",
        (
            f"Load of each setup: prefill demand with ideal reuse (every distinct block computed once in the "
            f"fleet, as a fraction of the fleet's compute over the trace's span: above 1 no routing can keep up) "
            f"and the backlog left when the last request arrives (seconds the best {fid} run still needed to "
            f"finish every request; large values mean the fleet fell behind and TTFT mostly measures the queue)."
        ),
        "",
        "| setup | " + " | ".join(f"{w['name']} demand | backlog s" for w in report["workloads"]) + " |",
        "|---|" + "---:|---:|" * len(report["workloads"]),
    ]
    over = []
    for s in report["setups"]:
        cells = []
        for wl in report["workloads"]:
            d = wl["prefill_demand"].get(s)
            drains = [
                c.get("drain_s")
                for c in report["cells"]
                if c["setup"] == s
                and c["workload"] == wl["name"]
                and c["fidelity"] == fid
                and c.get("drain_s") is not None
            ]
            cells += ["-" if d is None else f"{d:.2f}", _t(min(drains)) if drains else "-"]
            if d is not None and d > 1:
                over.append(f"{s} on {wl['name']} ({d:.1f}x)")
        L.append(f"| {s} | " + " | ".join(cells) + " |")
    L.append("")
    if over:
        L += [
            "Overloaded whatever the routing (prefill demand above 1 even with ideal reuse): "
            + "; ".join(over)
            + ". Their numbers are reported as they come out.",
            "",
        ]
    if report.get("notes"):
        L += ["## Notes", "", report["notes"].strip(), ""]

    if FLOOR_POLICY in report["policies"]:
        pols = [p for p in report["policies"] if p != FLOOR_POLICY]
        L += [
            "## Gap to the clairvoyant floor",
            "",
            (
                f"Mean TTFT of {FLOOR_POLICY} (btb_plus with every burst known in advance; realistic fidelity "
                "only) and each policy's gap to it, (mean - floor) / floor; negative: below the floor."
            ),
            "",
            "| setup | workload | floor mean | " + " | ".join(pols) + " |",
            "|---|---|---:|" + "---:|" * len(pols),
        ]
        for s in report["setups"]:
            for wl in report["workloads"]:
                fl = idx.get((s, wl["name"], "realistic", FLOOR_POLICY))
                if fl is None:
                    continue
                gaps = [_fmt_frac(gap_to_floor(report, s, wl["name"], "realistic", p)) for p in pols]
                L.append(f"| {s} | {wl['name']} | {_t(fl['ttft_s']['mean'])} | " + " | ".join(gaps) + " |")
        L.append("")

    if "btb_plus" in report["policies"]:
        L += [
            "## btb_plus against the best other policy",
            "",
            (
                "Change of btb_plus's TTFT against cache_aware and against the best non-BTB policy of the same cell "
                "(negative is better)."
            ),
            "",
            (
                "| setup | workload | fidelity | btb_plus mean | p95 | best other mean | best other p95 | "
                "vs cache_aware mean | p95 | vs best other mean | p95 |"
            ),
            "|---|---|---|---:|---:|---|---|---:|---:|---:|---:|",
        ]
        for s in report["setups"]:
            for wl in report["workloads"]:
                for f in report["fidelities"]:
                    c = comparison(report, s, wl["name"], f)
                    if c is None:
                        continue
                    ca = c["vs_cache_aware"] or {}
                    bo_m, bo_p = c["best_other"]["mean"], c["best_other"]["p95"]
                    L.append(
                        f"| {s} | {wl['name']} | {f} | {_t(c['mean'])} | {_t(c['p95'])} | "
                        f"{_t(bo_m[1])} ({bo_m[0]}) | {_t(bo_p[1])} ({bo_p[0]}) | "
                        f"{_fmt_frac(ca.get('mean'))} | {_fmt_frac(ca.get('p95'))} | "
                        f"{_fmt_frac(c['vs_best_other']['mean'])} | {_fmt_frac(c['vs_best_other']['p95'])} |"
                    )
        L.append("")

    for s in report["setups"]:
        st = SETUPS[s]
        L += [f"## {s}: {st.description}", ""]
        if "infersim" in report["fidelities"]:
            pub = st.published
            L += [
                (
                    f"Published (Bursted-ART test set, reference simulator): cache_aware mean "
                    f"{pub.cache_aware_mean_s:g} / p95 {pub.cache_aware_p95_s:g} s, btb mean {pub.btb_mean_s:g} / p95 "
                    f"{pub.btb_p95_s:g} s. The test set mixed real ART-Chat windows with synthetic ones; the synthetic "
                    "windows alone (below) give other absolute numbers."
                ),
                "",
            ]
        for f in report["fidelities"]:
            key = f"{s}/{f}"
            if key in charts:
                L += [f"![TTFT mean and p95 by policy, {s}, {f}]({charts[key]})", ""]
            for wl in report["workloads"]:
                rows = [idx.get((s, wl["name"], f, p)) for p in report["policies"]]
                rows = [r for r in rows if r is not None]
                if not rows:
                    continue
                kinds = sorted({kd for r in rows for kd in r["by_kind"]})
                L += [f"### {s} / {wl['name']} / {f}", ""]
                floor = idx.get((s, wl["name"], f, FLOOR_POLICY))
                head = (
                    ["policy", "mean", "p50", "p95", "p99"]
                    + [f"{kd} mean" for kd in kinds]
                    + ["hit %", "copies", "GB moved", "wasted", "warm mean", "warm p95"]
                    + (["gap to floor"] if floor is not None else [])
                )
                L.append("| " + " | ".join(head) + " |")
                L.append("|---|" + "---:|" * (len(head) - 1))
                for r in rows:
                    tt = r["ttft_s"]
                    warm = r["time_to_warm_s"] or {}
                    wasted = r["wasted_replications"]
                    cells = [r["policy"], _t(tt["mean"]), _t(tt["p50"]), _t(tt["p95"]), _t(tt["p99"])]
                    cells += [_t(r["by_kind"][kd]["mean"]) if kd in r["by_kind"] else "-" for kd in kinds]
                    cells += [
                        f"{100 * r['prefix_hit_ratio']:.1f}",
                        f"{r['replications']:,}",
                        f"{r['replicated_bytes'] / 1e9:,.1f}",
                        "-" if wasted is None else f"{wasted:,}",
                        _t(warm.get("mean")) if r["replications"] else "-",
                        _t(warm.get("p95")) if r["replications"] else "-",
                    ]
                    if floor is not None:
                        cells.append(_fmt_frac(gap_to_floor(report, s, wl["name"], f, r["policy"])))
                    L.append("| " + " | ".join(cells) + " |")
                L.append("")
    L += [
        "## Columns",
        "",
        (
            "mean/p50/p95/p99: TTFT over all requests (the infersim fidelity uses the reference simulator's "
            "percentile, sorted[int(q n)]); <kind> mean: TTFT mean by request kind; hit %: prompt tokens served from "
            "cache; copies: KV-cache replications completed; GB moved: their bytes / 1e9; wasted: copies that no "
            "request reused afterwards; warm mean/p95: seconds from the moment the policy saw the need for a copy "
            "(its detector firing) to the copy's last byte; gap to floor: (mean - the clairvoyant reference's mean) "
            "/ its mean, in the same cell."
        ),
        "",
    ]
    return "\n".join(L)


def _fmt_frac(x) -> str:
    return "-" if x is None else f"{100 * x:+.0f}%"


# -- charts and files ------------------------------------------------------------------------------------------------


def charts_available() -> bool:
    """Whether matplotlib can be imported (the ``report`` extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_charts(report: dict, out_dir: str) -> dict[str, str]:
    """One PNG per (setup, fidelity): TTFT mean and p95 per policy, one panel per workload. Returns file names
    relative to ``out_dir`` by ``"<setup>/<fidelity>"``. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    idx = _cell_index(report)
    written = {}
    pols = report["policies"]
    for s in report["setups"]:
        for f in report["fidelities"]:
            wls = [w["name"] for w in report["workloads"]]
            fig, axes = plt.subplots(1, len(wls), figsize=(4.2 * len(wls), 3.6), squeeze=False)
            for ax, w in zip(axes[0], wls, strict=True):
                cells = [idx.get((s, w, f, p)) for p in pols]
                xs = range(len(pols))
                means = [c["ttft_s"]["mean"] if c else float("nan") for c in cells]
                p95s = [c["ttft_s"]["p95"] if c else float("nan") for c in cells]
                ax.bar([x - 0.2 for x in xs], means, width=0.4, label="mean")
                ax.bar([x + 0.2 for x in xs], p95s, width=0.4, label="p95")
                ax.set_xticks(list(xs))
                ax.set_xticklabels(pols, rotation=45, ha="right", fontsize=7)
                ax.set_title(w, fontsize=9)
                ax.set_ylabel("TTFT s")
            axes[0][0].legend(fontsize=7)
            fig.suptitle(f"{s} ({f})", fontsize=10)
            fig.tight_layout()
            name = f"{s}-{f}.png"
            fig.savefig(os.path.join(out_dir, name), dpi=110)
            plt.close(fig)
            written[f"{s}/{f}"] = name
    return written


def write_report(report: dict, out_dir: str, command: str, *, charts: bool = True, filename: str = "README.md") -> dict:
    """Write the Markdown (and charts unless ``charts`` is False or matplotlib is missing) into ``out_dir``.

    Returns:
        ``{"markdown": path, "charts": [paths], "charts_skipped": None or the reason}``.

    Raises:
        ConfigError: ``out_dir`` cannot be created or written (key ``out``).
    """
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError("out", f"cannot create {out_dir}: {e.strerror or e}") from None
    chart_files: dict[str, str] = {}
    skipped = None
    if not charts:
        skipped = "disabled"
    elif not charts_available():
        skipped = f"matplotlib is not installed ({CHARTS_EXTRA})"
    else:
        chart_files = write_charts(report, out_dir)
    md = render_markdown(report, command, chart_files)
    path = os.path.join(out_dir, filename)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(md)
    except OSError as e:
        raise ConfigError("out", f"cannot write {path}: {e.strerror or e}") from None
    return {
        "markdown": path,
        "charts": [os.path.join(out_dir, n) for n in chart_files.values()],
        "charts_skipped": skipped,
    }


__all__ = [
    "BTB_POLICIES",
    "CHARTS_EXTRA",
    "FLOOR_POLICY",
    "ReportMatrix",
    "WorkloadSpec",
    "cell_task",
    "charts_available",
    "comparison",
    "gap_to_floor",
    "load_matrix",
    "prefill_demand",
    "render_markdown",
    "run_cell",
    "run_matrix",
    "write_charts",
    "write_report",
]
