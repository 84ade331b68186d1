"""Request limits shared by the gateway and the emulated worker: one definition, so the gateway never accepts a
body or a prompt that the workers behind it would refuse after the gateway already paid for hashing it."""

from __future__ import annotations

#: Largest request body, bytes (8 MiB: a 2M-token text prompt, or about 1M token ids as JSON). The gateway's
#: default ``max_body_bytes`` and the emulated worker's limit; larger bodies get 413.
MAX_REQUEST_BODY_BYTES = 8 << 20
#: Longest prompt, tokens (above any preset's KV capacity per request anyway). The gateway answers 413 beyond it
#: before hashing the prompt; the emulated worker refuses it too.
MAX_PROMPT_TOKENS = 4 << 20

__all__ = ["MAX_PROMPT_TOKENS", "MAX_REQUEST_BODY_BYTES"]
