"""The gateway's prompt-to-chain fast path agrees with the shared hashing module."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from btbctl.engine import hashing
from btbctl.engine.gateway.prompt import (
    PromptError,
    chain_from_packed,
    output_tokens_of,
    prompt_of,
    render_chat,
)


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=300), page=st.integers(1, 20))
def test_text_chain_matches_shared_hashing(text, page):
    data, n = prompt_of("generate", {"text": text})
    toks = hashing.text_to_tokens(text)
    assert n == len(toks)
    assert chain_from_packed(data, page) == tuple(hashing.chain_hashes(toks, page))


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 2**32 - 1), max_size=200), page=st.integers(1, 16))
def test_input_ids_chain_matches_shared_hashing(ids, page):
    data, n = prompt_of("generate", {"input_ids": ids, "text": "ignored when ids are given"})
    assert n == len(ids)
    assert chain_from_packed(data, page) == tuple(hashing.chain_hashes(ids, page))


def test_routes_pick_their_prompt_field():
    page = 2
    text = "hello world, a prompt long enough"
    want = tuple(hashing.chain_hashes(hashing.text_to_tokens(text), page))
    assert chain_from_packed(prompt_of("completions", {"prompt": text})[0], page) == want
    assert chain_from_packed(prompt_of("completions", {"prompt": [text, "other"]})[0], page) == want
    assert chain_from_packed(prompt_of("generate", {"text": [text]})[0], page) == want
    ids = list(range(10))
    want_ids = tuple(hashing.chain_hashes(ids, page))
    assert chain_from_packed(prompt_of("completions", {"prompt": ids})[0], page) == want_ids
    assert chain_from_packed(prompt_of("completions", {"prompt": [ids]})[0], page) == want_ids
    assert chain_from_packed(prompt_of("generate", {"input_ids": [ids]})[0], page) == want_ids
    msgs = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi "}, {"type": "image_url"}, {"type": "text", "text": "there"}],
        },
    ]
    assert render_chat(msgs) == "system: be brief\nuser: hi there\n"
    chat = chain_from_packed(prompt_of("chat", {"messages": msgs})[0], page)
    assert chat == tuple(hashing.chain_hashes(hashing.text_to_tokens(render_chat(msgs)), page))


@pytest.mark.parametrize(
    "route,body,word",
    [
        ("generate", {}, "text"),
        ("generate", {"text": 5}, "text"),
        ("generate", {"input_ids": "abc"}, "input_ids"),
        ("generate", {"input_ids": [1, "x"]}, "input_ids"),
        ("generate", {"input_ids": [1.5]}, "input_ids"),
        ("generate", {"input_ids": [1, -1]}, "[0, 2^32)"),  # not a token; modulo 2^32 it would be another prompt's
        ("generate", {"input_ids": [2**32 + 9]}, "[0, 2^32)"),
        ("completions", {"text": "x"}, "prompt"),
        ("completions", {"prompt": {"a": 1}}, "prompt"),
        ("chat", {"prompt": "x"}, "messages"),
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": ["hi"]}, "messages[0]"),
        ("chat", {"messages": [{"content": "x"}]}, "role"),
    ],
)
def test_bad_prompts_name_the_field(route, body, word):
    with pytest.raises(PromptError) as e:
        prompt_of(route, body)
    assert word in str(e.value)


def test_output_tokens():
    assert output_tokens_of("generate", {"sampling_params": {"max_new_tokens": 7}}) == 7
    assert output_tokens_of("generate", {}) == 128
    assert output_tokens_of("completions", {"max_tokens": 3}) == 3
    assert output_tokens_of("chat", {"max_completion_tokens": 9, "max_tokens": 2}) == 9
    assert output_tokens_of("generate", {"sampling_params": {"max_new_tokens": "x"}}) == 1
