"""btbctl's HiCache L3 backend for stock SGLang workers, and SGLang's page keys.

* :class:`BtbL3Store` (:mod:`btbctl.sglang_l3.store`): the ``HiCacheStorage`` subclass SGLang loads with
  ``--hicache-storage-backend dynamic`` and ``module_path: "btbctl.sglang_l3"``. Imported on first attribute access,
  because it needs SGLang and torch: ``import btbctl.sglang_l3`` itself stays light.
* :func:`page_keys`, :class:`Namespace` (:mod:`btbctl.sglang_l3.keys`): SGLang's page keys and the store's
  object-key namespace.
* :mod:`btbctl.sglang_l3.client`, :mod:`btbctl.sglang_l3.wire`: the local protocol to the node's ``btbctl agent``.

This package is imported inside SGLang's scheduler process: it uses only the standard library, numpy/torch (from
SGLang) and nothing else of btbctl (no aiohttp, pydantic, typer; no ``btbctl.engine``).
"""

from __future__ import annotations

from btbctl.sglang_l3.keys import Namespace, namespace_seed, object_key, page_keys


def __getattr__(name: str):
    if name == "BtbL3Store":
        from btbctl.sglang_l3.store import BtbL3Store

        return BtbL3Store
    raise AttributeError(f"module 'btbctl.sglang_l3' has no attribute {name!r}")


__all__ = ["BtbL3Store", "Namespace", "namespace_seed", "object_key", "page_keys"]
