"""Block hashes exactly as vLLM 0.32 makes them, for plain text prompts.

Mirrors ``vllm/v1/core/kv_cache_utils.py`` (``init_none_hash``, ``hash_block_tokens``,
``get_request_block_hasher``) and ``vllm/utils/hashing.py`` of vLLM 0.32, read from the package:

- Only FULL blocks of ``block_size`` tokens are hashed; a prompt's last partial block has none.
- Block ``i``'s hash is ``H((parent, tuple(tokens of block i), extra_keys))`` where ``parent`` is block
  ``i-1``'s hash, and for the first block ``NONE_HASH = H(seed)``.  ``extra_keys`` is None for a plain
  text prompt (no LoRA, no multimodal input, no cache_salt, no prompt embeddings).
- ``H`` is the engine's ``prefix_caching_hash_algo``: ``sha256`` (pickle protocol 5, then SHA-256, 32
  bytes), ``sha256_cbor`` (canonical CBOR, then SHA-256), ``xxhash`` (pickle, then XXH3-128, 16 bytes),
  ``xxhash_cbor`` (CBOR, then XXH3-128).
- The seed: the engine's ``PYTHONHASHSEED`` when set; otherwise ``"vllm-none-hash"`` for the sha256
  algorithms, and fresh random bytes per process for the xxhash ones (a router cannot reproduce those:
  the engine must be started with ``PYTHONHASHSEED``, and the router given the same value).

An engine agrees with the router only when algorithm, seed and block size are the same; the block size
is checked against the engines' events, and so are algorithm and seed: a prompt's first block comes with
its tokens, which the router hashes and compares (``kvgate.routing.feeds``); the front also checks what
the engine reports (``kvgate.routing.endpoints``).

KV events carry vLLM's hashes as ``int`` by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the low
64 bits, big-endian) or as the raw bytes; ``block_key`` maps both to the same int, which is what the
index (``kvgate.routing.index``) keys on.

Speed (measured on this project's 2-core build machine, Python 3.11): sha256 with pickle costs about
2.5 us a block, so a 32K-token prompt (2048 blocks of 16) takes about 5 ms from scratch (7 ms while
filling the cache).  That is inherent in vLLM's definition (one pickle and one SHA-256 per block), so
``BlockHasher`` keeps an LRU of ``(parent, tokens) -> hash``: a prompt that extends one seen before (a
chat's next turn, a shared system prompt) pays the full price only for its new blocks; the same 32K
prompt again takes about 2 ms (the tuple of each block's tokens and the dict lookup).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvgate.errors import InvalidArgument

__all__ = ["ALGOS", "DEFAULT_NONE_HASH_SEED", "BlockHasher", "block_key", "offload_keys", "hash_function"]

ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
# vLLM's fixed seed of NONE_HASH for the cryptographic algorithms when PYTHONHASHSEED is not set.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_NON_CRYPTO = frozenset({"xxhash", "xxhash_cbor"})
_LOW64 = (1 << 64) - 1


def _cbor_dumps() -> Callable[[Any], bytes]:
    try:
        import cbor2
    except ImportError:
        raise InvalidArgument("the sha256_cbor and xxhash_cbor block hash algorithms need the cbor2 package "
                              "(the one vLLM uses): pip install cbor2") from None
    return lambda obj: cbor2.dumps(obj, canonical=True)


def _xxh3_128() -> Callable[[bytes], bytes]:
    import xxhash  # a kvgate dependency
    return xxhash.xxh3_128_digest


def hash_function(algo: str) -> Callable[[Any], bytes]:
    """vLLM's ``get_hash_fn_by_name(algo)``: the function of one Python object to its digest.

    Raises InvalidArgument for an algorithm vLLM 0.32 does not offer, or for a CBOR one without cbor2."""
    if algo == "sha256":
        dumps = pickle.dumps
        sha = hashlib.sha256
        return lambda obj: sha(dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    if algo == "sha256_cbor":
        cbor = _cbor_dumps()
        return lambda obj: hashlib.sha256(cbor(obj)).digest()
    if algo == "xxhash":
        xx = _xxh3_128()
        return lambda obj: xx(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    if algo == "xxhash_cbor":
        cbor, xx = _cbor_dumps(), _xxh3_128()
        return lambda obj: xx(cbor(obj))
    raise InvalidArgument(f"unknown block hash algorithm {algo!r}: vLLM's prefix_caching_hash_algo is one of "
                          f"{', '.join(ALGOS)}")


def block_key(block_hash: bytes | int) -> int:
    """The index's key of a block hash: its low 64 bits, as vLLM's KV events send it by default
    (``int.from_bytes(hash, "big") & (2**64 - 1)``); an int (already converted by the engine) is kept."""
    if isinstance(block_hash, int):
        return block_hash & _LOW64
    return int.from_bytes(block_hash[-8:], "big")


def offload_keys(hashes: Sequence[bytes], group_idx: int = 0, factor: int = 1) -> list[bytes]:
    """vLLM's offloading keys of a prompt's block hashes for KV cache group ``group_idx``.

    The offloading connector stores chunks of ``factor`` GPU blocks (``blocks_per_chunk``, the block size
    factor); a chunk is keyed by the hash of its LAST block plus the group index as 4 bytes big-endian
    (``make_offload_key`` in vllm/v1/kv_offload/base.py; the chunking is ``update_offload_keys`` of the
    connector's scheduler: ``islice(block_hashes, factor - 1, None, factor)``).  Only full chunks have keys.
    """
    if factor < 1:
        raise InvalidArgument(f"offload_keys: factor is the GPU blocks per offloaded block, at least 1, got {factor}")
    if not 0 <= group_idx < 1 << 32:
        raise InvalidArgument(f"offload_keys: group_idx must fit 4 unsigned bytes, got {group_idx}")
    suffix = group_idx.to_bytes(4, "big")
    return [bytes(h) + suffix for h in hashes[factor - 1::factor]]


class BlockHasher:
    """A prompt's block hashes as a vLLM 0.32 engine with the same settings computes them.

    ``algo``: the engine's ``--prefix-caching-hash-algo``.  ``block_size``: its ``--block-size`` (the
    hash block size; 16 by default).  ``seed``: the engine's PYTHONHASHSEED; None means "as vLLM without
    one": this process's PYTHONHASHSEED if set, else vLLM's fixed default seed for the sha256 algorithms.
    An xxhash algorithm with no seed is refused (InvalidArgument): vLLM seeds it randomly per process.
    ``cache_size``: blocks kept in the LRU of ``(parent, tokens) -> hash`` (0: none); at 2048 blocks a
    32K-token prompt, the default keeps about 64 such prompts (measured: about 50 MB when full).

    Not thread-safe (the LRU); the router calls it from its event loop.
    """

    def __init__(self, algo: str = "sha256", block_size: int = 16, seed: str | None = None,
                 cache_size: int = 131_072) -> None:
        if block_size < 1:
            raise InvalidArgument(f"block_size must be at least 1 token, got {block_size}")
        self._hash = hash_function(algo)
        if seed is None:
            seed = os.environ.get("PYTHONHASHSEED")
        if seed is None:
            if algo in _NON_CRYPTO:
                raise InvalidArgument(
                    f"block hash algorithm {algo}: vLLM seeds it with random bytes per process unless "
                    f"PYTHONHASHSEED is set, so no router can reproduce its hashes; start the engines with "
                    f"PYTHONHASHSEED=<value> and give the router the same seed")
            seed = DEFAULT_NONE_HASH_SEED
        self.algo = algo
        self.block_size = block_size
        self.seed = seed
        self.none_hash: bytes = self._hash(seed)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[bytes, tuple[int, ...]], bytes] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """The hashes of every full block of ``token_ids`` (a plain text prompt's token ids), in order."""
        bs = self.block_size
        n = len(token_ids) // bs
        out: list[bytes] = []
        parent = self.none_hash
        h = self._hash
        cache = self._cache
        size = self.cache_size
        for i in range(n):
            block = tuple(token_ids[i * bs:(i + 1) * bs])
            if size:
                k = (parent, block)
                got = cache.get(k)
                if got is not None:
                    cache.move_to_end(k)
                    self.hits += 1
                    parent = got
                    out.append(got)
                    continue
            # vLLM: hash_function((parent_block_hash, curr_block_token_ids_tuple, extra_keys))
            parent = h((parent, block, None))
            out.append(parent)
            if size:
                self.misses += 1
                cache[k] = parent
                if len(cache) > size:
                    cache.popitem(last=False)
        return out

    def keys(self, token_ids: Sequence[int]) -> list[int]:
        """``block_key`` of each of ``hashes(token_ids)``: what the index and the scorer take."""
        return [int.from_bytes(h[-8:], "big") for h in self.hashes(token_ids)]
