"""An emulated SGLang worker for machines without GPUs (``btbctl worker``).

It speaks SGLang 0.5's HTTP API (:mod:`btbctl.engine.worker.http`), takes its timing and prefix-cache behaviour
from the simulator's replica model driven in real time (:mod:`btbctl.engine.worker.model`), keeps a KV block store
of real bytes (:mod:`btbctl.engine.worker.store`) and sends/receives prefix copies over the transfer port
(:mod:`btbctl.engine.worker.copies`, :mod:`btbctl.engine.replication.tcp`); :mod:`btbctl.engine.worker.core` puts
the parts together, :mod:`btbctl.engine.worker.metrics` exports them, :mod:`btbctl.engine.worker.server` runs the
process.

Process interface::

    btbctl worker --model-path M [--served-model-name N] [--model-preset llama-3.3-70b] [--tp-size 4]
                  [--host 127.0.0.1] [--port 30000] [--mem-fraction-static 0.9] [--page-size 256]
                  [--chunked-prefill-size N] [--max-running-requests 256] [--enable-metrics] [--gpu h100]
                  [--time-scale 1.0] [--zero-delay] [--kv-bytes-scale 65536] [--transfer-port 0]
                  [--btb-token-file PATH]

``--port 0`` and ``--transfer-port 0`` bind ephemeral ports. Once both listen it prints exactly one line on stdout::

    ready http://HOST:PORT transfer HOST:TPORT

``/health`` and ``/health_generate`` answer 503 until then (and while stopping). SIGTERM/SIGINT stop it
gracefully (exit status 0). ``--time-scale 0`` is the same as ``--zero-delay``.

Prompts become tokens as the gateway's do (:mod:`btbctl.engine.hashing`): ``input_ids`` when given, else
pseudo-tokens of ``text`` (chat: the messages joined as ``"role: content\\n"``); the chain is the hashes of the
full pages of ``page_size`` tokens. ``cached_tokens`` is the model's (SGLang's rule: at most prompt - 1).

SGLang routes: ``POST /generate`` (``text`` | ``input_ids``, ``sampling_params.max_new_tokens`` default 128,
``stream``, ``rid``; streaming chunks carry the cumulative ``text`` and ``meta_info``, then ``data: [DONE]``),
``POST /v1/completions``, ``POST /v1/chat/completions`` (OpenAI shapes, ``usage.prompt_tokens_details.
cached_tokens``, ``stream_options.include_usage``), ``GET /v1/models``, ``GET /health``, ``GET /health_generate``,
``GET /server_info`` (``/get_server_info``), ``GET /model_info`` (``/get_model_info``), ``GET /version``,
``GET|POST /flush_cache`` (400 while requests run or copies are in flight), ``GET /v1/loads``, ``GET /metrics``
(only with ``--enable-metrics``; SGLang metric names; a registry per worker).

BTB routes (JSON):

* ``POST /btb/match {"chain": [hex, ...]}`` -> ``{"cached_blocks": int, "pending_blocks": int}`` (pending also
  counts blocks being prefilled here, arriving by copy, or to be computed by a request queued here).
* ``GET /btb/prefixes?limit=N`` (default 20, at most 10000) -> ``{"prefixes": [{"hash": str, "blocks": int}]}``:
  the deepest block of each resident chain, most recently used first.
* ``GET /btb/info`` -> ``{"transfer_addr", "page_size", "kv_bytes_per_token", "block_bytes", "model",
  "model_preset", "gpu", "tp_size", "capacity_tokens", "transport", "time_scale", "zero_delay"}``.
* ``POST /btb/push {"chain": [...], "target": "host:port", "copy_id": "..."}`` -> 202 ``{"copy_id", "blocks",
  "bytes", "blocks_available"}``; 409 when this worker neither holds nor computes the whole chain (pending blocks
  as ``/btb/match`` counts them) or the copy id is in progress; 400 bad body; 401/403 without the right
  ``Authorization: Bearer <token>`` when a token is configured. ``copy_id`` is optional (a random hex id is made)
  and has 1..128 characters of ``[A-Za-z0-9._:-]``. A push may start while this worker still computes the chain:
  the copy trails its prefill, each block sent as soon as the model commits it (at a prefill chunk's end); the
  answer comes once the target accepted the copy (it then counts the blocks as arriving, so requests there wait
  for them) or at most 2 s later. If this worker evicts the blocks or stops, the copy fails and the target stays
  cold; the target serves the chain as cached only after every block arrived and verified.
* ``GET /btb/copies/{copy_id}[?wait_s=S]`` -> ``{"copy_id", "role": "source"|"target", "state":
  "running"|"done"|"failed", "bytes_sent", "bytes_total", "blocks_verified", "blocks_available", "error",
  "started_s", "finished_s", "peer", "blocks"}`` (Unix times; a source reports ``done`` only after the target
  acknowledged that every block arrived, verified and was committed; ``blocks_available``: blocks the source has
  computed so far). With ``wait_s`` (0..10 s) and ``since`` (the ``X-BTB-Copy-Version`` header of a previous
  answer) a copy still running is answered at the worker's next copy change after that version, or after
  ``wait_s`` (long poll; such answers carry ``X-BTB-Long-Poll: 1`` and the current ``X-BTB-Copy-Version``).
  ``GET /btb/copies`` -> ``{"copies": [...]}`` newest first.

Writes guarded by ``--btb-token-file``: ``/btb/push`` and ``/flush_cache``.
"""

from btbctl.engine.worker.config import WorkerConfig, make_config

__all__ = ["WorkerConfig", "make_config"]
