/* Scatter-gather memcpy of a whole batch in one call, for a client copying a get's pieces out of the gateway's
 * RAM arena, mapped read-only in the client (kvgate.client.crossmem).
 *
 * Loaded with ctypes (no Python headers: plain C) through kvgate.native; ctypes releases the GIL for the call.
 * Unguarded: the arena is a sealed memfd nobody can shrink, and the destinations are the caller's own memory,
 * checked before the call.  Without it, crossmem copies span by span with ctypes.memmove (a Python step each:
 * about 1 us, as much as copying 8 KiB). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* memcpy of n spans, each (destination, source, length) in spans[3i .. 3i+2]. */
void kvgate_copy_spans(const uint64_t *spans, size_t n) {
    for (size_t i = 0; i < n; i++)
        memcpy((void *)(uintptr_t)spans[3 * i], (const void *)(uintptr_t)spans[3 * i + 1], (size_t)spans[3 * i + 2]);
}
