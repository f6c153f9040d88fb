"""The tier contract (``kvgate.tiers.contract``): the store is a list of tiers asked by one rule.

The RAM tier and the card tier both speak it; a third tier, a plain dict
here, added to ``TieredStore.tiers`` is asked by the same rule as they are:
lookup, exists, get, delete and the held-keys listing reach it, a ``long``
put is written through to it, and a read that a tier thought it could serve
but could not falls through to the tiers after it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from kvgate.cards import ObjectMeta
from kvgate.tiers.contract import ABSENT, PRESENT, STORAGE, GetItem, Known, PutItem, Tier
from kvgate.tiers.counters import TierCounters
from kvgate.types import Retention, SizeCode
from tests.tiers.test_store import DIALOG, fk, payload, started_store


class DictTier:
    """A tier in a dict: knows all it holds (never probes); ``stale`` keys it says it holds but has lost."""

    name = "dict"
    medium = STORAGE
    probes = False
    promote = False

    def __init__(self, keeps: frozenset[Retention] = frozenset()) -> None:
        self.keeps = keeps
        self.counters = TierCounters()
        self.objects: dict[bytes, bytes] = {}
        self.stale: set[bytes] = set()
        self.asked: list[list[bytes]] = []

    def known(self, fkeys, dialog) -> Known:
        self.asked.append(list(fkeys))
        return Known(np.array([PRESENT if k in self.objects or k in self.stale else ABSENT for k in fkeys],
                              np.int8))

    async def find(self, fkeys, dialog, urgent=False):
        return [k in self.objects for k in fkeys]

    async def probe_prefix(self, fkeys, dialog, known, start, end, urgent=False):
        return 0

    def prepare(self, fkeys, known, present, urgent=False):
        pass

    async def read_into(self, items: list[GetItem], urgent=False, own=False, gets=True):
        sizes, needed, metas = [], [], []
        for it in items:
            self.counters.gets += 1
            data = self.objects.get(it.fkey)
            if data is None:
                sizes.append(SizeCode.MISS), needed.append(0), metas.append(None)
            elif len(data) > len(it.dest):
                sizes.append(SizeCode.TOO_SMALL), needed.append(len(data)), metas.append(None)
            else:
                it.dest[: len(data)] = data
                sizes.append(len(data)), needed.append(0), metas.append(ObjectMeta(dialog=it.dialog))
        return sizes, needed, metas

    async def write(self, items: list[PutItem], retention, sources=None):
        for it in items:
            self.objects[it.fkey] = bytes(sources.get(id(it), it.src) if sources else it.src)
        return [True] * len(items)

    def sizes(self, fkeys, dialog):
        return [len(self.objects[k]) if k in self.objects else None for k in fkeys]

    async def find_sizes(self, fkeys, dialog):
        return self.sizes(fkeys, dialog)

    async def delete(self, fkeys, dialog):
        return sum(self.objects.pop(k, None) is not None for k in fkeys)

    async def clean(self):
        n = len(self.objects)
        self.objects.clear()
        return n

    async def clean_namespace(self, ns):
        return 0

    async def held_keys(self, chunk=10_000):
        keys = list(self.objects)
        for i in range(0, len(keys), chunk):
            yield self.name, keys[i : i + chunk]

    def status(self):
        return {"objects": len(self.objects)}


def test_every_tier_of_the_store_speaks_the_contract(tmp_path: Path) -> None:
    async def main() -> None:
        async with started_store(tmp_path) as store:
            assert [t.name for t in store.tiers] == ["ram", "cards"]
            assert all(isinstance(t, Tier) for t in [*store.tiers, DictTier()])
            assert [t.medium for t in store.tiers] == ["CPU", "STORAGE"]

    asyncio.run(main())


def test_a_tier_added_to_the_list_is_asked_by_the_same_rule(tmp_path: Path) -> None:
    async def main() -> None:
        async with started_store(tmp_path) as store:
            third = DictTier()
            store.tiers.append(third)
            meta = ObjectMeta(dialog=DIALOG)
            k_ram, k_card, k_third, k_none = fk(b"in-ram"), fk(b"on-card"), fk(b"in-third"), fk(b"nowhere")
            await store.put([PutItem(k_ram, memoryview(payload(b"in-ram")), meta)], Retention.SHORT)
            await store.put([PutItem(k_card, memoryview(payload(b"on-card")), meta)], Retention.LONG)
            await store.ram.delete([k_card])  # on the card only
            third.objects[k_third] = payload(b"in-third")

            keys = [k_ram, k_card, k_third]
            assert await store.lookup(keys, DIALOG) == 3
            assert await store.lookup([*keys, k_none, k_ram], DIALOG) == 3  # the rule stops at the first miss
            assert await store.exists([k_none, *keys], DIALOG) == [False, True, True, True]
            # the third tier is asked only for what the tiers before it lack
            assert all(k_ram not in asked and k_card not in asked for asked in third.asked)

            dests = [bytearray(20_000) for _ in keys]
            sizes, _needed = await store.get([GetItem(k, DIALOG, memoryview(d)) for k, d in zip(keys, dests)])
            assert sizes == [10_000] * 3
            assert [bytes(d[:10_000]) for d in dests] == [payload(b"in-ram"), payload(b"on-card"), payload(b"in-third")]
            assert third.counters.gets == 1  # only k_third reached it

            held = {tier: ks for tier, ks in [x async for x in store.held_keys()]}
            assert held["ram"] == [k_ram] and held["dict"] == [k_third]  # (card rows keep keys with events on)

            assert await store.delete([k_third], DIALOG) == 1
            assert k_third not in third.objects and await store.lookup([k_third], DIALOG) == 0

    asyncio.run(main())


def test_a_long_put_is_written_through_every_tier_that_keeps_long(tmp_path: Path) -> None:
    async def main() -> None:
        async with started_store(tmp_path) as store:
            third = DictTier(keeps=frozenset({Retention.LONG}))
            store.tiers.append(third)
            meta = ObjectMeta(dialog=DIALOG)
            k_long, k_short = fk(b"long"), fk(b"short")
            assert await store.put([PutItem(k_long, memoryview(payload(b"long")), meta)], Retention.LONG) == [True]
            assert await store.put([PutItem(k_short, memoryview(payload(b"short")), meta)], Retention.SHORT) == [True]
            assert third.objects == {k_long: payload(b"long")}  # short stays in RAM
            assert k_long in store.cards.set.layout.card_for(k_long, DIALOG).index

    asyncio.run(main())


def test_a_read_a_tier_could_not_serve_falls_through_to_the_tiers_after_it(tmp_path: Path) -> None:
    """A tier that said it held a key and then missed it (evicted between the two) does not end the get:
    the tiers after it are asked, by the same rule."""

    async def main() -> None:
        async with started_store(tmp_path) as store:
            liar = DictTier()
            store.tiers.insert(1, liar)  # between the RAM tier and the cards
            k = fk(b"moved-on")
            await store.put([PutItem(k, memoryview(payload(b"moved-on")), ObjectMeta(dialog=DIALOG))], Retention.LONG)
            await store.ram.delete([k])
            liar.stale.add(k)  # "held", and gone when read
            dest = bytearray(10_000)
            sizes, _ = await store.get([GetItem(k, DIALOG, memoryview(dest))])
            assert sizes == [10_000] and bytes(dest) == payload(b"moved-on")
            assert liar.counters.gets == 1  # it was asked first, and missed
            assert store.counters.long.hits >= 1

    asyncio.run(main())
