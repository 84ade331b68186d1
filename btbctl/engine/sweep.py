"""Sweep: simulate one trace over a grid of BTB's four constants (and optionally fleet size, NIC bandwidth,
fidelity and policy) in parallel, then rank the grid points and build heatmaps over any two axes.

The base settings (trace, cluster, seed, fidelity, policy) are a :class:`~btbctl.engine.dryrun.DryRunConfig`, so a
sweep takes the same trace options as a dry-run. The grid is the cartesian product of the values of every axis in
:data:`AXES` order; a point's ``index`` is its position in that product (the last axis varies fastest). The trace is
read or generated once, here; the runs go through :func:`btbctl.engine.executor.run_batch` (this process, a local
process pool, or Ray tasks), which ships the base settings and the trace once per worker (or once to Ray's object
store) while every task carries only its grid point. Every run is independent and seeded with the config's seed,
and results are put back in ``index`` order, so the output does not depend on how or where the runs were scheduled
(nor on the number of workers).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from btbctl import __version__
from btbctl.engine.config import FIDELITIES, ClusterConfig, validate
from btbctl.engine.constants import BtbConstants
from btbctl.engine.dryrun import DryRunConfig, load_trace, round_floats
from btbctl.engine.errors import ConfigError
from btbctl.engine.executor import Executor, default_jobs, run_batch
from btbctl.engine.trace.model import Trace

#: Grid axes in product order: the four BTB constants, then fleet size, NIC bandwidth per GPU (Gb/s), fidelity,
#: policy. A grid gives each axis one or more values; axes it leaves out take the base config's single value.
AXES = (*BtbConstants.keys(), "replicas", "nic_gbps", "fidelity", "policy")
#: Metrics a sweep can rank by: TTFT ``mean`` or ``p95`` over all requests, seconds.
RANK_BY = ("mean", "p95")
#: Default policy of a sweep: the published BTB rule, whose constants the grid varies.
DEFAULT_SWEEP_POLICY = "btb"


@dataclass(frozen=True)
class SweepGrid:
    """Values of each axis (see :data:`AXES`); an empty tuple means "the base config's value".

    Attributes:
        prefix_blocks: Y values, blocks (integers >= 1).
        threshold: X values, arrivals (integers >= 1).
        window_s: Z values, seconds (> 0).
        warm_replicas: M values, replicas that should hold a hot prefix (integers >= 1).
        replicas: fleet sizes (integers 1..1024).
        nic_gbps: NIC bandwidth per GPU, gigabits per second (> 0).
        fidelity: simulator profiles (``realistic``, ``infersim``).
        policy: routing policy names (``btbctl.engine.policies.POLICIES``).
    """

    prefix_blocks: tuple = ()
    threshold: tuple = ()
    window_s: tuple = ()
    warm_replicas: tuple = ()
    replicas: tuple = ()
    nic_gbps: tuple = ()
    fidelity: tuple = ()
    policy: tuple = ()

    def axes(self, base: DryRunConfig) -> dict[str, list]:
        """Every axis with its values (the base config's value for an axis the grid leaves empty; for ``policy``,
        the base's first policy), duplicates dropped in first-seen order.

        Raises:
            ConfigError: a value out of range or of the wrong type (key: the axis name).
        """
        defaults = {
            **base.btb.as_dict(),
            "replicas": base.cluster.replicas,
            "nic_gbps": base.cluster.nic_gbps,
            "fidelity": base.fidelity,
            "policy": base.policies[0],
        }
        out = {}
        for name in AXES:
            values = list(getattr(self, name)) or [defaults[name]]
            out[name] = [_check(name, v) for v in dict.fromkeys(values)]
        return out


def _check(axis: str, v: Any) -> Any:
    if axis in BtbConstants.keys():
        try:
            return getattr(BtbConstants.parse({axis: v}), axis)
        except ConfigError as e:
            raise ConfigError(axis, f"values must be {BtbConstants.describe(axis)}: {e.reason}") from None
    if axis == "replicas":
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1024:
            raise ConfigError(axis, f"values must be integers 1..1024, got {v!r}")
        return v
    if axis == "nic_gbps":
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
            raise ConfigError(axis, f"values must be numbers > 0, got {v!r}")
        return float(v)
    if axis == "fidelity":
        if v not in FIDELITIES:
            raise ConfigError(axis, f"unknown fidelity {v!r}; valid: {', '.join(FIDELITIES)}")
        return v
    from btbctl.engine.policies import SIM_POLICIES

    if v not in SIM_POLICIES:
        raise ConfigError(axis, f"unknown policy {v!r}; valid: {', '.join(SIM_POLICIES)}")
    return v


def grid_points(axes: dict[str, list]) -> list[dict]:
    """The cartesian product of ``axes`` (keys in :data:`AXES` order) as dicts, in index order."""
    return [dict(zip(AXES, combo, strict=True)) for combo in itertools.product(*(axes[a] for a in AXES))]


@dataclass
class _Point:
    cluster: ClusterConfig
    constants: BtbConstants
    fidelity: str
    policy: str


def _prepare(base: DryRunConfig, point: dict) -> _Point:
    """The cluster and constants of one grid point. Raises :class:`ConfigError` for a fleet that cannot run."""
    cluster = validate(
        ClusterConfig,
        {**base.cluster.model_dump(), "replicas": point["replicas"], "nic_gbps": point["nic_gbps"]},
        prefix="cluster",
    )
    constants = BtbConstants.parse({k: point[k] for k in BtbConstants.keys()})
    return _Point(cluster, constants, point["fidelity"], point["policy"])


def _summary(res) -> dict:
    s = res.summary(replication_details=True)
    ttw = s.get("time_to_warm_s")
    return {
        "ttft_s": s["ttft_s"],
        "by_kind": s["by_kind"],  # the dry-run report's shape: {kind: {"requests", "ttft_s": {...}}}
        "prefix_hit_ratio": s["prefix_hit_ratio"],
        "replications": s["replications"],
        "replicated_bytes": s["replicated_bytes"],
        "wasted_replications": s.get("wasted_replications"),
        "time_to_warm_mean_s": None if ttw is None else ttw["mean"],
    }


def run_point(trace: Trace, base: DryRunConfig, point: dict) -> dict:
    """Simulate one grid point over ``trace``; the point's result fields (see :func:`run_sweep`)."""
    from btbctl.engine.sim import simulate

    p = _prepare(base, point)
    res = simulate(trace, p.policy, p.cluster, p.constants, seed=base.seed, fidelity=p.fidelity)
    return _summary(res)


def point_task(shared: tuple[DryRunConfig, Trace], point: dict) -> dict:
    """One run of a batch (:func:`btbctl.engine.executor.run_batch`): ``shared`` is ``(base, trace)``."""
    base, trace = shared
    return run_point(trace, base, point)


@dataclass
class SweepSpec:
    """A sweep: base settings, grid, ranking.

    Attributes:
        base: trace, cluster, seed, fidelity and policy (the first of ``base.policies``) for axes the grid leaves
            empty.
        grid: the values of each axis.
        rank_by: ``mean`` or ``p95`` (TTFT over all requests).
        jobs: worker processes, or CPUs of a local Ray (>= 1; 1 without Ray runs in this process). Default: the
            CPUs this process may use.
        ray: None to run on this machine's processes; ``"local"`` to start a Ray here; or the address of a running
            Ray cluster (see :class:`btbctl.engine.executor.Executor`).
    """

    base: DryRunConfig
    grid: SweepGrid = field(default_factory=SweepGrid)
    rank_by: str = "mean"
    jobs: int | None = None
    ray: str | None = None

    @property
    def executor(self) -> Executor:
        """Where the runs go."""
        return Executor(jobs=self.jobs, ray=self.ray)

    def validate(self) -> dict[str, list]:
        """Check everything that can be checked before simulating; returns the axes. Raises :class:`ConfigError`:
        bad ``rank_by``, ``jobs`` or ``ray``, an axis value out of range, or a grid point whose fleet cannot run
        (the model does not fit its GPUs)."""
        if self.rank_by not in RANK_BY:
            raise ConfigError("rank_by", f"unknown metric {self.rank_by!r}; valid: {', '.join(RANK_BY)}")
        self.executor.check()
        self.base.check()
        axes = self.grid.axes(self.base)
        for replicas, nic in itertools.product(axes["replicas"], axes["nic_gbps"]):
            point = {
                "replicas": replicas,
                "nic_gbps": nic,
                "prefix_blocks": 1,
                "threshold": 1,
                "window_s": 1.0,
                "warm_replicas": 1,
                "fidelity": "realistic",
                "policy": "round_robin",
            }
            _prepare(self.base, point).cluster.replica_cost()
        return axes


def _rank_key(metric: str):
    def key(row: dict):
        v = row["ttft_s"][metric]
        return (v is None or not math.isfinite(v), v if v is not None and math.isfinite(v) else 0.0, row["index"])

    return key


def run_sweep(spec: SweepSpec, progress: Callable[[int], None] | None = None, *, trace: Trace | None = None) -> dict:
    """Run every grid point of ``spec`` and rank them.

    Args:
        spec: the sweep.
        progress: called with 1 each time a grid point finishes.
        trace: the trace, if the caller loaded it already (else it is read or generated here, once).

    Returns:
        ``{"btbctl_version", "seed", "rank_by",
        "trace": {"path", "format", "requests", "span_s", "block_tokens"},
        "cluster": {"model", "gpu", "gpus_per_replica"},
        "axes": {axis: [values]} (every axis of :data:`AXES`),
        "points": number of grid points,
        "results": [{"rank", "index", "point": {axis: value}, "ttft_s": {"mean", "p50", "p95", "p99", "max"},
        "by_kind": {kind: {"requests", "ttft_s": {"mean", "p50", "p95", "p99", "max"}}} (as in dry-run),
        "prefix_hit_ratio", "replications", "replicated_bytes",
        "wasted_replications", "time_to_warm_mean_s"}, ...] best first (ties by index),
        "timing": {"wall_s", "jobs", "runs_per_s", "executor"}}``; times in seconds, floats rounded as in dry-run
        reports, NaN as None; ``timing.jobs`` counts worker processes (Ray: the cluster's CPUs) and
        ``timing.executor`` is ``inline``, ``processes`` or ``ray``. Everything except ``timing`` depends only on
        ``spec``, not on where the runs went.

    Raises:
        ConfigError: see :meth:`SweepSpec.validate`; a missing trace file; ``ray`` set without Ray installed.
        TraceFormatError: an unreadable trace file.
        BtbctlError: a Ray cluster that cannot be reached or a run that failed there after its retries.
    """
    axes = spec.validate()
    points = grid_points(axes)
    if trace is None:
        trace = load_trace(spec.base)
    t0 = time.perf_counter()
    rows, info = run_batch(point_task, (spec.base, trace), points, spec.executor, progress=progress)
    wall_s = time.perf_counter() - t0
    results = [{"rank": 0, "index": i, "point": points[i], **rows[i]} for i in range(len(points))]
    results = round_floats(results)
    results.sort(key=_rank_key(spec.rank_by))
    for rank, row in enumerate(results, 1):
        row["rank"] = rank
    cl = spec.base.cluster
    return {
        "btbctl_version": __version__,
        "seed": spec.base.seed,
        "rank_by": spec.rank_by,
        "trace": round_floats(
            {
                "path": spec.base.trace.path,
                "format": trace.format,
                "requests": len(trace),
                "span_s": trace.span_s,
                "block_tokens": trace.block_tokens,
            }
        ),
        "cluster": {"model": cl.model, "gpu": cl.gpu, "gpus_per_replica": cl.gpus_per_replica},
        "axes": round_floats(axes),
        "points": len(points),
        "results": results,
        "timing": round_floats(
            {
                "wall_s": wall_s,
                "jobs": info["jobs"],
                "runs_per_s": len(points) / wall_s if wall_s > 0 else None,
                "executor": info["executor"],
            }
        ),
    }


def heatmap(report: dict, x_axis: str, y_axis: str, metric: str | None = None) -> dict:
    """The best ``metric`` TTFT (over every other axis) for each pair of values of two axes of a sweep report.

    Args:
        report: :func:`run_sweep`'s result.
        x_axis, y_axis: two different names of :data:`AXES`.
        metric: ``mean`` or ``p95`` (default: the report's ``rank_by``).

    Returns:
        ``{"x_axis", "y_axis", "metric", "x": [values], "y": [values], "values": [[seconds or None] per y] }``:
        ``values[j][i]`` is the lowest metric over the grid points with ``x_axis = x[i]`` and ``y_axis = y[j]``.

    Raises:
        ConfigError: unknown or equal axes (key ``heatmap``), unknown metric (key ``rank_by``).
    """
    metric = metric or report["rank_by"]
    if metric not in RANK_BY:
        raise ConfigError("rank_by", f"unknown metric {metric!r}; valid: {', '.join(RANK_BY)}")
    for a in (x_axis, y_axis):
        if a not in AXES:
            raise ConfigError("heatmap", f"unknown axis {a!r}; valid: {', '.join(AXES)}")
    if x_axis == y_axis:
        raise ConfigError("heatmap", f"needs two different axes, got {x_axis!r} twice")
    xs, ys = report["axes"][x_axis], report["axes"][y_axis]
    best: dict[tuple, float] = {}
    for row in report["results"]:
        v = row["ttft_s"][metric]
        if v is None:
            continue
        key = (row["point"][x_axis], row["point"][y_axis])
        if key not in best or v < best[key]:
            best[key] = v
    return {
        "x_axis": x_axis,
        "y_axis": y_axis,
        "metric": metric,
        "x": xs,
        "y": ys,
        "values": [[best.get((x, y)) for x in xs] for y in ys],
    }


def parse_list(axis: str, text: str | None, kind: type) -> tuple:
    """``"64,128,256"`` -> ``(64, 128, 256)`` for an axis whose values are ``kind`` (int, float or str); None or
    empty -> ``()``. Raises :class:`ConfigError` (key: the axis) for a value that does not parse."""
    if text is None:
        return ()
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            out.append(kind(part))
        except ValueError:
            raise ConfigError(axis, f"cannot read {part!r} as {kind.__name__} in {text!r}") from None
    return tuple(out)


__all__ = [
    "AXES",
    "DEFAULT_SWEEP_POLICY",
    "RANK_BY",
    "SweepGrid",
    "SweepSpec",
    "default_jobs",
    "grid_points",
    "heatmap",
    "parse_list",
    "point_task",
    "run_point",
    "run_sweep",
]
