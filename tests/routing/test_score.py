"""Scorer: prefix matching per tier, costs that order endpoints, the load vs cache trade-off."""

from __future__ import annotations

import pytest

from kvgate.errors import InvalidArgument
from kvgate.kvevents.wire import AllBlocksCleared, BlockStored, EventBatch
from kvgate.routing.hashing import BlockHasher
from kvgate.routing.index import KvIndex
from kvgate.routing.score import DEFAULT_LOAD_COSTS, DEFAULT_TIER_COSTS, Endpoint, Scorer, best

HASHES = BlockHasher("sha256", 16, seed="0").hashes(list(range(16 * 100)))
N = len(HASHES)


def put(idx: KvIndex, source: str, hashes, medium: str = "GPU", topic: str = "") -> None:
    idx.apply(source, topic, EventBatch(0.0, [BlockStored(block_hashes=list(hashes), parent_block_hash=None,
                                                          token_ids=[], block_size=16, lora_id=None,
                                                          medium=medium, lora_name=None)]))


def fleet() -> tuple[KvIndex, list[Endpoint]]:
    idx = KvIndex()
    put(idx, "e-gpu", HASHES[:60])  # 60 on GPU
    put(idx, "e-ram", HASHES[:10])  # 10 on GPU, then its gateway's RAM to 90
    put(idx, "g-ram", HASHES[:90], "CPU", "kvgate")
    put(idx, "g-card", HASHES[:20], "CPU", "kvgate")  # 20 in RAM, then a card to 100
    put(idx, "g-card", HASHES, "STORAGE", "kvgate@card:C1")
    put(idx, "e-hole", HASHES[:5] + HASHES[6:80])  # block 5 missing: only 5 count
    eps = [Endpoint("gpu", engine="e-gpu"), Endpoint("ram", engine="e-ram", gateway="g-ram"),
           Endpoint("card", engine="e-card", gateway="g-card"), Endpoint("hole", engine="e-hole"),
           Endpoint("cold", engine="e-cold")]
    return idx, eps


def test_each_tier_is_credited_along_the_longest_held_prefix() -> None:
    idx, eps = fleet()
    s = {x.endpoint: x for x in Scorer(idx).score(HASHES, eps)}
    assert (s["gpu"].gpu, s["gpu"].cpu, s["gpu"].storage, s["gpu"].prefill) == (60, 0, 0, 40)
    assert (s["ram"].gpu, s["ram"].cpu, s["ram"].storage, s["ram"].prefill) == (10, 80, 0, 10)
    assert (s["card"].gpu, s["card"].cpu, s["card"].storage, s["card"].prefill) == (0, 20, 80, 0)
    assert (s["hole"].matched, s["hole"].prefill) == (5, 95)
    assert (s["cold"].matched, s["cold"].prefill) == (0, 100)
    t = DEFAULT_TIER_COSTS
    assert s["card"].cost == pytest.approx(20 * t["cpu"] + 80 * t["storage"])
    assert s["ram"].cost == pytest.approx(10 + 80 * t["cpu"])
    # 10 recomputed blocks and 80 RAM copies (18) beat 20 RAM copies and 80 card reads (22), then 40 to compute
    order = [x.endpoint for x in sorted(Scorer(idx).score(HASHES, eps), key=lambda x: x.cost)]
    assert order == ["ram", "card", "gpu", "hole", "cold"]
    assert best(Scorer(idx).score(HASHES, eps)).endpoint == "ram"


def test_the_same_scores_from_int_keys_and_for_a_prompt_nobody_holds() -> None:
    idx, eps = fleet()
    keys = BlockHasher("sha256", 16, seed="0").keys(list(range(16 * 100)))
    assert Scorer(idx).score(keys, eps) == Scorer(idx).score(HASHES, eps)
    other = BlockHasher("sha256", 16, seed="1").hashes(list(range(64)))
    assert all(x.matched == 0 and x.prefill == 4 and x.cost == 4 for x in Scorer(idx).score(other, eps))
    assert Scorer(idx).score([], eps)[0].prefill == 0


