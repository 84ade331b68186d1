"""Trace audit: sizes, rates and **fan-out**, the statistic that says whether a trace has prefix bursts.

Fan-out for ``(k, t)`` (``k`` blocks, ``t`` seconds): group the requests that have at least ``k`` block hashes by
their ``k``-th hash (hashes are prefix-chained, so equal ``k``-th hashes mean identical first ``k`` blocks; requests
with fewer than ``k`` blocks are left out). Within a group, the fan-out is the largest number of its requests whose
arrivals fit in a window shorter than ``t`` seconds: the maximum over ``i`` of the number of arrivals in
``[a_i, a_i + t)``. ``max_requests`` is the maximum over groups (0 when no request has ``k`` blocks);
``events`` is the number of groups whose fan-out reaches ``event_min_requests`` (default 8) -- each group counts
once, however many separate bursts it has. The half-open window matches a trailing detector window: BTB fires when
``threshold`` arrivals of one prefix fall in ``(now - window_s, now]`` (REFERENCE.md s1).

REFERENCE.md s3: public traces with prefix hashes have no deep-prefix bursts (the largest fan-out of >= 16 shared
blocks within 10 s is 25 requests in ART-Chat-2.5M and 2 in the Mooncake traces), whereas a Bursted window has one
group of ``burst_size`` requests per burst.
"""

from __future__ import annotations

from collections.abc import Sequence

from btbctl.engine.errors import ConfigError
from btbctl.engine.trace.model import KINDS, Trace
from btbctl.engine.wording import plural

#: Default ``k`` values (blocks) of the fan-out table: 1 block up to BTB's default prefix of 256 blocks (REFERENCE.md
#: s1); 16 is the depth REFERENCE.md s3 quotes for public traces.
DEFAULT_KS = (1, 16, 64, 256)
#: Default windows (seconds): BTB's default detection window (1 s), the 10 s REFERENCE.md s3 quotes, and a minute.
DEFAULT_WINDOWS_S = (1.0, 10.0, 60.0)
#: A prefix group counts as an event when its fan-out reaches this many requests (a burst, not a chat session's
#: handful of follow-ups).
DEFAULT_EVENT_MIN_REQUESTS = 8


def audit_trace(
    trace: Trace,
    ks: Sequence[int] = DEFAULT_KS,
    windows_s: Sequence[float] = DEFAULT_WINDOWS_S,
    event_min_requests: int = DEFAULT_EVENT_MIN_REQUESTS,
) -> dict:
    """Summarise ``trace``.

    Args:
        trace: the trace (requests sorted by arrival, as :class:`Trace` keeps them).
        ks: prefix depths in blocks (ints >= 1).
        windows_s: window lengths in seconds (> 0).
        event_min_requests: fan-out a group needs to count as an event (>= 1).

    Returns:
        A dict with stable keys::

            {"requests": int, "span_s": float, "block_tokens": int,
             "rate_rps": {"mean": float | None, "peak_1s": int},
             "input_tokens": {"mean", "p50", "p95", "max"}, "output_tokens": {"mean", "p50", "p95", "max"},
             "kinds": {kind: count}, "event_min_requests": int,
             "fan_out": [{"k_blocks", "window_s", "max_requests", "events"}, ...]}

        ``rate_rps.mean`` is requests / span_s (None when the span is 0); ``peak_1s`` is the most arrivals in any
        1-second window ``[a, a + 1)``. Percentiles are nearest-rank on the sorted values, ``sorted[int(q x n)]``
        clipped to the last element (the rule Infer-Sim uses, REFERENCE.md s2); token statistics are None for an
        empty trace. ``kinds`` lists the known kinds in :data:`KINDS` order, then others alphabetically, only those
        present. ``fan_out`` has one entry per ``(k, t)``, ``ks`` outer, ``windows_s`` inner, in the given order.

    Raises:
        ConfigError: a bad ``ks``, ``windows_s`` or ``event_min_requests`` (key names the argument).

    Cost: O(requests x len(ks) x len(windows_s)); the Mooncake conversation trace takes tens of milliseconds.
    """
    ks = list(ks)
    windows = [float(t) if type(t) in (int, float) else t for t in windows_s]
    for k in ks:
        if type(k) is not int or k < 1:
            raise ConfigError("ks", f"block counts must be integers >= 1, got {k!r}")
    for t in windows:
        if type(t) is not float or not t > 0 or t == float("inf"):
            raise ConfigError("windows_s", f"windows must be finite numbers > 0 seconds, got {t!r}")
    if type(event_min_requests) is not int or event_min_requests < 1:
        raise ConfigError("event_min_requests", f"must be an integer >= 1, got {event_min_requests!r}")

    reqs = trace.requests
    arrivals = [r.arrival_s for r in reqs]
    n = len(reqs)
    span_s = trace.span_s
    kinds: dict[str, int] = {}
    for r in reqs:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    ordered_kinds = {k: kinds[k] for k in KINDS if k in kinds}
    ordered_kinds.update({k: kinds[k] for k in sorted(kinds) if k not in ordered_kinds})

    fan_out = []
    for k in ks:
        groups: dict = {}
        get = groups.get
        for r in reqs:
            hs = r.block_hashes
            if len(hs) >= k:
                key = hs[k - 1]
                g = get(key)
                if g is None:
                    groups[key] = [r.arrival_s]
                else:
                    g.append(r.arrival_s)
        multi = [g for g in groups.values() if len(g) > 1]
        for t in windows:
            best = 1 if groups else 0
            events = 0
            for g in multi:
                m = max_in_window(g, t)
                if m > best:
                    best = m
                if m >= event_min_requests:
                    events += 1
            if event_min_requests == 1:
                events += len(groups) - len(multi)
            fan_out.append({"k_blocks": k, "window_s": t, "max_requests": best, "events": events})

    return {
        "requests": n,
        "span_s": span_s,
        "block_tokens": trace.block_tokens,
        "rate_rps": {"mean": n / span_s if span_s > 0 else None, "peak_1s": max_in_window(arrivals, 1.0)},
        "input_tokens": _stats([r.input_tokens for r in reqs]),
        "output_tokens": _stats([r.output_tokens for r in reqs]),
        "kinds": ordered_kinds,
        "event_min_requests": event_min_requests,
        "fan_out": fan_out,
    }


