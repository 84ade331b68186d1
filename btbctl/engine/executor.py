"""Run many independent simulations: in this process, over a local process pool, or as tasks on Ray.

This is the one seam ``sweep`` and ``report`` share. A batch is a function ``run(shared, task) -> result``, the data
every run needs (``shared``: the base settings and the loaded trace or traces) and a list of small per-run inputs
(``tasks``: a grid point, a matrix cell). :func:`run_batch` calls ``run`` once per task and returns the results in
**task order**, whatever order they finished in, so a caller's output does not depend on where the runs went.
``run`` must be a module-level function (it is pickled by reference) and deterministic.

Executors (:class:`Executor`):

* **inline** (``jobs`` 1, or a single task): one after the other in this process.
* **processes** (the default): a :class:`concurrent.futures.ProcessPoolExecutor` of ``jobs`` workers (default: the
  CPUs this process may use). ``shared`` reaches each worker once, through the pool's initializer (inherited
  with the process where the platform forks, pickled once per worker elsewhere); each task carries only its input.
* **ray**: one Ray task per run. ``ray`` is ``"local"`` to start a Ray instance on this machine for the batch (with
  ``jobs`` CPUs, default all; stopped afterwards) or the address of a running cluster (``auto``, ``HOST:PORT`` of
  its head, ``ray://HOST:PORT`` for Ray Client). ``shared`` is put in the object store once (``ray.put``): a node
  fetches it once, and each Ray worker process deserialises it at its first task and keeps it for the next ones
  (the tasks take the reference inside a list, so Ray does not resolve it for every task). Tasks are retried
  (``max_retries``): a worker process that dies (killed, out of memory) or a node that goes away, and, inside a
  task, a lost or unreachable copy of ``shared`` (``retry_exceptions``). An error raised by ``run`` itself is not
  retried (a deterministic simulation would fail again) and reaches the caller as raised. Every task reports the
  btbctl version it ran, and a batch refuses results from a node with another version. A running Ray (``ray.init``
  already called in this process) is used as it is and left running. Ray is the optional extra ``ray``
  (:data:`RAY_EXTRA`), imported only here, inside the function that uses it.

``progress(1)`` is called in this process each time a run finishes, whichever executor ran it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from btbctl import __version__
from btbctl.engine.errors import BtbctlError, ConfigError

#: How a batch ran (the ``executor`` field of a sweep's or report's ``timing``).
EXECUTORS = ("inline", "processes", "ray")
#: The install line of the optional Ray extra (``pyproject.toml``: ``ray = ["ray>=2.9"]``).
RAY_EXTRA = "pip install 'btbctl[ray]'"
#: ``ray`` value that starts a Ray instance on this machine for the batch (Ray's own name for it).
LOCAL_RAY = "local"
#: Default retries of a Ray task whose worker died or whose node went away (Ray's own default is 3).
DEFAULT_MAX_RETRIES = 3

_ADDRESS = re.compile(r"^(ray://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*)(:\d{1,5})?$")


@dataclass(frozen=True)
class Executor:
    """Where the runs of a batch go.

    Attributes:
        jobs: worker processes of the pool, or CPUs of a local Ray (>= 1; 1 without Ray runs in this process).
            None: the CPUs this process may use. Ignored for a Ray cluster given by address.
        ray: None for this machine's processes; ``"local"`` for a Ray started here; else the address of a running
            Ray cluster (``auto``, ``HOST:PORT``, ``ray://HOST:PORT``).
        max_retries: retries of a Ray task after a worker crash (>= 0).
    """

    jobs: int | None = None
    ray: str | None = None
    max_retries: int = DEFAULT_MAX_RETRIES

    def check(self) -> None:
        """Raises :class:`ConfigError` (key ``jobs``, ``ray`` or ``max_retries``) for a bad setting."""
        if self.jobs is not None and (isinstance(self.jobs, bool) or not isinstance(self.jobs, int) or self.jobs < 1):
            raise ConfigError("jobs", f"must be an integer >= 1, got {self.jobs!r}")
        if self.ray is not None and not valid_ray_address(self.ray):
            raise ConfigError(
                "ray",
                f"{self.ray!r} is not a Ray address; valid: nothing (a local Ray), auto, HOST:PORT of the head "
                "node, ray://HOST:PORT (Ray Client)",
            )
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ConfigError("max_retries", f"must be an integer >= 0, got {self.max_retries!r}")


def valid_ray_address(address: str) -> bool:
    """Whether ``address`` reads as a Ray address: ``local``, ``auto``, ``HOST[:PORT]`` or ``ray://HOST[:PORT]``."""
    return address in (LOCAL_RAY, "auto") or bool(_ADDRESS.fullmatch(address))


def default_jobs() -> int:
    """CPUs this process may run on (``os.sched_getaffinity`` where available, else ``os.cpu_count()``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - platforms without affinity
        return max(1, os.cpu_count() or 1)


def require_ray() -> Any:
    """The ``ray`` module. Raises :class:`ConfigError` (key ``ray``) with the install line when it is missing."""
    try:
        import ray
    except ImportError:
        raise ConfigError("ray", f"Ray is not installed; {RAY_EXTRA}") from None
    return ray


def run_batch(
    run: Callable[[Any, Any], Any],
    shared: Any,
    tasks: Sequence[Any],
    executor: Executor | None = None,
    *,
    progress: Callable[[int], None] | None = None,
    order: Sequence[int] | None = None,
) -> tuple[list[Any], dict]:
    """Run ``run(shared, task)`` for every task.

    Args:
        run: a module-level, deterministic function.
        shared: data every run needs (picklable).
        tasks: the per-run inputs (picklable).
        executor: where the runs go (default: a process pool over the available CPUs).
        progress: called with 1 each time a run finishes.
        order: the order to start the runs in (indices into ``tasks``; default: as given), e.g. the longest first.

    Returns:
        ``(results, info)``: ``results[i]`` is task ``i``'s result; ``info`` is ``{"executor": one of
        :data:`EXECUTORS`, "jobs": workers or Ray CPUs}``.

    Raises:
        ConfigError: a bad executor setting; ``--ray`` without Ray installed.
        BtbctlError: a Ray cluster that cannot be reached, a task that failed after its retries, a node running
            another btbctl version; and whatever ``run`` raises.
    """
    executor = executor or Executor()
    executor.check()
    order = list(range(len(tasks))) if order is None else list(order)
    if sorted(order) != list(range(len(tasks))):
        raise ValueError("order must be a permutation of the task indices")
    if executor.ray is not None:
        return _run_ray(run, shared, tasks, executor, progress, order)
    jobs = min(executor.jobs or default_jobs(), len(tasks))
    results: list[Any] = [None] * len(tasks)
    if jobs <= 1:
        for i in order:
            results[i] = run(shared, tasks[i])
            if progress:
                progress(1)
        return results, {"executor": "inline", "jobs": 1}
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(max_workers=jobs, initializer=_pool_init, initargs=(run, shared)) as pool:
        futures = [pool.submit(_pool_task, (i, tasks[i])) for i in order]
        for fut in as_completed(futures):
            i, value = fut.result()
            results[i] = value
            if progress:
                progress(1)
    return results, {"executor": "processes", "jobs": jobs}


# -- process pool ----------------------------------------------------------------------------------------------------

_POOL: dict[str, Any] = {}


def _pool_init(run: Callable[[Any, Any], Any], shared: Any) -> None:
    _POOL["run"] = run
    _POOL["shared"] = shared


def _pool_task(item: tuple[int, Any]) -> tuple[int, Any]:
    i, task = item
    return i, _POOL["run"](_POOL["shared"], task)


# -- Ray -------------------------------------------------------------------------------------------------------------

#: ``shared`` of the current batch in a Ray worker process, by object id (one entry: a worker serves one batch at a
#: time, and a new batch replaces the old one).
_RAY_SHARED: dict[str, Any] = {}


def _ray_task(run: Callable[[Any, Any], Any], box: list, task: Any) -> tuple[str, Any]:
    """The body of every Ray task: ``shared`` from this process's cache (or the object store), then the run."""
    ref = box[0]
    key = ref.hex()
    if key not in _RAY_SHARED:
        import ray

        value = ray.get(ref)
        _RAY_SHARED.clear()
        _RAY_SHARED[key] = value
    return __version__, run(_RAY_SHARED[key], task)


