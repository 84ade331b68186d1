"""The dashboard's source for a running fleet: a client of its control API."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import replace
from typing import Any, Callable

from btbctl.engine.chains import SHORT_ID_CHARS
from btbctl.engine.constants import BtbConstants
from btbctl.engine.errors import BtbctlError, ConfigError
from btbctl.engine.dashboard.snapshot import (
    FleetSnapshot,
    GpuRow,
    PrefixRow,
    ReplicateResult,
    SourceError,
    TransferRow,
    TtftPoint,
    WorkerRow,
)

#: Width of one TTFT-series bucket, seconds of fleet time.
TTFT_BUCKET_S = 1.0
#: Buckets kept in the TTFT series (two minutes at 1 s).
TTFT_BUCKETS = 120
#: Finished transfers kept for the "recent" list.
RECENT_TRANSFERS = 20

# -- a running fleet ----------------------------------------------------------------------------------------------

#: First and largest wait between reconnection attempts, seconds (doubling in between). A product choice: quick
#: enough to notice a restarted fleet within seconds, slow enough not to hammer a machine that is down.
RECONNECT_MIN_S = 0.5
RECONNECT_MAX_S = 8.0
#: Per-request timeout of control-API calls, seconds.
REQUEST_TIMEOUT_S = 3.0
#: Seconds between two NVML reads (NVML's own utilisation sample period is about a second).
NVML_EVERY_S = 2.0
#: Trailing seconds of TTFT series asked from the control API.
TTFT_WINDOW_S = 120.0


def resolve_control_api(*, url: str | None = None, token: str | None = None, token_file: str | None = None,
                        run_dir: str | None = None) -> tuple[str, str | None]:
    """The control-API base URL and bearer token to use: ``url`` or the one recorded by ``btbctl up`` in the run
    directory; ``token``, else the content of ``token_file``, else the run directory's ``control.token`` (None
    when there is none: reads work, writes will be refused).

    Raises:
        BtbctlError: no ``url`` and no running fleet recorded; an unreadable ``token_file``.
    """
    from btbctl.engine.launcher.rundir import RunDir

    rd = RunDir(run_dir)
    if url is None:
        state = rd.live_state()
        if not state.control_url:
            raise BtbctlError(f"the fleet recorded in {rd.path} has no control API yet (still starting?)")
        url = state.control_url
    if token is None and token_file is not None:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise BtbctlError(f"cannot read the token file {token_file}: {e.strerror or e}") from None
    if token is None:
        try:
            token = rd.read_token()
        except BtbctlError:
            token = None
    return url.rstrip("/"), token


def _is_loopback(url: str) -> bool:
    from urllib.parse import urlsplit

    host = (urlsplit(url).hostname or "").lower()
    return host in ("localhost", "::1") or host.startswith("127.")


def _f(x: Any, default: float = 0.0) -> float:
    try:
        return default if x is None else float(x)
    except (TypeError, ValueError):
        return default


class ControlApiSource:
    """A running fleet's control API behind the :class:`DashboardSource` interface.

    Reads ``GET /control/fleet``, ``/control/prefixes?top=N``, ``/control/transfers`` and
    ``/control/ttft?window_s=`` concurrently for each snapshot; writes ``PUT /control/constants`` and
    ``POST /control/replicate`` with ``Authorization: Bearer <token>``. When the fleet cannot be reached the snapshot
    keeps the last known rows with ``connected=False`` and a message, and the next attempt waits
    :data:`RECONNECT_MIN_S` doubling up to :data:`RECONNECT_MAX_S` (attempts are not made more often, however often
    :meth:`snapshot` is called). GPUs: as the workers report them (``hbm_used_bytes``/``hbm_total_bytes`` in a
    worker row), else read through NVML when the control API is on this machine (loopback), else ``gpu_note`` says
    why there are none.

    Args:
        base_url: ``http://host:port`` of the control API.
        token: bearer token (None: writes raise :class:`SourceError`).
        top: prefixes asked for.
        nvml_module: passed to :func:`btbctl.engine.telemetry.nvml.read_gpus` (tests).
        clock: monotonic seconds (tests).
    """

    def __init__(self, base_url: str, token: str | None = None, *, top: int = 10, nvml_module: Any = None,
                 local_gpus: bool | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.top = top
        self._nvml_module = nvml_module
        self._local = _is_loopback(self.base_url) if local_gpus is None else local_gpus
        self._clock = clock
        self._session = None
        self._last: FleetSnapshot | None = None
        self._next_try = 0.0
        self._backoff = RECONNECT_MIN_S
        self._nvml = None
        self._nvml_at = -math.inf
        self._last_fleet: dict = {}
        self.failures = 0

    async def start(self) -> None:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _get(self, path: str) -> Any:
        await self.start()
        async with self._session.get(self.base_url + path) as resp:
            if resp.status != 200:
                raise SourceError(f"GET {path}: HTTP {resp.status}")
            return await resp.json()

    async def _write(self, method: str, path: str, body: dict) -> Any:
        import aiohttp

        if not self.token:
            raise SourceError("no control token: pass --token/--token-file or use the run directory of 'btbctl up'")
        await self.start()
        headers = {"Authorization": f"Bearer {self.token}"}
        try:
            async with self._session.request(method, self.base_url + path, json=body, headers=headers) as resp:
                try:
                    data = await resp.json(content_type=None)
                except ValueError:
                    data = {"error": (await resp.text()).strip()}
                if resp.status >= 300:
                    err = data.get("error", data) if isinstance(data, dict) else data
                    if isinstance(err, dict):
                        key, msg = err.get("key"), err.get("message") or err.get("error")
                    else:
                        key, msg = None, err
                    if resp.status == 400 and key:
                        text = str(msg or "refused")
                        prefix = f"{key}: "
                        raise ConfigError(str(key), text[len(prefix):] if text.startswith(prefix) else text)
                    raise SourceError(f"{method} {path}: HTTP {resp.status}: {msg}")
                return data
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise SourceError(f"{method} {path}: fleet unreachable ({type(e).__name__}: {e})") from None

    def _down(self, why: str) -> FleetSnapshot:
        self.failures += 1
        now = self._clock()
        self._next_try = now + self._backoff
        msg = f"fleet unreachable at {self.base_url}: {why}; retrying in {self._backoff:.1f} s"
        self._backoff = min(RECONNECT_MAX_S, self._backoff * 2)
        last = self._last
        if last is None:
            return FleetSnapshot(now_s=0.0, connected=False, message=msg)
        return replace(last, connected=False, message=msg)

    async def snapshot(self) -> FleetSnapshot:
        """Fetch the fleet's state (or, while it is unreachable and the backoff runs, the last one marked
        ``connected=False``)."""
        import aiohttp

        if self._last is not None and not self._last.connected and self._clock() < self._next_try:
            return self._last
        try:
            fleet, prefixes, transfers, ttft = await asyncio.gather(
                self._get("/control/fleet"), self._get(f"/control/prefixes?top={self.top}"),
                self._get("/control/transfers"), self._get(f"/control/ttft?window_s={TTFT_WINDOW_S:g}"))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, SourceError, ValueError) as e:
            why = str(e) or type(e).__name__
            self._last = self._down(why)
            return self._last
        self._last_fleet = fleet
        gpus, note = await self._gpus(fleet)
        was_down = self._last is not None and not self._last.connected
        self._backoff = RECONNECT_MIN_S
        snap = self._parse(fleet, prefixes, transfers, ttft, gpus, note)
        if was_down:
            snap = replace(snap, message=f"reconnected to {self.base_url}")
        self._last = snap
        return snap

    async def _gpus(self, fleet: dict) -> tuple[tuple[GpuRow, ...], str | None]:
        rows = []
        for w in fleet.get("workers", []):
            if w.get("hbm_total_bytes"):
                rows.append(GpuRow(str(w.get("name")), _f(w.get("hbm_used_bytes")), _f(w.get("hbm_total_bytes")),
                                   w.get("gpu_util_pct"), "worker"))
        if rows:
            return tuple(rows), None
        if not self._local:
            return (), "NVML unavailable: the fleet is not on this machine and its workers report no HBM"
        now = self._clock()
        if self._nvml is None or now - self._nvml_at >= NVML_EVERY_S:
            from btbctl.engine.telemetry.nvml import read_gpus

            self._nvml = await asyncio.to_thread(read_gpus, self._nvml_module)
            self._nvml_at = now
        res = self._nvml
        if not res.available:
            return (), f"NVML unavailable: {res.reason}"
        return tuple(GpuRow(f"gpu{g.index}", g.used_bytes, g.total_bytes, g.util_pct, "nvml") for g in res.gpus), None

    def _parse(self, fleet: dict, prefixes: dict, transfers: dict, ttft: Any, gpus, note) -> FleetSnapshot:
        names = {}
        workers = []
        for w in fleet.get("workers", []):
            name = str(w.get("name"))
            names[w.get("url")] = name
            workers.append(WorkerRow(
                name, bool(w.get("healthy")), int(w.get("running") or 0), int(w.get("waiting") or 0),
                None if w.get("kv_used_tokens") is None else int(w["kv_used_tokens"]),
                None if w.get("kv_capacity_tokens") is None else int(w["kv_capacity_tokens"]),
                w.get("error")))
        prows = []
        for p in prefixes.get("prefixes", []):
            holders = p.get("holders", 0)
            prows.append(PrefixRow(
                str(p.get("id")), int(p.get("prefix_tokens") or 0), int(p.get("arrivals_in_window") or 0),
                int(p.get("threshold") or prefixes.get("threshold") or 0),
                len(holders) if isinstance(holders, list) else int(holders or 0),
                int(p.get("copies_in_flight") or 0), bool(p.get("hot"))))
        trows = []
        for t in transfers.get("transfers", []):
            trows.append(TransferRow(
                str(t.get("copy_id")), str(t.get("prefix") or t.get("prefix_id") or ""),
                names.get(t.get("source"), str(t.get("source"))), names.get(t.get("target"), str(t.get("target"))),
                _f(t.get("bytes_sent")), _f(t.get("bytes_total")), _f(t.get("bytes_per_s")),
                None if t.get("eta_s") is None else _f(t.get("eta_s")), str(t.get("state")), t.get("error")))
        series = ttft.get("series", ttft.get("points", [])) if isinstance(ttft, dict) else ttft
        pts = tuple(TtftPoint(_f(r.get("t_s", r.get("t"))), _f(r.get("p50_s", r.get("p50")), math.nan),
                              _f(r.get("p95_s", r.get("p95")), math.nan), _f(r.get("rps")))
                    for r in series or ())
        healthy = sum(1 for w in workers if w.healthy)
        msg = f"fleet {self.base_url}: {healthy}/{len(workers)} workers healthy"
        return FleetSnapshot(
            now_s=_f(fleet.get("now_s")), connected=True, message=msg, workers=tuple(workers), gpus=gpus,
            gpu_note=note, prefixes=tuple(prows), transfers=tuple(trows), ttft=pts,
            constants=dict(fleet.get("constants") or {}), policy=str(fleet.get("policy") or ""),
            rps=pts[-1].rps if pts else 0.0)

    async def set_constants(self, **changes: Any) -> dict:
        """``PUT /control/constants`` with ``changes`` (validated here first); returns the four constants the
        fleet confirms. Raises :class:`ConfigError` (the key it refuses) or :class:`SourceError`."""
        current = self._last.constants if self._last is not None and self._last.constants else None
        (BtbConstants(**current) if current else BtbConstants()).with_updates(**changes)
        data = await self._write("PUT", "/control/constants", changes)
        confirmed = data.get("constants", data) if isinstance(data, dict) else {}
        out = {k: confirmed[k] for k in BtbConstants().as_dict() if k in confirmed}
        if self._last is not None:
            self._last = replace(self._last, constants={**self._last.constants, **out})
        return out

    async def set_policy(self, name: str) -> str:
        """``PUT /control/constants`` with ``{"policy": name}``; returns the policy in force."""
        data = await self._write("PUT", "/control/constants", {"policy": name})
        return str(data.get("policy", name)) if isinstance(data, dict) else name

    async def replicate(self, prefix_id: str, n: int) -> ReplicateResult:
        """``POST /control/replicate {"prefix", "n"}``."""
        if not isinstance(n, int) or n < 1:
            raise ConfigError("n", f"must be an integer >= 1, got {n!r}")
        data = await self._write("POST", "/control/replicate", {"prefix": prefix_id, "n": n})
        data = data if isinstance(data, dict) else {}
        names = {}
        if self._last is not None:
            names = {w.get("url"): w.get("name") for w in self._last_fleet.get("workers", [])}
        ids = tuple(str(c) for c in data.get("copy_ids", [c.get("copy_id") for c in data.get("copies", [])]))
        targets = tuple(names.get(t, str(t)) for t in data.get("targets", []))
        source = names.get(data.get("source"), str(data.get("source", "")))
        full = str(data.get("prefix", prefix_id))
        msg = f"copying {full[:SHORT_ID_CHARS]} from {source} to {', '.join(targets) or '-'}"
        return ReplicateResult(full, ids, source, targets, msg)

