"""The gateway process: fleet state, policy, detector, planner, health checks, and the two listeners.

Start it in-process with ``gw = await serve_gateway(config)`` (returns once both listeners accept connections;
``gw.data_url`` and ``gw.control_url`` say where) and stop it with ``await gw.stop()``; or block with
``run_gateway(config)`` until SIGINT/SIGTERM.

Startup: every worker is probed once (``/health``, ``/btb/info``, ``/v1/loads``) before listening, so the first
request already sees which workers are up; the page size is taken from the workers' ``/btb/info`` unless
configured; then a health checker probes every worker every ``health_interval_s``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import random
import secrets
import signal
from typing import Any, Callable

import aiohttp
from aiohttp import web

from btbctl.engine.aiotasks import cancel_and_wait
from btbctl.engine.constants import BtbConstants
from btbctl.engine.detector import BurstDetector
from btbctl.engine.errors import ConfigError
from btbctl.engine.gateway.config import GatewayConfig
from btbctl.engine.gateway.metrics import GatewayMetrics
from btbctl.engine.gateway.planner import Planner
from btbctl.engine.gateway.state import Clock, EventBus, FleetState, Transfer, WorkerState
from btbctl.engine.policies import POLICIES, make_policy
from btbctl.engine.policies.base import ExcludingView, Policy
from btbctl.engine.policies.cache_aware import CacheAware
from btbctl.engine.trace.model import Request

log = logging.getLogger(__name__)

#: Page size when neither the config nor any worker's ``/btb/info`` gives one: BTB's 256-token block
#: (REFERENCE.md s1).
DEFAULT_PAGE_SIZE = 256
#: Keys ``PUT /control/constants`` accepts besides the four constants.
POLICY_KEY = "policy"


def load_token(config: GatewayConfig) -> str:
    """The control API's bearer token: ``config.token``; else the content of ``config.token_file`` (created with
    mode 0600 and a fresh 32-byte random token when missing); else a fresh random token kept in memory.

    Raises:
        ConfigError: the token file exists but is empty or unreadable.
    """
    if config.token:
        return config.token
    if config.token_file:
        return _read_or_create_token(config.token_file, "token_file")
    return secrets.token_urlsafe(32)


def _read_or_create_token(path: str, key: str) -> str:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        try:
            with open(path, encoding="utf-8") as f:
                tok = f.read().strip()
        except OSError as e:
            raise ConfigError(key, f"cannot read {path}: {e.strerror}") from None
        if not tok:
            raise ConfigError(key, f"{path} is empty")
        return tok
    except OSError as e:
        raise ConfigError(key, f"cannot create {path}: {e.strerror}") from None
    tok = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(tok + "\n")
    return tok


def _tree_holder(p: Policy) -> Any:
    """The object carrying a cache-aware prefix tree in ``p`` (itself or BTB's fallback), or None."""
    if isinstance(p, CacheAware):
        return p
    fb = getattr(p, "fallback", None)
    return fb if isinstance(fb, CacheAware) else None


def summarize_loads(body: Any) -> dict | None:
    """Sum SGLang's ``/v1/loads`` answer over ranks: ``{"running", "waiting", "used_tokens", "max_tokens",
    "token_usage"}`` (token_usage = used / max, or the reported one). Accepts a list of per-rank objects, an object
    with such a list under ``loads`` or ``ranks``, or one per-rank object; None when nothing fits."""
    ranks: list
    if isinstance(body, list):
        ranks = body
    elif isinstance(body, dict):
        inner = body.get("loads", body.get("ranks"))
        ranks = inner if isinstance(inner, list) else [body]
    else:
        return None
    out = {"running": 0, "waiting": 0, "used_tokens": 0, "max_tokens": 0}
    usage = []
    seen = False
    for r in ranks:
        if not isinstance(r, dict):
            continue
        for src, dst in (("num_running_reqs", "running"), ("num_waiting_reqs", "waiting"),
                         ("num_used_tokens", "used_tokens"), ("max_total_num_tokens", "max_tokens")):
            v = r.get(src)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[dst] += int(v)
                seen = True
        u = r.get("token_usage")
        if isinstance(u, (int, float)) and not isinstance(u, bool):
            usage.append(float(u))
    if not seen and not usage:
        return None
    if out["max_tokens"] > 0:
        out["token_usage"] = out["used_tokens"] / out["max_tokens"]
    else:
        out["token_usage"] = sum(usage) / len(usage) if usage else None
    return out


class Gateway:
    """A running gateway (build with :func:`serve_gateway`).

    Attributes:
        config: the settings.
        state: live :class:`~btbctl.engine.gateway.state.FleetState` (also the policies' view).
        policy: the routing policy in use (swap with :meth:`set_policy`).
        detector: the burst detector, shared with BTB-style policies and kept across policy swaps.
        planner: the replication planner.
        metrics: Prometheus metrics.
        bus: the control API's event bus.
        token: the control API's bearer token.
        page_size: tokens per block of the chains.
        data_url / control_url: ``http://host:port`` of the listeners (after start).
    """

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.clock = Clock()
        self.state = FleetState(config.workers, self.clock)
        self.constants: BtbConstants = config.constants
        self.detector = BurstDetector(self.constants)
        self.rng = random.Random(config.seed)
        self.policy: Policy = make_policy(config.policy, len(config.workers), self.rng, self.constants)
        self._feeds_detector = False
        self.page_size = config.page_size or DEFAULT_PAGE_SIZE
        self._page_size_fixed = config.page_size is not None
        self.token = load_token(config)
        wt = config.worker_token
        if wt is None and config.worker_token_file:
            wt = _read_or_create_token(config.worker_token_file, "worker_token_file")
        self.worker_token = wt
        self.metrics = GatewayMetrics(lambda: self.detector.stats()["fires"])
        self.bus = EventBus()
        self._session: aiohttp.ClientSession | None = None
        self.planner = Planner(self.state, lambda: self._session, worker_token=wt,
                               poll_interval_s=config.poll_interval_s, source_wait_s=config.source_wait_s,
                               copy_timeout_s=config.copy_timeout_s, on_change=self._transfer_changed,
                               on_finish=self._transfer_finished)
        self._runners: list[web.AppRunner] = []
        self._health_task: asyncio.Task | None = None
        self._probe_timeout = aiohttp.ClientTimeout(total=config.health_timeout_s)
        self.data_url = ""
        self.control_url = ""
        self._stopped = False
        self.request_seq = 0

    # -- policy and constants -----------------------------------------------------------------------------------

    def _install_policy(self, new: Policy, old: Policy | None) -> None:
        new.configure(block_tokens=self.page_size)
        if hasattr(new, "detector"):
            new.detector = self.detector  # one detector for the gateway's life: heat survives swaps
        if old is not None:
            src, dst = _tree_holder(old), _tree_holder(new)
            if src is not None and dst is not None:
                dst.tree = src.tree  # keep the cache-aware affinity learned so far
        self.policy = new
        self._feeds_detector = not hasattr(new, "detector")

    def set_policy(self, name: str) -> None:
        """Swap the routing policy now (next request). The detector, the holding record, loads and transfers are
        gateway state and stay; a cache-aware prefix tree moves to the new policy when both have one.

        Raises:
            ConfigError: unknown name (key ``policy``; the message lists the valid ones).
        """
        if name == self.policy.name:
            return
        new = make_policy(name, self.state.n_replicas, self.rng, self.constants)
        self._install_policy(new, self.policy)
        self.bus.mark("constants")

    def set_constants(self, updates: dict) -> BtbConstants:
        """Apply a partial update of the four constants live (next request).

        Raises:
            ConfigError: unknown key or invalid value (the key is named).
        """
        new = self.constants.with_updates(**updates)
        self.constants = new
        self.policy.set_constants(new)
        self.detector.set_constants(new)  # no-op when the policy already retuned it
        self.bus.mark("constants")
        self.bus.mark("prefixes")
        return new

    def constants_report(self) -> dict:
        """``{"policy", "policies": [names], "constants": {prefix_blocks, threshold, window_s, warm_replicas},
        "page_size", "prefix_tokens"}``."""
        c = self.constants
        return {"policy": self.policy.name, "policies": list(POLICIES), "constants": c.as_dict(),
                "page_size": self.page_size, "prefix_tokens": c.prefix_blocks * self.page_size}

    # -- routing ------------------------------------------------------------------------------------------------

    def choose(self, req: Request, excluded: list[int]) -> int | None:
        """The worker for ``req``: the policy's choice, unless that worker is unavailable (unhealthy or in
        ``excluded``), in which case the least-loaded available one (ties: lowest index). None when no worker is
        available. The route's copy plans go to the replicator (never to or from an excluded worker). Feeds the
        detector when the policy does not (once per request: not again on a retry; a BTB-style policy observes the
        arrival again when asked again, a rare double count after a failure)."""
        state = self.state
        now = self.clock()
        if self._feeds_detector and not excluded:
            self.detector.observe(req.block_hashes, now)
        view = ExcludingView(state, excluded) if excluded else state
        policy = self.policy
        route = policy.route(req, view, now)
        for plan in route.copies:
            self.planner.execute(plan, policy, excluded)
        idx = route.replica
        ws = state.workers
        if 0 <= idx < len(ws) and ws[idx].healthy and idx not in excluded:
            return idx
        best = None
        for w in ws:
            if w.healthy and w.index not in excluded and (best is None or w.inflight < best.inflight):
                best = w
        return None if best is None else best.index

    def worker_failed(self, idx: int, reason: str) -> None:
        """A forwarded request failed on worker ``idx`` (connection error or 5xx): mark it unhealthy now."""
        w = self.state.workers[idx]
        w.failed += 1
        self._mark_unhealthy(w, reason)

    def _mark_unhealthy(self, w: WorkerState, reason: str) -> None:
        w.health_error = reason
        if w.healthy:
            w.healthy = False
            w.forget()
            self.metrics.healthy.labels(w.url).set(0)
            log.warning("worker %s marked unhealthy: %s", w.url, reason)
        self.bus.mark("fleet")

    # -- transfers ----------------------------------------------------------------------------------------------

    def _transfer_changed(self, t: Transfer) -> None:
        self.bus.mark("transfers")

    def _transfer_finished(self, t: Transfer) -> None:
        self.metrics.replications.labels(t.state).inc()
        if t.state == "done":
            self.metrics.replicated_bytes.inc(t.bytes_sent)
        self.bus.mark("prefixes")
        self.bus.mark("fleet")

    # -- health -------------------------------------------------------------------------------------------------

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "gateway not started"
        return self._session

    async def _get_json(self, url: str) -> tuple[int, Any]:
        async with self.session.get(url, timeout=self._probe_timeout) as resp:
            if resp.status != 200:
                return resp.status, None
            try:
                return 200, await resp.json(content_type=None)
            except ValueError:
                return 200, None

    async def probe(self, w: WorkerState) -> None:
        """One health round for ``w``: ``/health``; on a worker coming (back) up also ``/btb/info``; then
        ``/v1/loads``. Updates ``w`` and publishes a fleet event."""
        now = self.clock()
        try:
            async with self.session.get(f"{w.url}/health", timeout=self._probe_timeout) as resp:
                ok = 200 <= resp.status < 300
                reason = None if ok else f"/health answered HTTP {resp.status}"
                await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            ok, reason = False, f"/health failed: {type(e).__name__}: {e}" if str(e) else \
                f"/health failed: {type(e).__name__}"
        w.last_health_s = now
        if not ok:
            w.consecutive_failures += 1
            if w.consecutive_failures >= self.config.unhealthy_after or not w.healthy:
                self._mark_unhealthy(w, reason or "health check failed")
            return
        w.consecutive_failures = 0
        if not w.healthy or w.btb is None:
            await self._probe_info(w)
            w.forget()  # a worker coming back may have restarted with an empty cache
            if not w.healthy:
                log.info("worker %s healthy", w.url)
            w.healthy = True
            w.health_error = None
            self.metrics.healthy.labels(w.url).set(1)
        try:
            status, body = await self._get_json(f"{w.url}/v1/loads")
            w.loads = summarize_loads(body) if status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            w.loads = None
        self.bus.mark("fleet")

    async def _probe_info(self, w: WorkerState) -> None:
        try:
            status, body = await self._get_json(f"{w.url}/btb/info")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return
        if status == 200 and isinstance(body, dict):
            w.info = body
            w.btb = True
            self.state._cost = None  # the replica cost model may now come from this worker's presets
            ps = body.get("page_size")
            if isinstance(ps, int) and ps != self.page_size and self._page_size_fixed:
                w.btb = False
                w.info = dict(body, note=f"page_size {ps} differs from the gateway's {self.page_size}; "
                                         "no replication to or from it")
            cap = body.get("capacity_tokens")
            if isinstance(cap, int) and cap > 0:
                w.capacity_blocks = max(1, cap // self.page_size)
        elif status in (404, 405):
            w.btb = False
            w.info = None

    async def _health_loop(self) -> None:
        interval = self.config.health_interval_s
        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(*(self.probe(w) for w in self.state.workers), return_exceptions=True)

    # -- lifecycle ----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Probe the workers, settle the page size and the policy, start the health checker and both listeners.

        Raises:
            ConfigError: a listen address/port that cannot be bound (key ``port`` or ``control_port``).
        """
        from btbctl.engine.gateway.app import build_data_app
        from btbctl.engine.gateway.control import build_control_app

        cfg = self.config
        connector = aiohttp.TCPConnector(limit=cfg.max_connections, limit_per_host=0,
                                         keepalive_timeout=cfg.keepalive_timeout_s, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=cfg.upstream_timeout_s, sock_connect=cfg.connect_timeout_s))
        await asyncio.gather(*(self.probe(w) for w in self.state.workers), return_exceptions=True)
        if not self._page_size_fixed:
            sizes = [w.info.get("page_size") for w in self.state.workers if w.info]
            sizes = [s for s in sizes if isinstance(s, int) and s >= 1]
            if sizes:
                self.page_size = sizes[0]
                for w in self.state.workers:
                    ps = (w.info or {}).get("page_size")
                    if w.btb and isinstance(ps, int) and ps != self.page_size:
                        w.btb = False
                        w.info = dict(w.info, note=f"page_size {ps} differs from the gateway's {self.page_size}; "
                                                   "no replication to or from it")
                    cap = (w.info or {}).get("capacity_tokens")
                    if isinstance(cap, int) and cap > 0:
                        w.capacity_blocks = max(1, cap // self.page_size)
            self._page_size_fixed = True
        self.state.page_size = self.page_size
        self._install_policy(self.policy, None)
        self.bus.register("fleet", lambda: fleet_report(self))
        self.bus.register("prefixes", lambda: prefixes_report(self, 10))
        self.bus.register("transfers", lambda: transfers_report(self, 50))
        self.bus.register("ttft", lambda: ttft_event(self))
        self.bus.register("constants", self.constants_report)
        self.bus.start()
        self._health_task = asyncio.get_running_loop().create_task(self._health_loop())
        data = build_data_app(self)
        control = build_control_app(self)
        try:
            self.data_url = await self._listen(data, cfg.host, cfg.port, "port", cfg.access_log)
            self.control_url = await self._listen(control, cfg.control_host, cfg.control_port, "control_port",
                                                  False)
        except BaseException:
            await self.stop()
            raise

    async def _listen(self, app: web.Application, host: str, port: int, key: str, access_log: bool) -> str:
        runner = web.AppRunner(app, access_log=logging.getLogger("aiohttp.access") if access_log else None,
                               shutdown_timeout=1.0)
        await runner.setup()
        self._runners.append(runner)
        site = web.TCPSite(runner, host, port, backlog=1024, reuse_address=True)
        try:
            await site.start()
        except OSError as e:
            raise ConfigError(key, f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        bound = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{bound}"

    async def stop(self) -> None:
        """Stop listening, cancel copy jobs and health checks, close connections. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.bus.close()
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
        await cancel_and_wait(self._health_task)
        await self.planner.close()
        await self.bus.stop()
        if self._session is not None:
            await self._session.close()

    def check_token(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header carries the bearer token (constant-time comparison)."""
        if not header or not header.startswith("Bearer "):
            return False
        return hmac.compare_digest(header[7:].strip().encode(), self.token.encode())


# -- reports shared by the control API and the event stream -----------------------------------------------------


def worker_row(gw: Gateway, w: WorkerState) -> dict:
    """One worker of ``GET /control/fleet``."""
    loads = w.loads or {}
    info = w.info or {}
    return {
        "name": w.name, "url": w.url, "healthy": w.healthy, "error": w.health_error,
        "load": w.inflight, "prefilling": w.prefilling, "served": w.served, "failed": w.failed,
        "running": loads.get("running"), "waiting": loads.get("waiting"),
        "kv_used_tokens": loads.get("used_tokens"), "kv_capacity_tokens": loads.get("max_tokens"),
        "kv_use": loads.get("token_usage"),
        "replication": w.btb is True, "replication_note": info.get("note") or w.replication_note,
        "held_blocks": len(w.holdings),
        "model": info.get("model"), "gpu": info.get("gpu"), "tp_size": info.get("tp_size"),
        "page_size": info.get("page_size"), "transfer_addr": info.get("transfer_addr"),
        "last_health_s": w.last_health_s, "ttft_ewma_s": w.ttft_ewma_s,
    }


def fleet_report(gw: Gateway) -> dict:
    """``GET /control/fleet``: ``{"now_s", "policy", "page_size", "constants", "healthy", "total",
    "replication", "workers": [worker_row...]}``; ``replication`` is a sentence saying on how many workers copies
    are possible."""
    ws = gw.state.workers
    n_btb = sum(1 for w in ws if w.btb is True)
    if n_btb == len(ws):
        note = "supported on all workers"
    elif n_btb == 0:
        note = "unsupported: no worker has the /btb routes (plain SGLang); routing only"
    else:
        note = f"supported on {n_btb} of {len(ws)} workers"
    return {"now_s": gw.clock(), "policy": gw.policy.name, "page_size": gw.page_size,
            "constants": gw.constants.as_dict(), "healthy": sum(1 for w in ws if w.healthy), "total": len(ws),
            "replication": note, "workers": [worker_row(gw, w) for w in ws]}


def prefixes_report(gw: Gateway, top: int) -> dict:
    """``GET /control/prefixes``: ``{"now_s", "window_s", "threshold", "prefix_blocks", "prefix_tokens",
    "page_size", "prefixes": [{"id", "prefix_blocks", "prefix_tokens", "arrivals_in_window", "total_arrivals",
    "threshold", "hot", "fires", "first_seen_s", "last_seen_s", "holders" [URL], "copies_in_flight"}]}`` for the
    ``top`` prefixes by arrivals in the window."""
    now = gw.clock()
    c = gw.constants
    ws = gw.state.workers
    active = gw.state.transfers.active
    rows = []
    for h in gw.detector.heat(now, top):
        rows.append({
            "id": h.key, "prefix_blocks": h.prefix_blocks, "prefix_tokens": h.prefix_blocks * gw.page_size,
            "arrivals_in_window": h.arrivals_in_window, "total_arrivals": h.total_arrivals,
            "threshold": c.threshold, "hot": h.hot, "fires": h.fires,
            "first_seen_s": h.first_seen_s, "last_seen_s": h.last_seen_s,
            "holders": [ws[i].url for i in gw.state.holders(h.key)],
            "copies_in_flight": sum(1 for (_, k) in active if k == h.key),
        })
    return {"now_s": now, "window_s": c.window_s, "threshold": c.threshold, "prefix_blocks": c.prefix_blocks,
            "prefix_tokens": c.prefix_blocks * gw.page_size, "page_size": gw.page_size, "prefixes": rows}


def transfer_row(gw: Gateway, t: Transfer, now: float) -> dict:
    """One copy of ``GET /control/transfers``: ``{"copy_id", "prefix" (id), "prefix_blocks", "source", "target"
    (URLs), "state" (``stalled`` | ``running`` | ``done`` | ``failed``), "bytes_sent", "bytes_total",
    "blocks_verified", "bytes_per_s" (average since sending started), "eta_s" (null when unknown), "error",
    "created_s", "started_s", "finished_s", "manual"}``."""
    ws = gw.state.workers
    return {"copy_id": t.copy_id, "prefix": t.key, "prefix_blocks": len(t.chain), "source": ws[t.source].url,
            "target": ws[t.target].url, "state": t.state, "bytes_sent": t.bytes_sent, "bytes_total": t.bytes_total,
            "blocks_verified": t.blocks_verified, "bytes_per_s": t.bytes_per_s(now), "eta_s": t.eta_s(now),
            "error": t.error, "created_s": t.created_s, "started_s": t.started_s, "finished_s": t.finished_s,
            "manual": t.manual}


def transfers_report(gw: Gateway, limit: int) -> dict:
    """``GET /control/transfers``: ``{"now_s", "in_flight", "transfers": [transfer_row...] (in flight first,
    then the most recent finished), "totals": {"done", "failed", "bytes"}}``."""
    now = gw.clock()
    tt = gw.state.transfers
    rows = [transfer_row(gw, t, now) for t in tt.all()[:limit]]
    done = [t for t in tt.recent if t.state == "done"]
    return {"now_s": now, "in_flight": len(tt.active), "transfers": rows,
            "totals": {"done": len(done), "failed": sum(1 for t in tt.recent if t.state == "failed"),
                       "bytes": sum(t.bytes_sent for t in done)}}


def ttft_event(gw: Gateway) -> dict:
    """The ``ttft`` event: ``{"now_s", "last_10s": summary, "point": {"t_s", "n", "p50_s", "p95_s", "rps"}}``
    (the point is the latest 1-second bucket)."""
    now = gw.clock()
    series = gw.state.ttft.series(now, 1.0, 1.0)
    return {"now_s": now, "last_10s": gw.state.ttft.summary(now, 10.0), "point": series[-1]}


# -- entry points -----------------------------------------------------------------------------------------------


async def serve_gateway(config: GatewayConfig) -> Gateway:
    """Start a gateway in the running event loop and return it once both listeners accept connections.

    Raises:
        ConfigError: bad token file or a port that cannot be bound.
    """
    gw = Gateway(config)
    await gw.start()
    return gw


def run_gateway(config: GatewayConfig, on_ready: Callable[[Gateway], None] | None = None) -> None:
    """Run a gateway until SIGINT or SIGTERM (blocking). ``on_ready`` is called once it listens."""

    async def main() -> None:
        gw = await serve_gateway(config)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # pragma: no cover - non-main thread / platform
                pass
        try:
            if on_ready is not None:
                on_ready(gw)
            await stop.wait()
        finally:
            await gw.stop()

    asyncio.run(main())
