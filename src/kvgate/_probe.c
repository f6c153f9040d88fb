/* The probe of kvgate.tiers.rows' open-addressing tables, for a whole batch of digests in one call.
 *
 * Loaded with ctypes (no Python headers: plain C) by kvgate.tiers.rows, whose numpy probe it replaces where
 * it is built: a lookup of 1,000 keys spends a few microseconds here where the numpy rounds took 100-200
 * (each round is some twenty numpy calls of fixed cost).  The table layout is rows.py's, documented there:
 * a slot holds its row's number + 1 (int32), 0 is empty and ends a probe run, a negative slot (an old
 * table's moved slot) is probed past; a digest's home slot is its low half & mask.
 *
 * Reads only: the caller (the event loop, the table's one owner) keeps the arrays alive and unchanged for
 * the call.  Nothing here allocates, blocks or calls back.
 */
#include <stdint.h>

static int64_t probe(const int32_t *slots, uint64_t mask, const uint64_t *los, const uint64_t *his,
                     uint64_t lo, uint64_t hi)
{
    for (uint64_t i = lo & mask;; i = (i + 1) & mask) {
        int32_t v = slots[i];
        if (v == 0)
            return -1;
        if (v > 0 && los[v - 1] == lo && his[v - 1] == hi)
            return (int64_t)v - 1;
    }
}

/* out[j] = the row of digest j (its halves at lo[j * lo_step], hi[j * hi_step]: the two columns of an
 * (n, 2) digest array, or arrays of their own), -1 where absent; found in ``slots`` first, then in ``old``
 * (NULL where the table is not migrating).  ``los`` and ``his`` are the table's digest columns by row. */
void kvgate_probe_many(const int32_t *slots, uint64_t mask, const int32_t *old, uint64_t old_mask,
                       const uint64_t *los, const uint64_t *his, const uint64_t *lo, int64_t lo_step,
                       const uint64_t *hi, int64_t hi_step, int64_t n, int64_t *out)
{
    for (int64_t j = 0; j < n; j++) {
        uint64_t l = lo[j * lo_step], h = hi[j * hi_step];
        int64_t r = probe(slots, mask, los, his, l, h);
        if (r < 0 && old)
            r = probe(old, old_mask, los, his, l, h);
        out[j] = r;
    }
}
