"""One emulated worker put together: its model driver, block store, copies (records, sender, receiving sink),
metrics and transfer transports, and their start and stop. The HTTP face is :mod:`btbctl.engine.worker.http`; the
process around both is :mod:`btbctl.engine.worker.server`."""

from __future__ import annotations

import logging
import math
import time

from btbctl.engine.logfmt import LineBudget, RateLimiter, log_event
from btbctl.engine.replication.tcp import FaultPlan, TcpReceiver, TcpTransport
from btbctl.engine.replication.transport import Transport
from btbctl.engine.worker.config import WorkerConfig
from btbctl.engine.worker.copies import CopyBook, CopySender, CopySink
from btbctl.engine.worker.metrics import WorkerMetrics
from btbctl.engine.worker.model import LiveRequest, ModelDriver
from btbctl.engine.worker.store import BlockStore

log = logging.getLogger("btbctl.worker")

#: Request lines a worker writes per second at most once its burst allowance is spent, and that allowance (a
#: product choice: a quiet fleet logs every request, a flood costs at most 20 lines a second; ``held=N`` on the
#: next line says how many were left out).
REQUEST_LINES_PER_S = 20.0
REQUEST_LINES_BURST = 100


class Worker:
    """State of one emulated worker.

    Args:
        cfg: settings.
        transport: the sender transport (default: TCP with the fault plan of ``BTBCTL_REPLICATION_FAULT``, tests
            only).

    Attributes: ``model`` (:class:`~btbctl.engine.worker.model.ModelDriver`), ``store``
    (:class:`~btbctl.engine.worker.store.BlockStore`), ``copies`` (:class:`~btbctl.engine.worker.copies.CopyBook`),
    ``sender`` and ``sink`` (the two sides of copies), ``receiver`` (the transfer port), ``metrics``, ``ready``
    (set by the server once both ports listen), ``http_port``, ``started_unix``, ``hicache``
    (:class:`~btbctl.engine.worker.hicache.HiCache` with ``--enable-hierarchical-cache``, else None).
    """

    def __init__(self, cfg: WorkerConfig, transport: Transport | None = None) -> None:
        self.cfg = cfg
        self.model = ModelDriver(cfg)
        self.block_bytes = cfg.block_bytes()
        self.store = BlockStore(self.block_bytes)
        self.model.on_evict.append(self.store.drop)
        self.transport = transport or TcpTransport(fault=FaultPlan.from_env())
        self.copies = CopyBook()
        self.sender = CopySender(self.copies, self.model, self.store, self.transport, self.block_bytes)
        self.sink = CopySink(self.copies, self.model, self.store, cfg.page_size)
        self.receiver = TcpReceiver(self.sink, cfg.host, cfg.transfer_port, expectations=self.sink.expected)
        self.ready = False
        self.http_port = cfg.port
        self.metrics = WorkerMetrics(cfg.served_name, hicache=cfg.enable_hierarchical_cache)
        self.refusal_limiter = RateLimiter()  # refused /btb requests: one log line per reason and interval
        self.request_lines = LineBudget(REQUEST_LINES_PER_S, REQUEST_LINES_BURST, clock=self.model.clock)
        self.started_unix = time.time()
        self.hicache = None
        #: the KV event publisher (``--kv-events-config``), else None
        self.kv_events = None
        if cfg.kv_events_config:
            from btbctl.engine.kvevents import KvEventsConfig
            from btbctl.engine.worker.kv_events import WorkerEvents

            self.kv_events = WorkerEvents(
                KvEventsConfig.from_json(cfg.kv_events_config), cfg.page_size, cfg.served_name
            )
            self.model.on_insert.append(self.kv_events.inserted)
            self.model.on_evict.append(self.kv_events.evicted)
        if cfg.enable_hierarchical_cache:
            from btbctl.engine.worker.hicache import HiCache

            self.hicache = HiCache(cfg, self.model, self.metrics)

    def log_request(self, lr: LiveRequest, details: dict | None = None) -> None:
        """One ``event=request`` line for a finished request (rid, prompt and cached tokens, where the cached ones
        came from, TTFT and end-to-end latency in wall seconds), within :attr:`request_lines`' budget."""
        ok, held = self.request_lines.allow()
        if not ok:
            return

        def secs(end: float) -> float | None:
            return None if math.isnan(end) else round(max(0.0, end - lr.arrival_wall), 4)

        log_event(
            log,
            "request",
            rid=lr.rid,
            prompt_tokens=lr.prompt_tokens,
            cached_tokens=lr.cached_tokens,
            cached_host=(details or {}).get("host") or None,
            cached_storage=(details or {}).get("storage") or None,
            output_tokens=lr.max_new_tokens,
            ttft_s=secs(lr.first_wall),
            e2e_s=secs(lr.finish_wall),
            held=held or None,
        )

    async def start(self) -> None:
        """Start the model driver and the transfer receiver (raises OSError when the port is taken)."""
        self.store.expected("0")  # loads the payload generator now rather than during the first copy
        self.model.start()
        await self.receiver.start()
        if self.kv_events is not None:
            self.kv_events.start()

    async def stop(self) -> None:
        """Stop: the transfer port closes (inbound copies are discarded), outbound copies fail, the model stops."""
        self.ready = False
        await self.receiver.close()
        await self.sender.stop()
        await self.model.stop()
        if self.hicache is not None:
            self.hicache.close()
        if self.kv_events is not None:
            await self.kv_events.close()

    @property
    def transfer_addr(self) -> str:
        """``host:port`` of the transfer port (IPv6 hosts bracketed)."""
        host = self.cfg.host
        if ":" in host:
            host = f"[{host}]"
        return f"{host}:{self.receiver.port}"


__all__ = ["Worker"]
