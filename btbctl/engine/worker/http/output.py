"""The synthetic output of a generation: the generated text (:data:`TOKEN_TEXT` per token, cut at stop strings as
SGLang cuts) and deterministic logprobs in OpenAI's and SGLang's shapes."""

from __future__ import annotations

import math

#: Synthetic text of one generated token.
TOKEN_TEXT = " tok"
#: Token id reported for :data:`TOKEN_TEXT` in logprobs (SGLang's ``output_token_logprobs``).
TOKEN_ID = 11059
#: Runner-up tokens of the synthetic ``top_logprobs`` (text, id), most likely first.
ALT_TOKENS = ((" the", 279), (" a", 264), (" to", 311), (" and", 323), (" of", 315), (" in", 304), (" is", 374))


class Output:
    """The text one choice produces: :data:`TOKEN_TEXT` repeated, cut at the first stop string as SGLang does.

    Attributes:
        tokens: tokens decoded (``max_new``, or fewer when a stop string completed earlier).
        cut: characters of the text kept (the stop string itself is trimmed), None when no stop string matched.
        matched: the stop string that ended the text (SGLang's ``matched_stop`` / ``finish_reason.matched``).
    """

    def __init__(self, max_new: int, stops: list[str]) -> None:
        self.tokens = max_new
        self.cut: int | None = None
        self.matched: str | None = None
        full = TOKEN_TEXT * max_new
        best: tuple[int, int, str] | None = None  # (tokens decoded when it completed, position, stop)
        step = len(TOKEN_TEXT)
        for stop in stops:
            i = full.find(stop)
            if i >= 0:
                done = -(-(i + len(stop)) // step)
                if best is None or (done, i) < best[:2]:
                    best = (done, i, stop)
        if best is not None:
            self.tokens, self.cut, self.matched = best

    def text(self, k: int) -> str:
        """The text after ``k`` tokens."""
        t = TOKEN_TEXT * k
        return t if self.cut is None else t[: self.cut]

    @property
    def finish_reason(self) -> str:
        """OpenAI's ``finish_reason``."""
        return "length" if self.matched is None else "stop"

    def sglang_finish(self) -> dict:
        """SGLang's ``meta_info.finish_reason``."""
        if self.matched is None:
            return {"type": "length", "length": self.tokens}
        return {"type": "stop", "matched": self.matched}


def token_logprob(i: int) -> float:
    """Deterministic, plausible logprob of the ``i``-th generated token (probability 0.6 to 0.98)."""
    p = 0.6 + 0.38 * ((i * 0.6180339887) % 1.0)
    return round(math.log(p), 6)


def top_logprobs(i: int, n: int) -> list[tuple[str, int, float]]:
    """``n`` most likely tokens at position ``i`` as ``(text, id, logprob)``: the generated one, then runners-up
    sharing the rest of the probability (halving each), so the probabilities never sum above 1."""
    lp = token_logprob(i)
    out = [(TOKEN_TEXT, TOKEN_ID, lp)]
    rest = 1.0 - math.exp(lp)
    for j, (t, tid) in enumerate(ALT_TOKENS[: max(0, n - 1)]):
        out.append((t, tid, round(math.log(rest * 0.5 ** (j + 1)), 6)))
    return out[:n]


def openai_logprobs(lo: int, hi: int, top: int, chat: bool, offset: int) -> dict:
    """OpenAI's ``logprobs`` of tokens ``lo..hi-1`` (chat: ``{"content": [...]}``; completions: ``tokens``,
    ``token_logprobs``, ``top_logprobs``, ``text_offset``)."""
    if chat:
        content = []
        for i in range(lo, hi):
            tops = top_logprobs(i, top)
            content.append(
                {
                    "token": TOKEN_TEXT,
                    "logprob": token_logprob(i),
                    "bytes": list(TOKEN_TEXT.encode()),
                    "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, _, lp in tops],
                }
            )
        return {"content": content}
    n = hi - lo
    return {
        "tokens": [TOKEN_TEXT] * n,
        "token_logprobs": [token_logprob(i) for i in range(lo, hi)],
        "top_logprobs": [{t: lp for t, _, lp in top_logprobs(i, top)} for i in range(lo, hi)] if top else None,
        "text_offset": [offset + (i - lo) * len(TOKEN_TEXT) for i in range(lo, hi)],
    }


def sglang_logprobs(lo: int, hi: int, top: int, with_text: bool) -> dict:
    """SGLang's ``meta_info`` logprob fields of output tokens ``lo..hi-1`` (``[logprob, token_id, text|None]``);
    no input-token logprobs (the emulated worker has no model to score the prompt with)."""

    def entry(t: str, tid: int, lp: float) -> list:
        return [lp, tid, t if with_text else None]

    return {
        "input_token_logprobs": [],
        "output_token_logprobs": [entry(TOKEN_TEXT, TOKEN_ID, token_logprob(i)) for i in range(lo, hi)],
        "input_top_logprobs": [],
        "output_top_logprobs": [[entry(*x) for x in top_logprobs(i, top)] for i in range(lo, hi)] if top else [],
    }


__all__ = [
    "ALT_TOKENS",
    "TOKEN_ID",
    "TOKEN_TEXT",
    "Output",
    "openai_logprobs",
    "sglang_logprobs",
    "token_logprob",
    "top_logprobs",
]
