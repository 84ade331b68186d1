"""Several gateways, one fleet: burst detection, copy orders and tuning shared through Redis
(``[gateway] redis_url``).

Every gateway of the fleet connects to the same Redis and uses the same key prefix (``redis_prefix``). Three things
are shared, none of them on a request's decision path (which never waits for Redis):

* **Arrivals.** Each local arrival of a tracked prefix (its key and arrival count) is queued; a flusher sends what
  queued meanwhile as one ``PUBLISH <prefix>:arrivals`` (one round trip per batch, so at most one per arrival).
  Every other gateway folds them into its own detector
  (:meth:`~btbctl.engine.detector.BurstDetector.fold`) when they come, stamped with its own clock; its next local
  arrival of the prefix then fires as it would had it seen them all. A burst split over two gateways thus fires
  on the first arrival after the fleet's ``threshold``-th, as long as the news travels faster than the arrivals.
* **Copy orders.** Before a copy job starts, the gateway claims ``(prefix key, target URL)`` with
  ``SET <prefix>:copy:<key>:<target> NX PX <ttl>``. The winner announces it on ``<prefix>:copies`` (the others record
  it as in flight, so their policies count it as arriving), runs the copy and, at its end, publishes the outcome
  on ``<prefix>:copies`` (and keeps the claim, marked ``done``, a short while for gateways that ask later;
  a failed copy drops the claim so the copy may be ordered again). A gateway that lost the claim keeps its copy
  record in flight (``ordered_by`` names the winner) until the outcome comes, and records the target as holding
  the prefix only when it was done. A ``done`` outcome also makes every other gateway record the target as holding.
* **Tuning.** A confirmed ``PUT /control/constants`` publishes the constants and policy on ``<prefix>:tune``; the
  other gateways apply them (one log line each with the old and new values).

A gateway that cannot reach Redis (down at start, or lost later) works alone: it detects with its own arrivals and
runs its copies unclaimed. It says so in one ``fleet_share_down`` line per transition and reconnects every
``retry_s``; ``fleet_share_up`` when it is back. Messages are JSON objects with the sender's ``gw`` id; a
gateway ignores its own.

Redis (``redis.asyncio``, redis-py >= 5) is imported here only, when the gateway has a ``redis_url``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from btbctl.engine.logfmt import log_event

log = logging.getLogger(__name__)

#: Seconds between reconnection attempts while Redis is unreachable (a product choice: a restarted Redis is
#: joined again within a second, and a gateway alone tries at most once a second).
DEFAULT_RETRY_S = 1.0
#: Timeout of one Redis command or connection attempt, seconds (Redis answers a LAN round trip in well under a
#: millisecond; longer means it is gone).
DEFAULT_COMMAND_TIMEOUT_S = 1.0
#: Arrival keys queued at most between two flushes; beyond, new keys are dropped (their counts stay local).
MAX_PENDING_KEYS = 4096
#: Seconds a done copy's claim is kept for gateways that missed its publication (a product choice: short, because a
#: worker may evict the prefix later and a stale ``done`` would make a gateway record it as warm).
DONE_CLAIM_TTL_S = 30.0
#: Seconds between checks of a claim owned by another gateway while its outcome is awaited (a missed publication
#: is found this late at most).
CLAIM_RECHECK_S = 1.0


@dataclass(frozen=True, slots=True)
class Claim:
    """Answer of :meth:`FleetShare.claim`: ``owner`` is ``"self"`` (this gateway runs the copy), ``"alone"`` (no
    Redis: this gateway runs the copy unclaimed) or another gateway's id; ``done`` says that gateway's copy already
    ended done."""

    owner: str
    done: bool = False

    @property
    def mine(self) -> bool:
        return self.owner in ("self", "alone")


class FleetShare:
    """One gateway's link to the fleet's Redis (see the module docstring).

    Args:
        url: ``redis://host:port/db`` (or ``rediss://``, ``unix://``).
        prefix: key and channel prefix shared by the fleet's gateways (non-empty).
        on_arrivals: called with ``(key, arrivals)`` for each prefix another gateway saw arrive.
        on_copy_done: called with ``(chain, target_url, gateway id)`` when another gateway's copy ended done.
        on_copy_started: called with ``(chain, source_url, target_url, gateway id)`` when another gateway claimed a
            copy (it runs it now).
        on_tune: called with ``(constants dict, policy name, gateway id)`` when another gateway was tuned.
        retry_s: seconds between reconnection attempts.
        command_timeout_s: timeout of one command, seconds.
        claim_ttl_s: lifetime of a copy claim, seconds (longer than the longest copy).
        gateway_id: this gateway's id in messages (default: random hex).

    Raises:
        ValueError: an empty ``prefix`` or a non-positive time.
    """

    def __init__(
        self,
        url: str,
        prefix: str,
        *,
        on_arrivals: Callable[[str, int], None],
        on_copy_done: Callable[[tuple, str, str], None],
        on_tune: Callable[[dict, str, str], None],
        on_copy_started: Callable[[tuple, str, str, str], None] | None = None,
        retry_s: float = DEFAULT_RETRY_S,
        command_timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S,
        claim_ttl_s: float = 600.0,
        gateway_id: str | None = None,
    ) -> None:
        if not prefix:
            raise ValueError("redis_prefix must not be empty")
        if not (retry_s > 0 and command_timeout_s > 0 and claim_ttl_s > 0):
            raise ValueError("retry_s, command_timeout_s and claim_ttl_s must be > 0")
        from redis.exceptions import RedisError

        #: what a lost or refusing Redis raises
        self._errors: tuple[type[BaseException], ...] = (RedisError, OSError, asyncio.TimeoutError)
        self.url = url
        self.prefix = prefix
        self.gateway_id = gateway_id or secrets.token_hex(6)
        self.on_arrivals = on_arrivals
        self.on_copy_done = on_copy_done
        self.on_tune = on_tune
        self.on_copy_started = on_copy_started
        self.retry_s = retry_s
        self.command_timeout_s = command_timeout_s
        self.claim_ttl_ms = int(claim_ttl_s * 1000)
        self.chan_arrivals = f"{prefix}:arrivals"
        self.chan_copies = f"{prefix}:copies"
        self.chan_tune = f"{prefix}:tune"
        #: whether Redis answers now (None before the first attempt)
        self.connected: bool | None = None
        self._client: Any = None
        self._pending: dict[str, int] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        #: set by :meth:`stop`: the link's loops end at their next turn
        self._closing = False
        self._waiters: dict[tuple[str, str], list[asyncio.Future]] = {}
        #: counters: arrivals sent and folded, messages that could not be sent
        self.sent_arrivals = 0
        self.folded_arrivals = 0
        self.send_errors = 0

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start connecting (in the background; the gateway works alone until Redis answers)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Disconnect and stop reconnecting. Idempotent; returns within about ``command_timeout_s`` + 1 s.

        The link's tasks also stop on :attr:`_closing` at their next turn, not only on the cancel: redis-py can
        swallow a cancel that lands inside a command (seen under load with 8.2), which would otherwise leave the
        link reconnecting, or its flusher waiting, for ever.
        """
        self._closing = True
        self._wake.set()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            done, _ = await asyncio.wait((task,), timeout=self.command_timeout_s + 1.0)
            if not done:
                task.cancel()
                log_event(log, "fleet_share_stop_slow", logging.WARNING, url=self.url, waited_s=self.command_timeout_s)
        for futs in self._waiters.values():
            for f in futs:
                if not f.done():
                    f.set_result(("failed", "gateway stopped"))
        self._waiters.clear()

    def _key(self, prefix_key: str, target_url: str) -> str:
        return f"{self.prefix}:copy:{prefix_key}:{target_url}"

    def _transition(self, up: bool, reason: str | None = None) -> None:
        """One line per change of reachability (the first attempt counts as a change)."""
        if self.connected is up:
            return
        self.connected = up
        if up:
            log_event(log, "fleet_share_up", url=self.url, prefix=self.prefix, gateway_id=self.gateway_id)
        else:
            self._pending.clear()
            log_event(
                log,
                "fleet_share_down",
                logging.WARNING,
                url=self.url,
                prefix=self.prefix,
                gateway_id=self.gateway_id,
                reason=(reason or "unknown").splitlines()[0][:200],
                detecting="alone",
            )

    async def _run(self) -> None:
        import redis.asyncio as aioredis

        while not self._closing:
            client = aioredis.from_url(
                self.url,
                socket_connect_timeout=self.command_timeout_s,
                socket_timeout=self.command_timeout_s,
                decode_responses=True,
            )
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            flusher: asyncio.Task | None = None
            try:
                await client.ping()
                await pubsub.subscribe(self.chan_arrivals, self.chan_copies, self.chan_tune)
                self._client = client
                self._transition(True)
                flusher = asyncio.get_running_loop().create_task(self._flush_loop(client))
                while not self._closing:
                    if flusher.done():
                        flusher.result()  # re-raises what stopped it
                    msg = await pubsub.get_message(timeout=min(self.retry_s, 0.5))
                    if msg is not None and msg.get("type") == "message":
                        self._on_message(msg["channel"], msg["data"])
            except asyncio.CancelledError:
                raise
            except self._errors as e:
                self._transition(False, f"{type(e).__name__}: {e}")
            finally:
                self._client = None
                # A cancel that lands during this cleanup must end the loop, not be swallowed by it (``stop`` would
                # wait for ever): the cleanup runs shielded and only its own errors are ignored.
                await asyncio.shield(self._close_link(flusher, pubsub, client))
            await asyncio.sleep(self.retry_s)

    async def _close_link(self, flusher: asyncio.Task | None, pubsub: Any, client: Any) -> None:
        """Stop the flusher and close one connection's subscription and client, each step bounded by
        ``command_timeout_s``; their errors are ignored (the link is gone either way)."""
        if flusher is not None:
            flusher.cancel()
            self._wake.set()  # a flusher whose cancel was swallowed sees its client gone at its next turn
            await asyncio.wait((flusher,), timeout=self.command_timeout_s)
        for closing in (pubsub.aclose, client.aclose):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(closing(), self.command_timeout_s)

    # -- arrivals -----------------------------------------------------------------------------------------------

    def note_arrival(self, key: Hashable, arrivals: int = 1) -> None:
        """Queue a local arrival of tracked prefix ``key`` for the other gateways (never blocks; dropped while Redis
        is unreachable)."""
        if not self.connected:
            return
        k = str(key)
        pending = self._pending
        if k not in pending and len(pending) >= MAX_PENDING_KEYS:
            return
        pending[k] = pending.get(k, 0) + max(1, int(arrivals))
        self._wake.set()

    async def _flush_loop(self, client: Any) -> None:
        """Publish the queued arrivals in batches over ``client`` until it is no longer the link's (or on stop)."""
        while not self._closing:
            await self._wake.wait()
            self._wake.clear()
            if self._client is not client:
                return
            if not self._pending:
                continue
            batch, self._pending = self._pending, {}
            msg = json.dumps({"gw": self.gateway_id, "arrivals": [[k, n] for k, n in batch.items()]})
            await client.publish(self.chan_arrivals, msg)
            self.sent_arrivals += sum(batch.values())

    # -- incoming -----------------------------------------------------------------------------------------------

    def _on_message(self, channel: str, data: str) -> None:
        try:
            obj = json.loads(data)
        except ValueError:
            return
        if not isinstance(obj, dict) or obj.get("gw") == self.gateway_id:
            return
        gw = str(obj.get("gw", "?"))
        try:
            if channel == self.chan_arrivals:
                for k, n in obj.get("arrivals", ()):
                    if isinstance(k, str) and isinstance(n, int) and n > 0:
                        self.folded_arrivals += n
                        self.on_arrivals(k, n)
            elif channel == self.chan_copies:
                key, target, state = str(obj["key"]), str(obj["target"]), str(obj["state"])
                chain = obj.get("chain") or []
                if not isinstance(chain, list) or not all(isinstance(b, str) for b in chain):
                    raise TypeError("chain: expected a list of block hashes (strings)")
                if state == "copying":
                    if self.on_copy_started is not None:
                        self.on_copy_started(tuple(chain), str(obj.get("source", "")), target, gw)
                    return
                for f in self._waiters.pop((key, target), ()):
                    if not f.done():
                        f.set_result((state, gw))
                if state == "done":
                    self.on_copy_done(tuple(chain), target, gw)
            elif channel == self.chan_tune:
                self.on_tune(dict(obj["constants"]), str(obj["policy"]), gw)
        except (KeyError, TypeError, ValueError) as e:
            log_event(log, "fleet_share_bad_message", logging.WARNING, channel=channel, sender=gw, reason=repr(e))
        except Exception:  # a bug in a callback: this message is lost, the link to the fleet stays
            log.exception("fleet message on %s from gateway %s could not be applied", channel, gw)

    # -- copy orders --------------------------------------------------------------------------------------------

    async def claim(
        self, prefix_key: Hashable, target_url: str, chain: Sequence[Hashable] = (), source_url: str = ""
    ) -> Claim:
        """Claim the copy of ``prefix_key`` (the copied chain's last block hash) to ``target_url`` for this gateway:
        ``SET NX PX``, one round trip (two when another gateway holds it). A won claim is announced on the copies
        channel with ``chain`` and ``source_url`` (state ``copying``), so the other gateways count the copy as
        arriving before they plan their own. Without Redis: ``Claim("alone")``."""
        client = self._client
        if client is None or not self.connected:
            return Claim("alone")
        k = self._key(str(prefix_key), target_url)
        try:
            mine = json.dumps({"gw": self.gateway_id, "state": "copying"})
            ok = await client.set(k, mine, nx=True, px=self.claim_ttl_ms)
            if ok:
                if chain:
                    msg = {
                        "gw": self.gateway_id,
                        "key": str(prefix_key),
                        "target": target_url,
                        "source": source_url,
                        "state": "copying",
                        "chain": [str(c) for c in chain],
                    }
                    await client.publish(self.chan_copies, json.dumps(msg))
                return Claim("self")
            raw = await client.get(k)
        except self._errors as e:  # Redis lost meanwhile: the copy goes ahead unclaimed
            self.send_errors += 1
            log_event(log, "fleet_share_claim_failed", logging.WARNING, prefix=str(prefix_key), reason=repr(e)[:200])
            return Claim("alone")
        if raw is None:  # it ended and was dropped in between: ask once more
            return await self.claim(prefix_key, target_url)
        try:
            obj = json.loads(raw)
            owner, state = str(obj["gw"]), str(obj.get("state"))
        except (ValueError, KeyError, TypeError):
            return Claim("alone")
        if owner == self.gateway_id:
            return Claim("self")
        return Claim(owner, done=state == "done")

    async def wait_outcome(self, prefix_key: Hashable, target_url: str, timeout_s: float) -> tuple[str, str]:
        """Wait for the outcome of another gateway's copy of ``prefix_key`` to ``target_url``: ``(state, why)``,
        ``state`` ``done`` or ``failed``. The claim is re-read every :data:`CLAIM_RECHECK_S` (a publication missed
        while reconnecting); a claim that vanished without a ``done`` counts as failed, and so does ``timeout_s``."""
        loop = asyncio.get_running_loop()
        key = (str(prefix_key), target_url)
        deadline = loop.time() + timeout_s
        while True:
            fut: asyncio.Future = loop.create_future()
            self._waiters.setdefault(key, []).append(fut)
            try:
                state, gw = await asyncio.wait_for(fut, timeout=CLAIM_RECHECK_S)
                return state, f"copy ordered by gateway {gw} ended {state}"
            except asyncio.TimeoutError:
                pass
            finally:
                futs = self._waiters.get(key)
                if futs is not None and fut in futs:
                    futs.remove(fut)
                    if not futs:
                        del self._waiters[key]
            client = self._client
            if client is not None:
                try:
                    raw = await client.get(self._key(*key))
                except self._errors:
                    raw = ""
                if raw is None:
                    return "failed", "the other gateway's claim ended without a done copy"
                if raw:
                    with contextlib.suppress(ValueError, TypeError, AttributeError):
                        if json.loads(raw).get("state") == "done":
                            return "done", "the other gateway's claim says done"
            if loop.time() >= deadline:
                return "failed", f"no outcome from the other gateway after {timeout_s:g} s"

    async def publish_outcome(
        self, prefix_key: Hashable, target_url: str, chain: Sequence[Hashable], done: bool
    ) -> None:
        """Publish the outcome of this gateway's claimed copy: ``done`` keeps the claim (marked done) for
        :data:`DONE_CLAIM_TTL_S` so later claims learn the target is warm; a failure drops it. One pipelined round
        trip; nothing when Redis is unreachable."""
        client = self._client
        if client is None:
            return
        k = self._key(str(prefix_key), target_url)
        state = "done" if done else "failed"
        msg = {"gw": self.gateway_id, "key": str(prefix_key), "target": target_url, "state": state}
        if done:
            msg["chain"] = [str(c) for c in chain]
        try:
            pipe = client.pipeline(transaction=False)
            if done:
                pipe.set(k, json.dumps({"gw": self.gateway_id, "state": "done"}), px=int(DONE_CLAIM_TTL_S * 1000))
            else:
                pipe.delete(k)
            pipe.publish(self.chan_copies, json.dumps(msg))
            await pipe.execute()
        except self._errors as e:
            self.send_errors += 1
            log_event(log, "fleet_share_publish_failed", logging.WARNING, what="copy", reason=repr(e)[:200])

    # -- tuning -------------------------------------------------------------------------------------------------

    async def publish_tune(self, constants: dict, policy: str) -> None:
        """Publish this gateway's confirmed constants and policy to the others (nothing without Redis)."""
        client = self._client
        if client is None:
            return
        try:
            await client.publish(
                self.chan_tune, json.dumps({"gw": self.gateway_id, "constants": constants, "policy": policy})
            )
        except self._errors as e:
            self.send_errors += 1
            log_event(log, "fleet_share_publish_failed", logging.WARNING, what="tune", reason=repr(e)[:200])
