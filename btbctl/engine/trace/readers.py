"""Trace readers: Mooncake JSONL, ``btb-mixed-trace-v1`` JSONL and Azure 2023 CSV, into one :class:`Trace`.

Formats (REFERENCE.md s3 and s8):

``mooncake``
    JSONL, one object per line: ``timestamp`` (milliseconds, number >= 0), ``input_length`` (tokens, int >= 1),
    ``output_length`` (tokens, int >= 0), ``hash_ids`` (list of ints, one per 512-token block, prefix-chained).
    ``arrival_s = timestamp / 1000``; ``request_id`` is the 1-based line number as a string; kind ``background``;
    ``block_tokens`` 512 (the Mooncake FAST'25 traces' block size).
``btb-mixed-trace-v1``
    JSONL written by the BTB dataset generator and by :func:`btbctl.engine.trace.writer.write_btb_mixed`.
    Required: ``arrival_s`` (seconds, number >= 0), ``input_length`` (int >= 1), ``output_length`` (int >= 0),
    ``hash_ids`` (list of strings, one per block), ``request_id`` (non-empty string or int, unique in the file; ints
    are kept as their decimal string). Optional: ``trace_id`` and ``source`` (kept as given in ``labels``),
    ``metadata`` (object; ``metadata.job_kind`` becomes :attr:`Request.kind`, default ``background``; its other
    keys go to ``labels``), ``block_tokens`` or ``block_size`` (int >= 1; default 256, the format's block size).
    Lines that give a block size must all agree; lines that do not give one inherit it.
``azure2023``
    CSV with header columns ``TIMESTAMP`` (``YYYY-MM-DD HH:MM:SS[.fraction]``, any number of fraction digits),
    ``ContextTokens`` (int >= 1) and ``GeneratedTokens`` (int >= 0), in any column order (extra columns are
    ignored). ``arrival_s`` = seconds since the earliest timestamp; no prefix information, so ``block_hashes`` is
    empty and no two requests share cache; ``block_tokens`` 512 (nominal: nothing refers to it); ``request_id`` is
    the 1-based line number (the header is line 1).

Shared rules:

* An output length of 0 is stored as 1: SGLang needs at least one generated token to report a TTFT, and every
  consumer of :class:`Request` relies on ``output_tokens >= 1``. Negative output lengths are errors.
* Arrival order in the file does not matter; :class:`Trace` sorts by ``arrival_s`` (stable).
* Blank lines are skipped; line numbers in errors are physical 1-based lines of the (decompressed) file.
* A path ending in ``.gz`` is read through gzip. The file must be UTF-8 (a leading BOM is ignored). Devices and
  sockets are refused (pipes are read).
* Every problem raises :class:`TraceFormatError` naming the file and, where there is one, the line: unreadable
  file, non-UTF-8 bytes, malformed JSON, a value that is not a JSON object, a missing field (named), a wrong type,
  a non-finite or negative time, ``input_length < 1``, ``output_length < 0``, duplicate ``request_id``, an empty
  file ("no requests"), an unrecognised format.

Speed: one ``json.loads`` per line and a few type checks; the 12,031-row Mooncake conversation trace reads in
well under 0.3 s on one core.
"""

from __future__ import annotations

import json
import math
import operator
import os
import re
from collections.abc import Callable
from datetime import date

from btbctl.engine.chains import chain_conflict, follows
from btbctl.engine.errors import TraceFormatError
from btbctl.engine.trace.model import Request, Trace

#: Format names :func:`read_trace` accepts, in detection order.
FORMATS = ("mooncake", "btb-mixed-trace-v1", "azure2023")

#: Tokens per ``hash_ids`` block in the Mooncake FAST'25 traces (REFERENCE.md s8).
MOONCAKE_BLOCK_TOKENS = 512
#: Default tokens per block of ``btb-mixed-trace-v1`` (REFERENCE.md s3: 65,536-token prefix = 256 blocks).
BTB_MIXED_BLOCK_TOKENS = 256
#: Nominal block size given to Azure traces, which carry no block hashes (REFERENCE.md s8).
AZURE_BLOCK_TOKENS = 512

_FORMAT_HELP = (
    "valid formats: mooncake (JSONL with 'timestamp' and 'hash_ids'), btb-mixed-trace-v1 (JSONL with 'arrival_s'), "
    "azure2023 (CSV with TIMESTAMP, ContextTokens, GeneratedTokens columns)"
)


# --------------------------------------------------------------------------------------------------------------------
# public API


def read_trace(path: str | os.PathLike, fmt: str | None = None) -> Trace:
    """Read a trace file in any of :data:`FORMATS`.

    Args:
        path: file to read (``.gz`` is decompressed).
        fmt: one of :data:`FORMATS`, or None to detect it from the first non-empty line: a JSON object with
            ``arrival_s`` is ``btb-mixed-trace-v1``; one with ``timestamp`` (Mooncake rows also have ``hash_ids``;
            when that is missing the error names it) is ``mooncake``; a CSV header naming ``ContextTokens`` is
            ``azure2023``.

    Returns:
        The trace, requests sorted by arrival, ``format`` set to the format read and ``path`` to ``str(path)``.

    Raises:
        TraceFormatError: unknown ``fmt``, undetectable format, or any problem listed in the module docstring.
    """
    spath = os.fspath(path)
    if fmt is not None and fmt not in _PARSERS:
        raise TraceFormatError(spath, f"unknown trace format {fmt!r}; {_FORMAT_HELP}")
    text = _read_text(spath)
    if fmt is None:
        fmt = detect_format(text, spath)
    return _PARSERS[fmt](text, spath)


def read_mooncake(path: str | os.PathLike) -> Trace:
    """Read a Mooncake JSONL trace (see the module docstring). Raises :class:`TraceFormatError`."""
    spath = os.fspath(path)
    return _parse_mooncake(_read_text(spath), spath)


def read_btb_mixed(path: str | os.PathLike) -> Trace:
    """Read a ``btb-mixed-trace-v1`` JSONL trace (see the module docstring). Raises :class:`TraceFormatError`."""
    spath = os.fspath(path)
    return _parse_btb_mixed(_read_text(spath), spath)


def read_azure(path: str | os.PathLike) -> Trace:
    """Read an Azure LLM inference 2023 CSV trace (see the module docstring). Raises :class:`TraceFormatError`."""
    spath = os.fspath(path)
    return _parse_azure(_read_text(spath), spath)


def detect_format(text: str, path: str | None = None) -> str:
    """The format of a trace's decoded ``text``, judged from its first non-empty line (rules in :func:`read_trace`).

    Raises:
        TraceFormatError: empty text ("no requests"), a first line that starts like JSON but does not parse, or a
            first line that matches no format (the message lists the valid ones).
    """
    first, lineno = None, 0
    for i, line in enumerate(text.split("\n"), 1):
        if line and not line.isspace():
            first, lineno = line.strip(), i
            break
    if first is None:
        raise TraceFormatError(path, "no requests (the file is empty)", 1)
    if first.startswith("{"):
        obj = _loads(first, path, lineno)
        if isinstance(obj, dict):
            if "arrival_s" in obj:
                return "btb-mixed-trace-v1"
            if "timestamp" in obj:  # Mooncake rows also carry hash_ids; a row without them gets "missing field"
                return "mooncake"
            keys = ", ".join(repr(k) for k in list(obj)[:8])
            raise TraceFormatError(
                path, f"unknown trace format: a JSON object with keys {keys}; {_FORMAT_HELP}", lineno
            )
    columns = [c.strip().strip('"') for c in first.split(",")]
    if "ContextTokens" in columns:
        return "azure2023"
    raise TraceFormatError(path, f"unknown trace format; {_FORMAT_HELP}", lineno)


# --------------------------------------------------------------------------------------------------------------------
# file access


def _read_text(path: str) -> str:
    """The file's text (gzip-decompressed for ``.gz``), decoded as UTF-8 with an optional BOM removed; read with
    :func:`~btbctl.engine.fileio.read_bounded` (devices refused, FIFOs never block, size bounded)."""
    from btbctl.engine.fileio import TRACE_LIMIT_BYTES, ReadRefused, read_bounded

    try:
        data = read_bounded(path, limit_bytes=TRACE_LIMIT_BYTES, gzip=path.endswith(".gz"))
    except ReadRefused as e:
        raise TraceFormatError(path, str(e)) from None
    except FileNotFoundError:
        raise TraceFormatError(path, "no such file") from None
    except IsADirectoryError:
        raise TraceFormatError(path, "is a directory, not a trace file") from None
    except PermissionError:
        raise TraceFormatError(path, "permission denied") from None
    except OSError as e:
        raise TraceFormatError(path, f"cannot read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise TraceFormatError(path, f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})", line) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    return text