def _run_ray(
    run: Callable[[Any, Any], Any],
    shared: Any,
    tasks: Sequence[Any],
    executor: Executor,
    progress: Callable[[int], None] | None,
    order: list[int],
) -> tuple[list[Any], dict]:
    import logging

    ray = require_ray()
    started = False
    address = executor.ray
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
        if address == LOCAL_RAY:
            kwargs["num_cpus"] = executor.jobs or default_jobs()
        try:
            ray.init(address=address, **kwargs)
        except (ConnectionError, RuntimeError, ValueError, TimeoutError) as e:
            where = "start a local Ray" if address == LOCAL_RAY else f"connect to the Ray cluster at {address}"
            raise BtbctlError(f"--ray: cannot {where}: {_one_line(e)}") from None
        started = True
    results: list[Any] = [None] * len(tasks)
    pending: list = []
    try:
        cpus = int(ray.cluster_resources().get("CPU", 0))
        box = [ray.put(shared)]
        retry = [ray.exceptions.ObjectLostError, ray.exceptions.ObjectFetchTimedOutError]
        remote = ray.remote(num_cpus=1, max_retries=executor.max_retries, retry_exceptions=retry)(_ray_task)
        index = {}
        for i in order:
            ref = remote.remote(run, box, tasks[i])
            index[ref] = i
            pending.append(ref)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            if pending:  # take every other run that finished meanwhile in the same round
                more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
                ready += more
            for ref in ready:
                i = index[ref]
                version, value = _ray_result(ray, ref, i, executor.max_retries)
                if version != __version__:
                    raise BtbctlError(
                        f"--ray: run {i} ran btbctl {version} on the cluster, this is btbctl {__version__}; "
                        "install the same version on every node"
                    )
                results[i] = value
                if progress:
                    progress(1)
    finally:
        if pending:  # after a failure: do not leave the rest running on a shared cluster
            # only the runs not finished yet: cancelling one that is finishing or being retried meanwhile has
            # crashed Ray's driver (a failed check in its task manager, Ray 2.x)
            _, running = ray.wait(pending, num_returns=len(pending), timeout=0)
            for ref in running:
                ray.cancel(ref, force=False)
        if started:
            ray.shutdown()
    return results, {"executor": "ray", "jobs": cpus}


def _ray_result(ray: Any, ref: Any, i: int, max_retries: int) -> tuple[str, Any]:
    try:
        return tuple(ray.get(ref))  # type: ignore[return-value]
    except ray.exceptions.RayTaskError as e:  # ``run`` raised: the original error, as the local executors give it
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException):
            raise cause from None
        raise BtbctlError(f"--ray: run {i} failed: {_one_line(e)}") from None
    except ray.exceptions.RayError as e:  # the worker or node died more often than max_retries
        raise BtbctlError(f"--ray: run {i} failed after {max_retries} retries: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


__all__ = [
    "DEFAULT_MAX_RETRIES",
    "EXECUTORS",
    "LOCAL_RAY",
    "RAY_EXTRA",
    "Executor",
    "default_jobs",
    "require_ray",
    "run_batch",
    "valid_ray_address",
]