def test_a_card_mounted_by_two_gateways_counts_for_both_and_a_named_card_too() -> None:
    idx = KvIndex()
    put(idx, "g1", HASHES[:30], "STORAGE", "kvgate@card:S")
    put(idx, "g2", HASHES[:30], "STORAGE", "kvgate@card:S")
    eps = [Endpoint("a", gateway="g1"), Endpoint("b", gateway="g2"), Endpoint("c", cards=("S",)),
           Endpoint("d", gateway="g3")]
    got = [x.storage for x in Scorer(idx).score(HASHES, eps)]
    assert got == [30, 30, 30, 0]


def test_a_gateway_that_pulls_counts_its_peers_ram_and_cards_as_storage() -> None:
    idx = KvIndex()
    put(idx, "g-a", HASHES[:30], "CPU", "kvgate")  # peer A's RAM: the first 30
    put(idx, "g-a", HASHES[30:50], "STORAGE", "kvgate@card:CA")  # A's card: the next 20
    put(idx, "g-b", HASHES[:10], "CPU", "kvgate")  # B's own RAM: 10
    alone = Endpoint("b", gateway="g-b")
    pulling = Endpoint("b-pulls", gateway="g-b", peers=("g-a", "g-b"))  # its own id among them is ignored
    a, p = Scorer(idx).score(HASHES, [alone, pulling])
    assert (a.cpu, a.storage, a.prefill) == (10, 0, 90)
    assert (p.cpu, p.storage, p.prefill) == (10, 40, 50)  # its own RAM first, then what a pull brings


def test_load_trades_against_cache() -> None:
    idx, _ = fleet()
    warm = Endpoint("warm", engine="e-gpu", running=2, waiting=1)  # 40 to compute, busy
    cold = Endpoint("cold", engine="e-cold")  # 100 to compute, idle
    s = Scorer(idx).score(HASHES, [warm, cold])
    assert s[0].cost == 40 + 2 * DEFAULT_LOAD_COSTS["running"] + DEFAULT_LOAD_COSTS["waiting"]  # 80
    assert best(s).endpoint == "warm"
    warm.waiting = 3  # 144: the queue outweighs 60 cached blocks
    assert best(Scorer(idx).score(HASHES, [warm, cold])).endpoint == "cold"
    # the knobs move the balance: queued requests made cheap, the cache wins again
    assert best(Scorer(idx, load_costs={"waiting": 1}).score(HASHES, [warm, cold])).endpoint == "warm"


def test_a_long_prefill_ahead_sends_a_cached_prompt_where_it_restores_instead() -> None:
    idx, eps = fleet()
    gpu = Endpoint("gpu", engine="e-gpu", running=1, prefill_ahead=90)  # 40 left, behind a 90-block prefill
    card = Endpoint("card", engine="e-card", gateway="g-card")  # 20 in RAM, 80 from its card, idle
    s = Scorer(idx).score(HASHES, [gpu, card])
    assert s[0].cost == 40 + DEFAULT_LOAD_COSTS["running"] + 90 * DEFAULT_LOAD_COSTS["prefill_ahead"]  # 134
    assert s[1].cost == pytest.approx(20 * DEFAULT_TIER_COSTS["cpu"] + 80 * DEFAULT_TIER_COSTS["storage"])  # 22
    assert best(s).endpoint == "card"
    gpu.prefill_ahead = 0  # through that prefill: 44 against the card's 22
    assert best(Scorer(idx).score(HASHES, [gpu, card])).endpoint == "card"  # 44 vs 22: still the card
    gpu.running = 0
    assert Scorer(idx).score(HASHES, [gpu, card])[0].cost == 40


def test_ties_go_to_more_matched_then_the_first_and_costs_are_checked() -> None:
    idx, _ = fleet()
    a, b = Endpoint("a", engine="e-cold"), Endpoint("b", engine="e-cold")
    assert best(Scorer(idx).score(HASHES, [a, b])).endpoint == "a"
    with pytest.raises(InvalidArgument, match="unknown key 'ram'"):
        Scorer(idx, tier_costs={"ram": 0.1})
    with pytest.raises(InvalidArgument, match="must be a number >= 0"):
        Scorer(idx, load_costs={"running": -1})
    with pytest.raises(InvalidArgument, match="no endpoint"):
        best([])


