"""SGLang page keys without SGLang: vectors computed with SGLang 0.5.23's own ``get_storage_hash_str`` (the contract
test ``test_sglang_contract_keys.py`` checks random ones against SGLang itself), input checks, the namespace id, and
the import weight of ``btbctl.sglang_l3``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from btbctl.sglang_l3 import Namespace, page_keys
from btbctl.sglang_l3.keys import is_page_key, object_key

# (token ids, page size, extra_key, cache_salt) -> SGLang 0.5.23's keys
VECTORS = [
    (
        (list(range(8)), 4, None, None),
        [
            "baed642339816affb3fe8719792d0e4ce82f12db72b7373d244eaa65445800fe",
            "01414b052706d93bd0f1f1646c0e8ca2fa8ef5efd7bcc99f7a1cee8eb11ad052",
        ],
    ),
    (
        ([1, 2**32 + 5, 3, 4], 2, None, None),  # the first page has an id above 2**32: hashed as tagged uint64
        [
            "269d1ae392f226199950f0f71ddb666ca1c324a7b85356e97f95ea0d7e7fdfd1",
            "ef6f21d86a314f0a51ba7b28ebd207fa887f97d2db5c5efb8f728fab0c0d58b3",
        ],
    ),
    (
        (list(range(5)), 4, "lora-a", "salt"),  # namespace seed; a trailing partial page
        [
            "a86add17a19b2e0e414a4ef838a99ec17fd12c729b88181292cb3412a1262cce",
            "1e17238738d9da723e17b98dc20cf7de6364d82f7f7339a973ff8b29742c3020",
        ],
    ),
    (([7], 1, None, ""), ["e8613f5a5bc9f9feeda32a8e7c80b69dd4878e47b6a91723fb15eb84236b6a2b"]),  # "" salt = none
    (([7], 1, "", None), ["ccebe2b7d30a246d9bcd13917aae98a4aed2d8cae78a9d3acae6c49872c95602"]),  # "" key counts
]


@pytest.mark.parametrize("args,want", VECTORS)
def test_page_keys_match_sglang_vectors(args, want):
    assert page_keys(*args) == want


def test_page_keys_chain_and_inputs():
    ids = list(range(64))
    assert page_keys(ids, 16)[:2] == page_keys(ids[:32], 16)  # a key names its whole prefix
    assert page_keys([], 4) == []
    assert all(is_page_key(k) for k in page_keys(ids, 7))
    with pytest.raises(ValueError, match="page_size"):
        page_keys(ids, 0)
    with pytest.raises(ValueError, match="outside"):
        page_keys([-1], 1)
    with pytest.raises(ValueError, match="outside"):
        page_keys([1 << 63], 1)
    with pytest.raises(TypeError):
        page_keys([1.5], 1)


def _ns(**kw) -> Namespace:
    base = {
        "model": "llama",
        "tp_size": 4,
        "tp_rank": 1,
        "pp_size": 1,
        "pp_rank": 0,
        "cp_size": 1,
        "cp_rank": 0,
        "page_size": 64,
        "layout": "page_first",
        "kv_dtype": "torch.bfloat16",
        "page_bytes": 1 << 20,
        "interface": "v1",
        "sglang_version": "0.5.23",
    }
    base.update(kw)
    return Namespace(**base)


def test_namespace_id_separates_every_incompatibility():
    ref = _ns()
    assert Namespace.from_dict(json.loads(json.dumps(ref.describe()))).ns_id == ref.ns_id
    for change in (
        {"tp_rank": 2},
        {"tp_size": 8},
        {"page_size": 32},
        {"layout": "layer_first"},
        {"kv_dtype": "torch.float8_e4m3fn"},
        {"interface": "generic"},
        {"sglang_version": "0.5.24"},
        {"model": "qwen"},
        {"page_bytes": 2 << 20},
        {"pp_rank": 1},
    ):
        assert _ns(**change).ns_id != ref.ns_id, change
    assert object_key(ref.ns_id, "ab").startswith(ref.ns_id + ".")
    with pytest.raises(ValueError, match="unknown namespace fields"):
        Namespace.from_dict({**ref.describe(), "extra": 1})


def test_sglang_l3_imports_only_light_modules():
    probe = (
        "import sys, json; import btbctl.sglang_l3, btbctl.sglang_l3.client, btbctl.sglang_l3.wire; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('aiohttp','pydantic','typer','rich','textual','torch','sglang','prometheus_client') "
        "or m.startswith('btbctl.engine') or m.startswith('btbctl.commands'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []
