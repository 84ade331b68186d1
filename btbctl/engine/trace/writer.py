"""Write a :class:`Trace` as ``btb-mixed-trace-v1`` JSONL (REFERENCE.md s3), the format
:func:`btbctl.engine.trace.readers.read_btb_mixed` reads back.

One JSON object per request, in arrival order, keys in this order::

    {"arrival_s": 20.123456, "input_length": 65792, "output_length": 1, "hash_ids": ["x42:b0p0", ...],
     "request_id": "burst0-0", "trace_id": "bursted-seed42", "source": "synthetic",
     "metadata": {"job_kind": "burst", "burst": 0}, "block_tokens": 512}

* ``arrival_s`` is written with Python's shortest round-trip float repr, so reading it back gives the same float
  bit for bit (no rounding here; the generator rounds to microseconds when it draws arrivals).
* ``hash_ids`` are strings: string hashes as they are, others (Mooncake ints) as ``str(h)``. Generated hashes
  never consist of digits only, so a Mooncake trace with a Bursted overlay keeps its hashes distinct.
* ``labels["trace_id"]`` and ``labels["source"]`` become the top-level ``trace_id``/``source``; every other label
  goes into ``metadata`` next to ``job_kind`` (= :attr:`Request.kind`); a label named ``job_kind`` is dropped.
* ``block_tokens`` is written only when the trace's block size is not the format's default of 256.

Round trip: ``read_btb_mixed(path)`` returns requests equal to the written ones in ``request_id``, ``arrival_s``,
``input_tokens``, ``output_tokens``, ``block_hashes`` (as strings), ``kind`` and ``labels`` (JSON-valued labels; an
empty label dict reads back as None), and the same ``block_tokens``.
"""

from __future__ import annotations

import json
import os

from btbctl.engine.errors import BtbctlError
from btbctl.engine.trace.model import Trace
from btbctl.engine.trace.readers import BTB_MIXED_BLOCK_TOKENS


def write_btb_mixed(trace: Trace, path: str | os.PathLike) -> int:
    """Write ``trace`` to ``path`` as ``btb-mixed-trace-v1`` JSONL (gzip-compressed when ``path`` ends in ``.gz``).

    The file is written to ``<path>.tmp`` first and renamed into place, so a failed write leaves no partial file.

    Returns:
        The number of rows written (``len(trace)``).

    Raises:
        BtbctlError: the file cannot be written (message names the path and the reason).
    """
    spath = os.fspath(path)
    extra = {} if trace.block_tokens == BTB_MIXED_BLOCK_TOKENS else {"block_tokens": trace.block_tokens}
    dumps = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(", ", ": ")).encode
    tmp = spath + ".tmp"
    try:
        if spath.endswith(".gz"):
            import gzip

            f = gzip.open(tmp, "wt", encoding="utf-8", newline="\n")
        else:
            f = open(tmp, "w", encoding="utf-8", newline="\n")
        with f:
            write = f.write
            for r in trace.requests:
                hs = r.block_hashes
                row = {
                    "arrival_s": r.arrival_s,
                    "input_length": r.input_tokens,
                    "output_length": r.output_tokens,
                    "hash_ids": [h if type(h) is str else str(h) for h in hs],
                    "request_id": r.request_id,
                }
                metadata = {"job_kind": r.kind}
                if r.labels:
                    for key, value in r.labels.items():
                        if key == "trace_id" or key == "source":
                            row[key] = value
                        elif key != "job_kind":
                            metadata[key] = value
                row["metadata"] = metadata
                if extra:
                    row.update(extra)
                write(dumps(row))
                write("\n")
        os.replace(tmp, spath)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise BtbctlError(f"{spath}: cannot write the trace: {e.strerror or e}") from None
    return len(trace.requests)
