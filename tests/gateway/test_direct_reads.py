"""Cold restores into a registered /dev/shm region, as vLLM's CPU tier is, against a real gateway:
the device writes the region around the page cache (O_DIRECT), and every byte is right."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from kvgate.bench.harness import ShmRegion
from kvgate.cards.directory.directio import SUPPORTED
from kvgate.client import Client
from tests.helpers import evict, pages_cached

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

STEP = 1 << 20
SIZES = [STEP] * 7 + [STEP - 100]  # the last one ends inside a block: its tail goes through scratch


@pytest.mark.skipif(not SUPPORTED or pages_cached(__file__) is None, reason="no O_DIRECT or cachestat(2)")
def test_cold_get_into_a_registered_region_reads_around_the_page_cache(gateway_factory) -> None:
    gw = gateway_factory(["--max-bytes", "0"])  # no RAM tier: every get reads the card
    region = ShmRegion(len(SIZES) * STEP)
    rows = [region.view[i * STEP : i * STEP + n] for i, n in enumerate(SIZES)]
    try:
        ref = np.random.default_rng(7).integers(0, 256, region.size, dtype=np.uint8)
        region.array[:] = ref
        keys = [f"direct-{i}".encode() for i in range(len(SIZES))]
        with Client.connect(gw.socket, namespace="direct", timeout=20) as c:
            c.register_region(region.path, mapping=region.view)
            assert all(c.put_many(keys, rows, retention="long"))
            files = glob.glob(os.path.join(gw.card, "db*", "*", "*"))
            assert len(files) == len(SIZES)
            for f in files:
                evict(f)
            if any(pages_cached(f) for f in files):
                pytest.skip("this filesystem keeps the files cached")
            region.array[:] = 0
            got = c.get_many(keys, into=rows)
            assert [None if g is None else g.nbytes for g in got] == SIZES
            got = None
            for i, n in enumerate(SIZES):
                start = i * STEP
                assert np.array_equal(region.array[start : start + n], ref[start : start + n]), f"object {i}"
                assert not region.array[start + n : (i + 1) * STEP].any(), f"bytes past object {i} were written"
            assert all(pages_cached(f) == 0 for f in files)
        with Client.connect(gw.socket, role="admin", want_shm=False, timeout=20) as admin:
            card = admin.stats()["cards"][0]
        assert card["direct_read_bytes_per_second"] > 0
        assert card["hits"] == len(SIZES)
    finally:
        for v in rows:
            v.release()
        region.close()