def _no_requests(text: str, path: str) -> TraceFormatError:
    n_lines = text.count("\n") + (1 if text and not text.endswith("\n") else 0)
    return TraceFormatError(path, "no requests", n_lines + 1 if n_lines else 1)


# --------------------------------------------------------------------------------------------------------------------
# field checks (each returns the checked value or raises TraceFormatError naming the field)


def _json_error(e: Exception, path: str | None, lineno: int) -> TraceFormatError:
    if isinstance(e, RecursionError):
        msg = "nested too deeply"
    elif isinstance(e, json.JSONDecodeError):
        msg = f"{e.msg} at column {e.colno}"
    else:  # ValueError from an integer literal past Python's digit limit
        msg = str(e)
    return TraceFormatError(path, f"malformed JSON ({msg})", lineno)


def _loads(line: str, path: str | None, lineno: int):
    try:
        return json.loads(line)
    except (ValueError, RecursionError) as e:
        raise _json_error(e, path, lineno) from None


def _type_name(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, (int, float)):
        return f"the number {v!r}"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


#: Largest accepted ``timestamp``/``arrival_s`` value (2**53: beyond it float seconds lose integer precision).
_MAX_TIME = float(2**53)


def _time(v, name: str, scale: float, path: str, lineno: int) -> float:
    t = type(v)
    if t is not int and t is not float:
        raise TraceFormatError(path, f"{name}: expected a number, got {_type_name(v)}", lineno)
    if t is float and not math.isfinite(v):
        raise TraceFormatError(path, f"{name}: must be finite, got {v!r}", lineno)
    if v < 0:
        raise TraceFormatError(path, f"{name}: must be >= 0, got {v!r}", lineno)
    if v > _MAX_TIME:
        raise TraceFormatError(path, f"{name}: out of range (more than {_MAX_TIME:g}), got {v!r}", lineno)
    return v / scale if scale != 1.0 else float(v)


def _input_tokens(v, name: str, path: str, lineno: int) -> int:
    if type(v) is not int:
        raise TraceFormatError(path, f"{name}: expected an integer, got {_type_name(v)}", lineno)
    if v < 1:
        raise TraceFormatError(path, f"{name}: must be >= 1 token, got {v}", lineno)
    return v


def _output_tokens(v, name: str, path: str, lineno: int) -> int:
    if type(v) is not int:
        raise TraceFormatError(path, f"{name}: expected an integer, got {_type_name(v)}", lineno)
    if v < 0:
        raise TraceFormatError(path, f"{name}: must be >= 0, got {v}", lineno)
    return v if v >= 1 else 1


def _hashes(v, elem_type: type, path: str, lineno: int) -> tuple:
    """``tuple(v)`` after checking ``v`` is a list of ``elem_type``."""
    if type(v) is not list:
        raise TraceFormatError(path, f"hash_ids: expected a list, got {_type_name(v)}", lineno)
    for i, h in enumerate(v):
        if type(h) is not elem_type:
            want = "an integer" if elem_type is int else "a string"
            raise TraceFormatError(path, f"hash_ids[{i}]: expected {want}, got {_type_name(h)}", lineno)
    return tuple(v)


class _PrefixChains:
    """Checks that a trace's ``hash_ids`` are prefix-chained (:func:`btbctl.engine.chains.chain_conflict`): the
    simulators' caches and the policies rely on it. Memory: one entry per distinct id and one per row."""

    __slots__ = ("_parents", "_rows")

    def __init__(self) -> None:
        self._parents: dict = {}
        self._rows: list[tuple[int, tuple]] = []  # (line, ids) of the rows checked, to name a conflict's line

    def check(self, hashes: tuple, path: str, lineno: int) -> None:
        """Raises:
        TraceFormatError: an id of ``hashes`` follows another id than where it first appeared."""
        self._rows.append((lineno, hashes))
        bad = chain_conflict(self._parents, hashes)
        if bad is not None:
            i, prev, first_prev = bad
            h = hashes[i]
            line = next(n for n, ids in self._rows if h in ids)
            raise TraceFormatError(
                path,
                f"hash_ids[{i}]: {h!r} {follows(prev)} here but {follows(first_prev)} on line {line}; hash_ids "
                "must be prefix-chained (each id names the whole prefix through its block)",
                lineno,
            )


def _not_object(v, path: str, lineno: int) -> TraceFormatError:
    return TraceFormatError(path, f"expected a JSON object, got {_type_name(v)}", lineno)


