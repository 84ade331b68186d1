"""The Bursted workload generator: bursts of requests sharing one long prefix, decoys and background, from a seed.

Recipe (REFERENCE.md s3, the synthetic windows of Bursted-ART, from the bite-the-bullet dataset generator): 8 burst
jobs, burst ``k`` starting at ``20 s + 40 s x k`` with uniform +-2 s jitter; each burst is 500 requests spread
evenly over 60 s (1 s in the adversarial variant); each burst has its own unique 65,536-token prefix (256 blocks of
256 tokens), each request adds a unique 256-token suffix (1 block) and asks for 1 output token. Plus 120 decoys:
single requests, each with its own unique 65,536-token prefix and 256-token suffix, starting uniformly in
[14 s, 340 s]. About 4,120 requests over about 345 s. No background traffic by default.

Block hashes are prefix-chained strings (see :mod:`btbctl.engine.trace.model`): every request of burst ``k``
carries the same tuple object for the burst's shared full prefix blocks, followed by blocks unique to the request.
A block that mixes prefix and suffix tokens (when ``prefix_tokens`` is not a multiple of the block size) is unique
to its request, as a real prefix cache would see it.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, fields

from btbctl.engine.errors import ConfigError
from btbctl.engine.trace.model import Request, Trace

#: ``spread_s`` of the adversarial Bursted variant: each burst's 500 requests arrive within 1 s (REFERENCE.md s3).
ADVERSARIAL_SPREAD_S = 1.0
#: Most requests one generated window may hold (the published window has 4,120). A product bound: past it the
#: generator would run for minutes and fill memory before the simulator even starts; a typo such as
#: ``background_rps = 1e9`` must fail at once with a message instead.
MAX_GENERATED_REQUESTS = 10_000_000
#: Most block hashes one generated window may hold, summed over its requests (shared burst prefixes counted once;
#: the published window has about 37,000). Each is a small Python string, so 20 million is a couple of GB.
MAX_GENERATED_BLOCKS = 20_000_000


@dataclass(frozen=True)
class BurstedParams:
    """Shape of one Bursted window. Defaults reproduce REFERENCE.md s3 (bite-the-bullet's dataset generator).

    Times are seconds from the start of the window (then shifted by ``offset_s``); lengths are tokens.

    Attributes:
        bursts: number of burst jobs (default 8).
        burst_size: requests per burst (default 500).
        first_burst_s: nominal start of burst 0 (default 20.0 s).
        burst_period_s: nominal gap between burst starts; burst ``k`` starts at
            ``first_burst_s + burst_period_s x k`` (default 40.0 s).
        jitter_s: each burst start moves by a uniform draw in ``[-jitter_s, +jitter_s]`` (default 2.0 s); must not
            exceed ``first_burst_s`` so that no arrival is negative.
        spread_s: a burst's requests arrive evenly over this many seconds: request ``i`` of ``n`` at
            ``start + spread_s x i / n`` (default 60.0 s; :data:`ADVERSARIAL_SPREAD_S` = 1.0 s is the adversarial
            variant; 0 sends the whole burst at once).
        prefix_tokens: length of each burst's shared prefix, and of each decoy's own prefix (default 65,536 =
            256 blocks of 256 tokens).
        suffix_tokens: unique tokens each request adds after the prefix (default 256 = 1 block).
        output_tokens: tokens each burst or decoy request asks for (default 1).
        decoys: single requests with their own unique prefix (default 120).
        decoy_start_s: decoy arrivals are uniform in ``[decoy_start_s, decoy_end_s]`` (default 14.0 s).
        decoy_end_s: see ``decoy_start_s`` (default 340.0 s).
        block_tokens: tokens per hash block (default 256, the ``btb-mixed-trace-v1`` block size). Ignored when a
            base trace is given: the base's block size is used so the merged trace has one block size.
        background_rps: mean rate of background requests, Poisson arrivals over ``[0, background_end_s)``
            (default 0.0: none; not part of the published recipe). Background prompts are all unique, so they add
            load but no fan-out.
        background_end_s: end of the background arrivals; None (default) means the end of the window, i.e. the
            latest of the last burst's nominal end plus jitter and ``decoy_end_s``.
        background_input_min_tokens: background prompt lengths are uniform integers in
            ``[background_input_min_tokens, background_input_max_tokens]`` (default 256).
        background_input_max_tokens: see above (default 8,192).
        background_output_tokens: tokens each background request asks for (default 128).
        offset_s: added to every generated arrival, to place the window inside a longer base trace (default 0.0).

    Raises:
        ConfigError: a field out of range, or a window too large to generate (see :meth:`check_size`); the key
            is the field name.
    """

    bursts: int = 8
    burst_size: int = 500
    first_burst_s: float = 20.0
    burst_period_s: float = 40.0
    jitter_s: float = 2.0
    spread_s: float = 60.0
    prefix_tokens: int = 65536
    suffix_tokens: int = 256
    output_tokens: int = 1
    decoys: int = 120
    decoy_start_s: float = 14.0
    decoy_end_s: float = 340.0
    block_tokens: int = 256
    background_rps: float = 0.0
    background_end_s: float | None = None
    background_input_min_tokens: int = 256
    background_input_max_tokens: int = 8192
    background_output_tokens: int = 128
    offset_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "background_end_s" and v is None:
                continue
            if f.type in ("int", int):
                if type(v) is not int:
                    raise ConfigError(f.name, f"must be an integer, got {v!r}")
            elif type(v) not in (int, float) or not math.isfinite(v):
                raise ConfigError(f.name, f"must be a finite number, got {v!r}")
        _at_least(self, "bursts", 0)
        _at_least(self, "burst_size", 1)
        _at_least(self, "first_burst_s", 0)
        _at_least(self, "burst_period_s", 0)
        _at_least(self, "jitter_s", 0)
        _at_least(self, "spread_s", 0)
        _at_least(self, "prefix_tokens", 1)
        _at_least(self, "suffix_tokens", 0)
        _at_least(self, "output_tokens", 1)
        _at_least(self, "decoys", 0)
        _at_least(self, "decoy_start_s", 0)
        _at_least(self, "block_tokens", 1)
        _at_least(self, "background_rps", 0)
        _at_least(self, "background_input_min_tokens", 1)
        _at_least(self, "background_output_tokens", 1)
        _at_least(self, "offset_s", 0)
        if self.jitter_s > self.first_burst_s:
            raise ConfigError(
                "jitter_s",
                f"must be <= first_burst_s ({self.first_burst_s}) so no arrival is negative, got {self.jitter_s}",
            )
        if self.decoy_end_s < self.decoy_start_s:
            raise ConfigError("decoy_end_s", f"must be >= decoy_start_s ({self.decoy_start_s}), got {self.decoy_end_s}")
        if self.background_input_max_tokens < self.background_input_min_tokens:
            raise ConfigError(
                "background_input_max_tokens",
                f"must be >= background_input_min_tokens "
                f"({self.background_input_min_tokens}), got "
                f"{self.background_input_max_tokens}",
            )
        if self.background_end_s is not None and self.background_end_s < 0:
            raise ConfigError("background_end_s", f"must be >= 0 or unset, got {self.background_end_s}")
        self.check_size(self.block_tokens)

    def check_size(self, block_tokens: int) -> None:
        """Refuse a window too large to generate: more than :data:`MAX_GENERATED_REQUESTS` requests (background
        counted at its mean rate) or more than :data:`MAX_GENERATED_BLOCKS` block hashes with ``block_tokens``-token
        blocks. Raises :class:`ConfigError` naming the field that contributes most."""
        input_tokens = self.prefix_tokens + self.suffix_tokens
        n_blocks = -(-input_tokens // block_tokens)
        shared = self.prefix_tokens // block_tokens
        burst_requests = self.bursts * self.burst_size
        bg_s = 0.0
        if self.background_rps > 0:
            bg_s = self.background_end_s if self.background_end_s is not None else self.window_end_s()
        bg_requests = self.background_rps * bg_s
        requests = burst_requests + self.decoys + bg_requests
        if requests > MAX_GENERATED_REQUESTS:
            parts = {"burst_size": burst_requests, "decoys": self.decoys, "background_rps": bg_requests}
            key = max(parts, key=parts.__getitem__)
            raise ConfigError(
                key,
                f"the window would hold about {requests:,.0f} requests (bursts x burst_size "
                f"{burst_requests:,} + decoys {self.decoys:,} + background about "
                f"{bg_requests:,.0f}); at most {MAX_GENERATED_REQUESTS:,} are supported",
            )
        bg_mean_tokens = (self.background_input_min_tokens + self.background_input_max_tokens) // 2
        bg_blocks = bg_requests * -(-bg_mean_tokens // block_tokens)
        blocks = self.bursts * shared + burst_requests * (n_blocks - shared) + self.decoys * n_blocks + bg_blocks
        if blocks > MAX_GENERATED_BLOCKS:
            key = "background_input_max_tokens" if bg_blocks * 2 > blocks else "prefix_tokens"
            raise ConfigError(
                key,
                f"the window would hold about {blocks:,.0f} block hashes ({input_tokens:,} "
                f"prompt tokens in {block_tokens}-token blocks per request); at most "
                f"{MAX_GENERATED_BLOCKS:,} are supported: use fewer or shorter requests or "
                f"larger blocks",
            )

    @classmethod
    def adversarial(cls, **changes) -> BurstedParams:
        """The adversarial variant: the defaults with ``spread_s`` = :data:`ADVERSARIAL_SPREAD_S` (REFERENCE.md s3)."""
        changes.setdefault("spread_s", ADVERSARIAL_SPREAD_S)
        return cls(**changes)

    def window_end_s(self) -> float:
        """Latest possible burst or decoy arrival, seconds from the window start (before ``offset_s``)."""
        last_burst = (
            self.first_burst_s + self.burst_period_s * (self.bursts - 1) + self.jitter_s + self.spread_s
            if self.bursts
            else 0.0
        )
        return max(last_burst, self.decoy_end_s if self.decoys else 0.0)

    def as_dict(self) -> dict:
        """The fields as a plain dict (stable key order: declaration order)."""
        return asdict(self)


def _at_least(p: BurstedParams, name: str, low: float) -> None:
    v = getattr(p, name)
    if v < low:
        raise ConfigError(name, f"must be >= {low}, got {v!r}")


def generate_bursted(params: BurstedParams | None = None, seed: int = 42, base: Trace | None = None) -> Trace:
    """Generate one Bursted window, optionally overlaid on a real trace.

    Args:
        params: window shape (default :class:`BurstedParams()`).
        seed: the only source of randomness (``random.Random(seed)``); equal seeds give equal traces.
        base: a trace to overlay the window on. Its requests are kept as they are (the same objects; treat
            requests as read-only). The generated block hashes are strings under a namespace (``x<seed>:`` or, if
            any base hash starts with that, ``x<seed>.<n>:``) so they never collide with the base's hashes;
            generated request ids get a prefix if they would collide with the base's. The generated hash chains
            are cut at the base's ``block_tokens`` so the merged trace has one block size; BTB's ``prefix_blocks``
            then counts blocks of that size.

    Returns:
        A trace of format ``generated`` sorted by arrival: kinds ``burst`` (labels ``{"burst": k}``), ``decoy``
        (``{"decoy": d}``), ``background``, each label dict also holding ``trace_id`` (``bursted-seed<seed>``) and
        ``source`` (``synthetic``), plus the base's requests. ``meta`` records the generator, seed, params and base.
        Arrivals are rounded to 6 decimals (microseconds).

    Cost: one shared prefix tuple per burst plus a small per-request tuple; the default window (4,120 requests of
    257 blocks) takes a few tens of milliseconds.
    """
    p = params if params is not None else BurstedParams()
    if type(seed) is not int:
        raise ConfigError("seed", f"must be an integer, got {seed!r}")
    rng = random.Random(seed)
    block_tokens = base.block_tokens if base is not None else p.block_tokens
    if block_tokens != p.block_tokens:
        p.check_size(block_tokens)  # the base's block size may make the window larger
    ns = _namespace(seed, base)
    id_prefix = _id_prefix(base)
    trace_id = f"bursted-seed{seed}"
    input_tokens = p.prefix_tokens + p.suffix_tokens
    n_blocks = -(-input_tokens // block_tokens)
    shared_blocks = p.prefix_tokens // block_tokens
    own_blocks = range(shared_blocks, n_blocks)
    off = p.offset_s

    requests: list[Request] = []
    append = requests.append
    n = p.burst_size
    for k in range(p.bursts):
        start = p.first_burst_s + p.burst_period_s * k + rng.uniform(-p.jitter_s, p.jitter_s)
        prefix = tuple(f"{ns}b{k}p{j}" for j in range(shared_blocks))
        for i in range(n):
            own = tuple(f"{ns}b{k}r{i}s{j}" for j in own_blocks)
            append(
                Request(
                    f"{id_prefix}burst{k}-{i}",
                    round(off + start + p.spread_s * i / n, 6),
                    input_tokens,
                    p.output_tokens,
                    prefix + own,
                    "burst",
                    {"trace_id": trace_id, "source": "synthetic", "burst": k},
                )
            )
    for d in range(p.decoys):
        at = rng.uniform(p.decoy_start_s, p.decoy_end_s)
        hashes = tuple(f"{ns}d{d}p{j}" for j in range(shared_blocks)) + tuple(f"{ns}d{d}s{j}" for j in own_blocks)
        append(
            Request(
                f"{id_prefix}decoy{d}",
                round(off + at, 6),
                input_tokens,
                p.output_tokens,
                hashes,
                "decoy",
                {"trace_id": trace_id, "source": "synthetic", "decoy": d},
            )
        )
    if p.background_rps > 0:
        end = p.background_end_s if p.background_end_s is not None else p.window_end_s()
        t = rng.expovariate(p.background_rps)
        g = 0
        while t < end:
            tokens = rng.randint(p.background_input_min_tokens, p.background_input_max_tokens)
            hashes = tuple(f"{ns}g{g}s{j}" for j in range(-(-tokens // block_tokens)))
            append(
                Request(
                    f"{id_prefix}bg{g}",
                    round(off + t, 6),
                    tokens,
                    p.background_output_tokens,
                    hashes,
                    "background",
                    {"trace_id": trace_id, "source": "synthetic"},
                )
            )
            g += 1
            t += rng.expovariate(p.background_rps)

    meta = {"generator": "bursted", "seed": seed, "params": p.as_dict(), "hash_namespace": ns}
    if base is not None:
        meta["base"] = {"path": base.path, "format": base.format, "requests": len(base.requests)}
        requests = list(base.requests) + requests
    # the generated chains are prefix-chained in their own namespace; merged with a base trace, as chained as it
    return Trace(requests, block_tokens, "generated", None, meta, prefix_chained=base is None or base.prefix_chained)


def _namespace(seed: int, base: Trace | None) -> str:
    """``x<seed>:``, or ``x<seed>.<n>:`` with the smallest n >= 1 such that no base hash starts with it."""
    ns = f"x{seed}:"
    if base is None:
        return ns
    taken = _string_hash_heads(base)
    n = 0
    while any(h.startswith(ns) for h in taken):
        n += 1
        ns = f"x{seed}.{n}:"
    return ns


def _string_hash_heads(base: Trace) -> set[str]:
    """The distinct string hashes of a trace that could clash with a generated namespace (start with ``x``)."""
    out: set[str] = set()
    for r in base.requests:
        for h in r.block_hashes:
            if type(h) is str and h[:1] == "x":
                out.add(h)
    return out


def _id_prefix(base: Trace | None) -> str:
    """``""``, or ``ov<n>-`` with the smallest n >= 1 such that no base request id starts with it plus a generated
    id stem (``burst``, ``decoy``, ``bg``)."""
    if base is None:
        return ""
    ids = [r.request_id for r in base.requests]
    prefix, n = "", 0
    while any(rid.startswith((prefix + "burst", prefix + "decoy", prefix + "bg")) for rid in ids):
        n += 1
        prefix = f"ov{n}-"
    return prefix
