"""The worker's model driver on an injected clock: scaled real time, zero-delay mode, copies in and out."""

import asyncio

import pytest

from btbctl.engine.worker.config import make_config
from btbctl.engine.worker.model import BlocksLost, ModelDriver, NoRoom

PAGE = 256


def chain(tag, n):
    return [f"{tag}{k:04x}" for k in range(n)]


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def driver(zero=False, scale=1.0):
    clock = FakeClock()
    cfg = make_config(model_path="llama-3.3-70b", tp_size=4, page_size=PAGE, zero_delay=zero, time_scale=scale)
    return ModelDriver(cfg, clock=clock), clock


async def test_zero_delay_finishes_a_request_at_once_and_caches_its_prefix():
    m, _ = driver(zero=True)
    lr = m.submit(chain("a", 40), 40 * PAGE, 4, "r1")
    assert lr.first.done() and lr.done.done() and lr.cached_tokens == 0
    assert lr.ttft_model_s == pytest.approx(m.cost.prefill_time_s(8192) + m.cost.prefill_time_s(2048, 8192))
    again = m.submit(chain("a", 40), 40 * PAGE, 4, "r2")
    assert again.cached_tokens == 40 * PAGE - 1 and again.ttft_model_s < lr.ttft_model_s
    assert m.cached_blocks(chain("a", 40)) == 40 and not m.busy()
    assert m.prefixes(5) == [{"hash": "a0027", "blocks": 40}]
    assert m.cache_hit_rate() == pytest.approx((40 * PAGE - 1) / (80 * PAGE))


async def test_scaled_time_fires_the_first_token_when_the_clock_reaches_it():
    m, clock = driver(scale=2.0)  # two model seconds per wall second
    lr = m.submit(chain("a", 128), 128 * PAGE, 1, "r1")  # four 8192-token chunks
    ttft_model = m.cost.prefill_time_s(8192) + sum(m.cost.prefill_time_s(8192, 8192 * k) for k in (1, 2, 3))
    assert m.next_event_s() is not None and not lr.first.done()
    clock.t += ttft_model / 2 * 0.99
    m.sync()
    assert not lr.first.done() and m.state().running == 1
    clock.t += ttft_model / 2 * 0.02
    m.sync()
    assert lr.first.done() and lr.done.done()
    assert lr.ttft_model_s == pytest.approx(ttft_model)
    assert m.next_event_s() is None and m.state().running == 0


async def test_a_sender_waits_for_blocks_the_model_is_still_computing():
    m, clock = driver(scale=1.0)
    c = chain("a", 64)
    m.submit(c, 64 * PAGE, 1, "r1")
    with pytest.raises(BlocksLost):
        await m.wait_blocks(chain("b", 4), 1, 1.0)  # nobody computes these
    waiter = asyncio.ensure_future(m.wait_blocks(c, 40, 5.0))
    await asyncio.sleep(0)
    assert not waiter.done()
    clock.t += 10.0  # far past the whole prefill
    m.sync()
    assert await waiter == 64


async def test_incoming_copy_holds_a_request_until_it_ends():
    m, _ = driver(zero=True)
    c = chain("a", 16)
    inc = m.begin_copy(c)
    assert m.pending_blocks(c) == 16 and m.cached_blocks(c) == 0
    lr = m.submit(c + chain("x", 1), 17 * PAGE, 1, "r1")
    assert not lr.first.done()  # waits for the copy
    assert m.end_copy(inc, True) is True and m.end_copy(inc, True) is False
    assert lr.done.done() and lr.cached_tokens == 16 * PAGE
    with pytest.raises(NoRoom):
        m.begin_copy(chain("big", m.capacity_tokens // PAGE + 1))


async def test_abort_of_a_decoding_request_frees_it():
    m, clock = driver(scale=1.0)
    lr = m.submit(chain("a", 4), 4 * PAGE, 100000, "r1")
    clock.t += 5.0
    m.sync()
    assert lr.first.done() and not lr.done.done()
    assert m.abort(lr) is True and lr.done.done() and m.abort(lr) is False
    assert m.state().running == 0