# --------------------------------------------------------------------------------------------------------------------
# parsers


def _json_rows(text: str, path: str, fields: tuple[str, ...]):
    """``(line number, object, values of fields)`` for each non-blank line of a JSON-lines trace, after checking
    the line is a JSON object holding every one of ``fields``."""
    get = operator.itemgetter(*fields)
    loads = json.loads
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line or line.isspace():
            continue
        try:
            d = loads(line)
        except (ValueError, RecursionError) as e:
            raise _json_error(e, path, lineno) from None
        if type(d) is not dict:
            raise _not_object(d, path, lineno)
        try:
            values = get(d)
        except KeyError as e:
            raise TraceFormatError(path, f"missing field {e.args[0]!r}", lineno) from None
        yield lineno, d, values


def _parse_mooncake(text: str, path: str) -> Trace:
    requests: list[Request] = []
    append = requests.append
    chains = _PrefixChains()
    for lineno, _, (ts, inp, outp, hs) in _json_rows(
        text, path, ("timestamp", "input_length", "output_length", "hash_ids")
    ):
        # Fast path for well-formed rows; anything unusual goes through the named checks.
        if (
            type(ts) is int
            and 0 <= ts <= _MAX_TIME
            and type(inp) is int
            and inp >= 1
            and type(outp) is int
            and outp >= 1
            and type(hs) is list
        ):
            arrival_s = ts / 1000.0
            for h in hs:
                if type(h) is not int:
                    _hashes(hs, int, path, lineno)
            hashes = tuple(hs)
        else:
            arrival_s = _time(ts, "timestamp", 1000.0, path, lineno)
            inp = _input_tokens(inp, "input_length", path, lineno)
            outp = _output_tokens(outp, "output_length", path, lineno)
            hashes = _hashes(hs, int, path, lineno)
        chains.check(hashes, path, lineno)
        append(Request(str(lineno), arrival_s, inp, outp, hashes))
    if not requests:
        raise _no_requests(text, path)
    return Trace(requests, MOONCAKE_BLOCK_TOKENS, "mooncake", path, prefix_chained=True)


def _parse_btb_mixed(text: str, path: str) -> Trace:
    requests: list[Request] = []
    append = requests.append
    seen_ids: dict[str, int] = {}
    block_tokens: int | None = None
    block_line = 0
    # Equal hash strings share one object: a Bursted window repeats each burst's 256 prefix hashes 500 times.
    same = {}.setdefault
    chains = _PrefixChains()
    for lineno, d, (arrival, inp, outp, hs, rid) in _json_rows(
        text, path, ("arrival_s", "input_length", "output_length", "hash_ids", "request_id")
    ):
        arrival_s = _time(arrival, "arrival_s", 1.0, path, lineno)
        inp = _input_tokens(inp, "input_length", path, lineno)
        outp = _output_tokens(outp, "output_length", path, lineno)
        _hashes(hs, str, path, lineno)
        hashes = tuple(map(same, hs, hs))
        chains.check(hashes, path, lineno)
        trid = type(rid)
        if trid is int:
            rid = str(rid)
        elif trid is not str:
            raise TraceFormatError(path, f"request_id: expected a string, got {_type_name(rid)}", lineno)
        if not rid:
            raise TraceFormatError(path, "request_id: must not be empty", lineno)
        first = seen_ids.setdefault(rid, lineno)
        if first != lineno:
            raise TraceFormatError(path, f"request_id: duplicate {rid!r} (first seen on line {first})", lineno)

        labels: dict | None = None
        kind = "background"
        meta = d.get("metadata")
        if meta is not None:
            if type(meta) is not dict:
                raise TraceFormatError(path, f"metadata: expected an object, got {_type_name(meta)}", lineno)
            if meta:
                jk = meta.get("job_kind")
                if jk is not None:
                    if type(jk) is not str:
                        raise TraceFormatError(
                            path, f"metadata.job_kind: expected a string, got {_type_name(jk)}", lineno
                        )
                    kind = jk
                if len(meta) > (1 if "job_kind" in meta else 0):
                    labels = {k: v for k, v in meta.items() if k != "job_kind"}
        for key in ("trace_id", "source"):
            if key in d:
                if labels is None:
                    labels = {}
                labels[key] = d[key]

        for key in ("block_tokens", "block_size"):
            if key in d:
                bt = d[key]
                if type(bt) is not int or bt < 1:
                    raise TraceFormatError(path, f"{key}: expected an integer >= 1, got {_type_name(bt)}", lineno)
                if block_tokens is None:
                    block_tokens, block_line = bt, lineno
                elif bt != block_tokens:
                    raise TraceFormatError(
                        path,
                        f"{key}: {bt} differs from the block size {block_tokens} given on line {block_line}",
                        lineno,
                    )
        append(Request(rid, arrival_s, inp, outp, hashes, kind, labels))
    if not requests:
        raise _no_requests(text, path)
    return Trace(requests, block_tokens or BTB_MIXED_BLOCK_TOKENS, "btb-mixed-trace-v1", path, prefix_chained=True)


