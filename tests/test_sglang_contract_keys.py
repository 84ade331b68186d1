"""Contract: btbctl's page keys equal SGLang 0.5.23's own key functions, and SGLang's backend factory loads
``BtbL3Store`` from the flag's JSON. Runs only under a Python with SGLang (``scripts/sglang-venv.sh``)."""

from __future__ import annotations

import json
from array import array

import pytest

pytestmark = pytest.mark.sglang
pytest.importorskip(
    "sglang.srt.mem_cache.utils",
    reason="SGLang is not importable in this interpreter; run the contract tests with the python "
    "printed by scripts/sglang-venv.sh (pytest -m sglang)",
)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str, storage_namespace_seed  # noqa: E402

from btbctl.sglang_l3 import BtbL3Store, namespace_seed, page_keys  # noqa: E402

_tokens = st.lists(
    st.one_of(st.integers(0, 200_000), st.integers(0, (1 << 32) - 1), st.integers(1 << 32, (1 << 63) - 1)),
    min_size=0,
    max_size=200,
)
_parts = st.one_of(st.none(), st.text(max_size=12))


def _sglang_keys(ids, page_size, extra_key, cache_salt):
    key = RadixKey(array("q", ids), extra_key=extra_key, cache_salt=cache_salt)
    return get_storage_hash_str(key, None, page_size=page_size)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ids=_tokens, page_size=st.sampled_from([1, 2, 3, 16, 64]), extra_key=_parts, cache_salt=_parts)
def test_page_keys_equal_sglangs(ids, page_size, extra_key, cache_salt):
    """Random prompts (ids above 2**32 included), page sizes, LoRA extra keys and cache salts: same keys."""
    assert page_keys(ids, page_size, extra_key, cache_salt) == _sglang_keys(ids, page_size, extra_key, cache_salt)


@settings(max_examples=100, deadline=None)
@given(extra_key=_parts, cache_salt=_parts)
def test_namespace_seed_equals_sglangs(extra_key, cache_salt):
    seed = namespace_seed(extra_key, cache_salt)
    ref = storage_namespace_seed(extra_key, cache_salt)
    assert (seed.hex() if seed is not None else None) == ref


def test_long_prompt_keys_equal_sglangs():
    ids = [(i * 7919) % 150_000 for i in range(65_536)]
    assert page_keys(ids, 64) == _sglang_keys(ids, 64, None, None)


def _config(extra: dict) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="m",
        extra_config=extra,
    )


def test_sglang_factory_loads_btb_l3_store_from_the_flag_json(tmp_path):
    flag = json.dumps(
        {
            "backend_name": "btb",
            "module_path": "btbctl.sglang_l3",
            "class_name": "BtbL3Store",
            "interface_v1": 1,
            "agent_socket": str(tmp_path / "a.sock"),
            "timeout_s": 0.5,
        }
    )
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    extra, *_ = HybridCacheController.parse_storage_backend_extra_config(flag)
    backend = StorageBackendFactory.create_backend("dynamic", _config(extra), None)
    assert isinstance(backend, BtbL3Store) and isinstance(backend, HiCacheStorage)
    assert backend.socket_path == str(tmp_path / "a.sock") and backend.timeout_s == 0.5 and backend.interface_v1


def test_factory_refuses_a_bad_extra_config_with_one_line():
    with pytest.raises(ValueError) as ei:  # noqa: PT011 - the message is checked below
        StorageBackendFactory.create_backend(
            "dynamic",
            _config(
                {
                    "backend_name": "btb",
                    "module_path": "btbctl.sglang_l3",
                    "class_name": "BtbL3Store",
                    "agent_sokcet": "/x",
                }
            ),
            None,
        )
    assert "agent_sokcet" in str(ei.value) and "agent_socket" in str(ei.value) and "\n" not in str(ei.value)
