"""The ``/btb/*`` replication routes of the worker's HTTP API: what the worker holds (match, prefixes, info), the
authenticated copy orders (push a prefix to a target, expect an inbound copy) and the copies' records (list, one,
long poll). Shapes in ``docs/emulated-worker.md``."""

from __future__ import annotations

import asyncio
import uuid

from aiohttp import web

from btbctl.engine.hashing import PSEUDO_TOKENIZER
from btbctl.engine.replication.auth import AuthError
from btbctl.engine.replication.transport import TransferError, check_copy_id, parse_address
from btbctl.engine.worker.copies import MAX_OUTBOUND_COPIES
from btbctl.engine.worker.http.base import Routes
from btbctl.engine.worker.http.errors import ApiError
from btbctl.engine.worker.http.parse import chain_field, json_body

#: Longest ``/btb/push`` waits for the target to accept the copy before answering 202, seconds (the target then
#: counts the blocks as arriving, so a request routed there right after the push waits for them). A product
#: choice: loopback and LAN handshakes take milliseconds.
PUSH_ACCEPT_WAIT_S = 2.0
#: Longest wait of a long poll ``GET /btb/copies/{id}?wait_s=``, seconds.
MAX_COPY_POLL_WAIT_S = 10.0


class BtbRoutes(Routes):
    """``/btb/match``, ``/btb/prefixes``, ``/btb/info``, ``/btb/push``, ``/btb/expect``, ``/btb/copies``,
    ``/btb/copies/{copy_id}``."""

    async def btb_match(self, request: web.Request) -> web.Response:
        chain = chain_field(await json_body(request))
        cached = self.model.cached_blocks(chain)
        pending = max(self.model.planned_blocks(chain), self.w.copies.inbound_pending(chain), cached)
        return web.json_response({"cached_blocks": cached, "pending_blocks": pending})

    async def btb_prefixes(self, request: web.Request) -> web.Response:
        raw = request.query.get("limit", "20")
        if not raw.isdigit() or not 1 <= int(raw) <= 10000:
            raise ApiError(400, "limit must be an integer in [1, 10000]")
        return web.json_response({"prefixes": self.model.prefixes(int(raw))})

    async def btb_info(self, request: web.Request) -> web.Response:
        c = self.cfg
        addr = self.w.transfer_addr
        if c.host in ("0.0.0.0", "::", "") and request.url.host:
            # bound to every interface: advertise the address this client reached us on
            h = request.url.host
            addr = f"[{h}]:{self.w.receiver.port}" if ":" in h else f"{h}:{self.w.receiver.port}"
        return web.json_response(
            {
                "transfer_addr": addr,
                "page_size": c.page_size,
                "kv_bytes_per_token": self.model.cost.model.kv_bytes_per_token,
                "block_bytes": self.w.block_bytes,
                "model": c.served_name,
                "model_preset": c.preset_name(),
                "gpu": c.gpu,
                "tp_size": c.tp_size,
                "capacity_tokens": self.model.capacity_tokens,
                "kv_bytes_scale": c.kv_bytes_scale,
                "weight_bytes": self.model.cost.model.weight_bytes,
                "hbm_total_bytes": self.model.cost.hbm_bytes,
                "transport": self.w.transport.name,
                "time_scale": c.time_scale,
                "zero_delay": c.zero,
                "tokenizer": PSEUDO_TOKENIZER,
            }
        )

    async def btb_push(self, request: web.Request) -> web.Response:
        self.auth(request)
        body = await json_body(request)
        chain = chain_field(body)
        if not chain:
            raise ApiError(400, "chain must not be empty")
        target = body.get("target")
        if not isinstance(target, str):
            raise ApiError(400, "missing field 'target' (host:port of the target's transfer port)")
        try:
            parse_address(target)
            copy_id = check_copy_id(body["copy_id"]) if body.get("copy_id") is not None else uuid.uuid4().hex
        except TransferError as e:
            raise ApiError(400, str(e)) from None
        if target == self.w.transfer_addr:
            raise ApiError(400, "target is this worker's own transfer port")
        old = self.w.copies.get(copy_id, "source")
        if old is not None and old.in_flight:
            raise ApiError(409, f"copy {copy_id} is already in progress")
        if self.w.copies.outbound_in_flight() >= MAX_OUTBOUND_COPIES:
            raise ApiError(429, f"{MAX_OUTBOUND_COPIES} copies are already being sent; retry later")
        have = self.model.cached_blocks(chain)
        if have < len(chain):
            planned = self.model.planned_blocks(chain)
            if planned < len(chain):
                raise ApiError(
                    409,
                    f"this worker holds {have} of the chain's {len(chain)} blocks and computes {planned - have} more",
                )
        token = body.get("token")
        if token is not None and not isinstance(token, str):
            raise ApiError(400, "token must be a string (the copy's token from the gateway)")
        rec, accepted = self.w.sender.start_push(chain, target, copy_id, token)
        try:
            await asyncio.wait_for(asyncio.shield(accepted), PUSH_ACCEPT_WAIT_S)
        except asyncio.TimeoutError:
            pass  # answered anyway; the record tells how the copy goes
        return web.json_response(
            {
                "copy_id": rec.copy_id,
                "blocks": rec.blocks,
                "bytes": rec.bytes_total,
                "blocks_available": rec.blocks_available,
            },
            status=202,
        )

    async def btb_expect(self, request: web.Request) -> web.Response:
        """Authorize one inbound copy (the gateway's call; see :mod:`btbctl.engine.replication.auth`)."""
        self.auth(request)
        body = await json_body(request)
        chain = chain_field(body)
        try:
            exp = self.w.sink.expect(body.get("copy_id"), chain, body.get("token"), body.get("ttl_s"))
        except AuthError as e:
            raise ApiError(e.status, str(e)) from None
        return web.json_response({"copy_id": exp.copy_id, "blocks": len(exp.chain)}, status=201)

    async def btb_copies(self, request: web.Request) -> web.Response:
        return web.json_response({"copies": [r.as_dict() for r in self.w.copies.newest_first()]})

    async def btb_copy(self, request: web.Request) -> web.Response:
        cid = request.match_info["copy_id"]
        raw = request.query.get("wait_s")
        wait_s = 0.0
        if raw is not None:
            try:
                wait_s = float(raw)
            except ValueError:
                wait_s = -1.0
            if not 0.0 <= wait_s <= MAX_COPY_POLL_WAIT_S:
                raise ApiError(400, f"wait_s must be a number of seconds in [0, {MAX_COPY_POLL_WAIT_S:g}]")
        since = request.query.get("since")
        for role in ("source", "target"):
            rec = self.w.copies.get(cid, role)
            if rec is not None:
                headers = {}
                if wait_s > 0:
                    # long poll: answer at the next change of any copy (progress, outcome) after version
                    # ``since`` (at once when there was one already), or after wait_s
                    if rec.in_flight and since == str(self.w.copies.version):
                        await self.w.copies.wait_change(wait_s)
                    headers = {"X-BTB-Long-Poll": "1", "X-BTB-Copy-Version": str(self.w.copies.version)}
                return web.json_response(rec.as_dict(), headers=headers)
        raise ApiError(404, f"no copy {cid!r} on this worker")


__all__ = ["MAX_COPY_POLL_WAIT_S", "PUSH_ACCEPT_WAIT_S", "BtbRoutes"]