def max_in_window(times: Sequence[float], window_s: float) -> int:
    """Most elements of the ascending ``times`` inside any half-open window ``[a, a + window_s)`` (0 if empty)."""
    best = 0
    lo = 0
    for hi, t in enumerate(times):
        edge = t - window_s
        while times[lo] <= edge:
            lo += 1
        c = hi - lo + 1
        if c > best:
            best = c
    return best


def _stats(values: list[int]) -> dict:
    n = len(values)
    if not n:
        return {"mean": None, "p50": None, "p95": None, "max": None}
    s = sorted(values)
    return {"mean": sum(s) / n, "p50": s[min(n - 1, int(0.5 * n))], "p95": s[min(n - 1, int(0.95 * n))], "max": s[-1]}


def btb_verdict(trace: Trace, prefix_blocks: int, threshold: int, window_s: float) -> dict:
    """Whether BTB's detector fires on ``trace`` with these constants, and if not, why and with which
    ``prefix_blocks`` it would.

    BTB fires for a prefix when ``threshold`` requests sharing its first ``prefix_blocks`` blocks arrive within
    ``window_s`` seconds (the fan-out above for ``k = prefix_blocks``, ``t = window_s``). Requests with fewer
    blocks are never tracked.

    Returns:
        ``{"prefix_blocks", "threshold", "window_s", "fires": bool, "hot_prefixes": groups that reach the
        threshold, "max_arrivals": most arrivals of one prefix in a window, "requests_tracked": requests with
        >= prefix_blocks blocks, "longest_blocks": most blocks of any request, "fires_with_prefix_blocks": the
        largest power-of-two prefix_blocks (<= the longest request) at which it would fire with the same threshold
        and window, or None, "reason": one sentence}``.
    """
    reqs = trace.requests
    longest = max((len(r.block_hashes) for r in reqs), default=0)

    def fan(k: int) -> tuple[int, int, int]:
        groups: dict = {}
        tracked = 0
        for r in reqs:
            if len(r.block_hashes) >= k:
                tracked += 1
                groups.setdefault(r.block_hashes[k - 1], []).append(r.arrival_s)
        peaks = [max_in_window(g, window_s) for g in groups.values()]
        return tracked, max(peaks, default=0), sum(1 for p in peaks if p >= threshold)

    tracked, peak, hot = fan(prefix_blocks)
    fires = hot > 0
    alt = None
    if not fires and longest:
        k = 1
        while k * 2 <= min(longest, prefix_blocks):
            k *= 2
        while k >= 1:
            if fan(k)[2]:
                alt = k
                break
            k //= 2
    tokens = trace.block_tokens
    consts = f"prefix_blocks={prefix_blocks} threshold={threshold} window_s={window_s:g}"
    if fires:
        reason = (
            f"BTB fires with {consts}: {hot} prefix(es) of {prefix_blocks} blocks "
            f"({prefix_blocks * tokens:,} tokens) reach {threshold} arrivals within {window_s:g} s (peak {peak})"
        )
    elif longest == 0:
        reason = (
            f"BTB never fires: the trace has no prefix hashes ({trace.format} records sizes and times only), "
            "so no two requests are known to share a prefix"
        )
    elif tracked == 0:
        reason = (
            f"BTB never fires with {consts}: no request has {prefix_blocks} blocks ({prefix_blocks * tokens:,} "
            f"tokens; the longest has {longest} blocks of {tokens} tokens), so no prefix is tracked"
        )
    else:
        reason = (
            f"BTB never fires with {consts}: at most {plural(peak, 'arrival')} of one {prefix_blocks}-block prefix "
            f"fall within {window_s:g} s ({tracked:,} requests have that many blocks)"
        )
    if not fires and longest:
        reason += (
            f"; it would fire with prefix_blocks={alt} (same threshold and window)"
            if alt is not None
            else "; no shorter prefix_blocks fires either (no burst of shared prefixes at this threshold and window)"
        )
    return {
        "prefix_blocks": prefix_blocks,
        "threshold": threshold,
        "window_s": window_s,
        "fires": fires,
        "hot_prefixes": hot,
        "max_arrivals": peak,
        "requests_tracked": tracked,
        "longest_blocks": longest,
        "fires_with_prefix_blocks": alt,
        "reason": reason,
    }
