"""The worker's fast prompt hashing equals the shared definition in btbctl.engine.hashing."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from btbctl.engine import hashing
from btbctl.engine.worker.prompt import ids_chain, text_chain


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=600), st.sampled_from([1, 2, 3, 16, 64]))
def test_text_chain_matches_hashing(text, bt):
    toks = hashing.text_to_tokens(text)
    assert text_chain(text, bt) == (len(toks), hashing.chain_hashes(toks, bt))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=300), st.sampled_from([1, 4, 16, 256]))
def test_ids_chain_matches_hashing(ids, bt):
    assert ids_chain(ids, bt) == (len(ids), hashing.chain_hashes(ids, bt))


def test_long_prompt_and_exact_block_boundary():
    text = "é" * 2048  # 4096 UTF-8 bytes = 1024 tokens = exactly 4 blocks of 256
    n, chain = text_chain(text, 256)
    assert n == 1024 and len(chain) == 4
    assert chain == hashing.chain_hashes(hashing.text_to_tokens(text), 256)