_TS_RE = re.compile(r"\s*(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,12}))?\s*\Z")
_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_INT_RE = re.compile(r"\s*(-?\d{1,18})\s*\Z")


def _parse_azure(text: str, path: str) -> Trace:
    import csv
    import io

    reader = csv.reader(io.StringIO(text, newline=""))
    header: list[str] | None = None
    header_line = 0
    for row in reader:
        if row and any(c.strip() for c in row):
            header = [c.strip() for c in row]
            header_line = reader.line_num
            break
    if header is None:
        raise _no_requests(text, path)
    cols = []
    for name in _AZURE_COLUMNS:
        if name not in header:
            raise TraceFormatError(path, f"missing column {name!r} in the CSV header", header_line)
        cols.append(header.index(name))
    i_ts, i_ctx, i_gen = cols
    width = max(cols) + 1

    days_cache: dict[tuple[str, str, str], int] = {}
    rows: list[tuple[str, int, float, int, int]] = []  # (request_id, whole seconds, fraction, input, output)
    ts_match = _TS_RE.match
    int_match = _INT_RE.match
    prev_line = header_line
    try:
        for row in reader:
            lineno = prev_line + 1  # the row's first physical line
            prev_line = reader.line_num
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if len(row) < width:
                raise TraceFormatError(path, f"expected {len(header)} columns, got {len(row)}", lineno)
            m = ts_match(row[i_ts])
            if m is None:
                raise TraceFormatError(
                    path, f"TIMESTAMP: expected 'YYYY-MM-DD HH:MM:SS[.fraction]', got {row[i_ts]!r}", lineno
                )
            y, mo, dd, hh, mi, ss, frac = m.groups()
            key = (y, mo, dd)
            days = days_cache.get(key)
            if days is None:
                try:
                    days = date(int(y), int(mo), int(dd)).toordinal()
                except ValueError as e:
                    raise TraceFormatError(path, f"TIMESTAMP: {e} in {row[i_ts]!r}", lineno) from None
                days_cache[key] = days
            h, mn, s = int(hh), int(mi), int(ss)
            if h > 23 or mn > 59 or s > 59:
                raise TraceFormatError(path, f"TIMESTAMP: time of day out of range in {row[i_ts]!r}", lineno)
            whole = days * 86400 + h * 3600 + mn * 60 + s
            fraction = int(frac) / 10 ** len(frac) if frac else 0.0
            mc = int_match(row[i_ctx])
            if mc is None:
                raise TraceFormatError(path, f"ContextTokens: expected an integer, got {row[i_ctx]!r}", lineno)
            mg = int_match(row[i_gen])
            if mg is None:
                raise TraceFormatError(path, f"GeneratedTokens: expected an integer, got {row[i_gen]!r}", lineno)
            inp = _input_tokens(int(mc.group(1)), "ContextTokens", path, lineno)
            outp = _output_tokens(int(mg.group(1)), "GeneratedTokens", path, lineno)
            rows.append((str(lineno), whole, fraction, inp, outp))
    except csv.Error as e:
        raise TraceFormatError(path, f"malformed CSV ({e})", prev_line + 1) from None
    if not rows:
        raise _no_requests(text, path)
    w0, f0 = min((r[1], r[2]) for r in rows)
    requests = [Request(rid, (w - w0) + (f - f0), inp, outp, ()) for rid, w, f, inp, outp in rows]
    return Trace(requests, AZURE_BLOCK_TOKENS, "azure2023", path, prefix_chained=True)


_PARSERS: dict[str, Callable[[str, str], Trace]] = {
    "mooncake": _parse_mooncake,
    "btb-mixed-trace-v1": _parse_btb_mixed,
    "azure2023": _parse_azure,
}
