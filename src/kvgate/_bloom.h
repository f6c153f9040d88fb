/* RecentKeys' filter arithmetic, shared by the two CPython extensions that probe it (_recent.c: the Python
 * policies' probes; _mini.c: the compiled miniature caches' own filters).  Same hash, same bits as the Python
 * path in kvgate/tiers/eviction.py: Python's hash of the identity mixed by splitmix64's finalizer; probe k of
 * BLOOM_HASHES at (h1 + k * h2) mod the filter's bits, h1 the low half, h2 the high half made odd. */
#ifndef KVGATE_BLOOM_H
#define KVGATE_BLOOM_H

#include <stdint.h>

#define BLOOM_HASHES 4

static inline void bloom_mix(uint64_t h, uint64_t *h1, uint64_t *h2)
{
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ULL;
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBULL;
    h ^= h >> 31;
    *h1 = h & 0xFFFFFFFFULL;
    *h2 = (h >> 32) | 1;
}

static inline int bloom_has(const unsigned char *bits, uint64_t nbits, uint64_t h1, uint64_t h2)
{
    for (uint64_t k = 0; k < BLOOM_HASHES; k++) {
        uint64_t i = (h1 + k * h2) % nbits;
        if (!((bits[i >> 3] >> (i & 7)) & 1))
            return 0;
    }
    return 1;
}

static inline void bloom_set(unsigned char *bits, uint64_t nbits, uint64_t h1, uint64_t h2)
{
    for (uint64_t k = 0; k < BLOOM_HASHES; k++) {
        uint64_t i = (h1 + k * h2) % nbits;
        bits[i >> 3] |= (unsigned char)(1u << (i & 7));
    }
}

#endif
