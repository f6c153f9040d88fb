"""SGLang's own storage-backend test, shipped in its wheel, run on KvgateHiCacheStorage against a real gateway; run with .venv-sglang/bin/python.

    python sglang_backend_contract.py SOCKET OUT.json

SGLang 0.5.23 ships one storage-backend test that runs without its backend's
own service: ``sglang.srt.mem_cache.storage.mooncake_store.test_mooncake_store``
(its ``__main__`` runs ``test_single_operation`` and ``test_batch_operation``
with four storage configs: MHA and MLA, TP 1, TP 4 rank 1, TP 8 rank 3).  Its
other backends' tests need their services or do not import (``simm`` imports
``python.sglang...``, ``aibrix_kvcache``/``eic`` need their clients).  The test
module is imported as SGLang ships it and its ``MooncakeStore`` name is bound to
a factory of ``KvgateHiCacheStorage`` for the gateway at SOCKET (the storage
config it is given, with ``{"kvgate.socket": SOCKET}`` as its extra config):
every step, mock host pool and assertion is SGLang's.

Writes {"sglang": version, "cases": {name: "ok" | "FAIL: ..."}} to OUT.json, the
cases named as SGLang's ``__main__`` runs them; the exit status is 0 whatever
they found (the test reads them).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import traceback

import sglang
from sglang.srt.mem_cache.storage.mooncake_store import test_mooncake_store as shipped

from kvgate.integrations.sglang.backend import KvgateHiCacheStorage

SOCKET = ""
stores: list[KvgateHiCacheStorage] = []


def kvgate_store(config=None, *args, **kwargs) -> KvgateHiCacheStorage:
    """What the shipped test builds as ``MooncakeStore(config)``: kvgate's backend for the same config."""
    extra = {"kvgate.socket": SOCKET, "kvgate.io_timeout": 10, "kvgate.lookup_timeout": 10}
    store = KvgateHiCacheStorage(dataclasses.replace(config, extra_config=extra))
    stores.append(store)
    return store


def main() -> None:
    global SOCKET
    SOCKET, out = sys.argv[1], sys.argv[2]
    shipped.MooncakeStore = kvgate_store
    config = shipped.make_hicache_storage_config
    runs = {
        "test_single_operation": lambda: shipped.test_single_operation(),
        "test_batch_operation[mha-tp1]": lambda: shipped.test_batch_operation(
            config(is_mla_model=False, tp_rank=0, tp_size=1)),
        "test_batch_operation[mla-tp1]": lambda: shipped.test_batch_operation(
            config(is_mla_model=True, tp_rank=0, tp_size=1)),
        "test_batch_operation[mha-tp4-rank1]": lambda: shipped.test_batch_operation(
            config(is_mla_model=False, tp_rank=1, tp_size=4)),
        "test_batch_operation[mla-tp8-rank3]": lambda: shipped.test_batch_operation(
            config(is_mla_model=True, tp_rank=3, tp_size=8)),
    }
    results: dict[str, str] = {}
    namespaces: dict[str, str] = {}
    for name, run in runs.items():
        before = len(stores)
        try:
            run()
            results[name] = "ok"
        except BaseException as e:  # noqa: BLE001 - every case is reported, the next one runs
            results[name] = f"FAIL: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
        for s in stores[before:]:
            namespaces[name] = s.namespace
            s.close()
        print(f"{name}: {results[name].splitlines()[0]}", file=sys.stderr, flush=True)
    with open(out, "w") as f:
        json.dump({"sglang": sglang.__version__, "cases": results, "namespaces": namespaces}, f)


if __name__ == "__main__":
    main()