def test_scores_follow_the_index_as_it_changes() -> None:
    idx, eps = fleet()
    sc = Scorer(idx)
    assert sc.score(HASHES, eps[:1])[0].gpu == 60
    idx.apply("e-gpu", "", EventBatch(0.0, [AllBlocksCleared()]))
    assert sc.score(HASHES, eps[:1])[0].gpu == 0
    put(idx, "new-gw", HASHES[:50], "STORAGE", "kvgate@card:N")  # a new source and mount: new columns
    assert sc.score(HASHES, [Endpoint("n", gateway="new-gw")])[0].storage == 50


def _reference(idx: KvIndex, hashes, ep: Endpoint) -> tuple[int, int, int]:
    """The definition, block by block: (gpu, cpu, storage) along the longest prefix held by any tier."""
    cards = set(ep.cards) | (idx.mounts(ep.gateway) if ep.gateway else set())
    gpu = cpu = sto = 0
    for h in hashes:
        if ep.engine and idx.holds(ep.engine, "GPU", h):
            gpu += 1
        elif any(s and idx.holds(s, "CPU", h) for s in (ep.engine, ep.gateway)):
            cpu += 1
        elif any(idx.holds(f"card:{c}", "STORAGE", h) for c in cards):
            sto += 1
        else:
            break
    return gpu, cpu, sto


@pytest.mark.parametrize("seed", range(5))
def test_matches_the_block_by_block_definition_on_random_holdings(seed: int) -> None:
    import random
    rng = random.Random(seed)
    idx = KvIndex()
    eps = []
    for e in range(12):
        for src, medium, topic in ((f"e{e}", "GPU", ""), (f"e{e}", "CPU", ""), (f"g{e}", "CPU", "t")):
            if rng.random() < 0.7:
                n = rng.randrange(N)
                held = [h for h in HASHES[:n] if rng.random() < 0.97]  # prefixes, with a few holes
                put(idx, src, held, medium, topic)
        for c in rng.sample(range(4), rng.randrange(3)):
            put(idx, f"g{e}", HASHES[:rng.randrange(N)], "STORAGE", f"t@card:C{c}")
        eps.append(Endpoint(f"ep{e}", engine=f"e{e}", gateway=f"g{e}", cards=(("C3",) if e % 5 == 0 else ())))
    got = Scorer(idx).score(HASHES, eps)
    assert [(x.gpu, x.cpu, x.storage) for x in got] == [_reference(idx, HASHES, ep) for ep in eps]


def test_offloaded_chunks_keyed_by_their_last_block_count_for_the_whole_chunk() -> None:
    from kvgate.routing.hashing import offload_keys
    idx = KvIndex()
    # a gateway holding vLLM offloading keys of chunks of 4 blocks (hash of each chunk's last block)
    chunk_hashes = [k[:-4] for k in offload_keys(HASHES[:50], group_idx=0, factor=4)]  # 12 chunks: 48 blocks
    put(idx, "gw", chunk_hashes, "CPU", "kvgate")
    idx.set_factor("CPU", "gw", 4)
    put(idx, "e", HASHES[:6])
    s = Scorer(idx).score(HASHES, [Endpoint("a", engine="e", gateway="gw")])[0]
    assert (s.gpu, s.cpu, s.prefill) == (6, 42, 52)
    idx.set_factor("CPU", "gw", 1)  # read per block, only the chunk ends would count: block 0 is not held
    s = Scorer(idx).score(HASHES, [Endpoint("a", gateway="gw")])[0]
    assert s.matched == 0
    with pytest.raises(InvalidArgument, match="at least 1"):
        idx.set_factor("CPU", "gw", 0)


def test_more_runs_than_the_first_slice_still_reach_the_longest_prefix() -> None:
    idx = KvIndex()
    eps = []
    # 300 engines, engine e holding the first e+1 blocks with a hole-free prefix; each length its own run
    hashes = BlockHasher("sha256", 16, seed="0").hashes(list(range(16 * 300)))
    for e in range(300):
        put(idx, f"e{e}", hashes[:e + 1])
        eps.append(Endpoint(f"ep{e}", engine=f"e{e}"))
    got = Scorer(idx).score(hashes, eps)
    assert [x.gpu for x in got] == list(range(1, 301))
    assert [(x.gpu, x.cpu, x.storage) for x in got[::37]] == [_reference(idx, hashes, ep) for ep in eps[::37]]
