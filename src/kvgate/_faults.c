/* Faults in a client's in-place region: survived where the gateway copies or hashes under a guard, named in
 * the log where it does not.
 *
 * Loaded with ctypes (no Python headers: plain C) by kvgate.memguard, which calls the guarded copies, and by
 * kvgate.gateway.faultlog, which fills a fixed table with the address range and a preformatted label of each
 * in-place region it maps (kvgate.gateway.shm).  A client that shrinks such a file under the mapping makes
 * the next load or store there a SIGBUS.
 *
 * Guarded: kvgate_guarded_copy (memcpy) and kvgate_guarded_update (a hash's update function, e.g. XXH3's)
 * mark their thread as guarded and set a jump point first; the handler, finding the thread guarded, jumps
 * back there and the call returns -1: that request fails (kvgate.memguard raises MemoryFault), the gateway
 * and every other request go on.  Jumping out of memcpy or a hash update leaves nothing half-done that
 * anyone else shares: neither takes a lock, and the caller drops the destination and the hash state.
 * sigsetjmp saves the signal mask, so the signal is unblocked again after the jump.
 *
 * Unguarded: the handler finds the faulting address in the table, write()s one line naming the session,
 * its client's pid and the region's file, then hands the signal on: to the handler installed before
 * (faulthandler's, which dumps every thread's Python stack) or to the default action, so the process still
 * dies of that signal.
 *
 * Only async-signal-safe calls in the handler (write, sigaction, raise, siglongjmp).  The guard is one
 * thread-local pointer of the initial-exec model (static TLS: reading it in the handler allocates nothing).
 * The table is written by Python threads (one at a time: the caller holds a lock) while a handler on
 * another thread may read it: each slot carries a sequence count, odd while it is being written, read
 * before and after, so a torn read is skipped (a slot being rewritten is a region being mapped or
 * unmapped: no request can be in it).
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define SLOTS 1024
#define LABEL 480

struct slot {
    volatile uint64_t seq;
    volatile uintptr_t start, end;
    volatile char label[LABEL];
};

static struct slot table[SLOTS];
static struct sigaction before[2]; /* SIGBUS, SIGSEGV */
static volatile int installed;
static int log_fd = 2;
/* The jump point of the guarded call running on this thread; NULL when none is.  Volatile: nothing the
 * compiler sees reads it between the calls' two stores (only the handler does), which it would drop. */
static __thread sigjmp_buf *volatile guard __attribute__((tls_model("initial-exec")));

int kvgate_fault_slots(void) { return SLOTS; }
int kvgate_fault_label_bytes(void) { return LABEL; }

static void store(int i, uintptr_t start, uintptr_t end, const char *label) {
    struct slot *s = &table[i];
    s->seq++; /* odd: being written */
    __sync_synchronize();
    s->start = 0;
    s->end = 0;
    size_t n = label ? strnlen(label, LABEL - 1) : 0;
    for (size_t k = 0; k < n; k++) s->label[k] = label[k];
    s->label[n] = 0;
    s->start = start;
    s->end = end;
    __sync_synchronize();
    s->seq++;
}

void kvgate_fault_set(int i, uintptr_t start, uintptr_t end, const char *label) {
    if (i >= 0 && i < SLOTS) store(i, start, end, label);
}

void kvgate_fault_clear(int i) {
    if (i >= 0 && i < SLOTS) store(i, 0, 0, "");
}

static size_t put(char *buf, size_t at, size_t cap, const char *s) {
    while (*s && at < cap) buf[at++] = *s++;
    return at;
}

static size_t hex(char *buf, size_t at, size_t cap, uintptr_t v) {
    char tmp[2 + 2 * sizeof v];
    int n = 0;
    do { tmp[n++] = "0123456789abcdef"[v & 15]; v >>= 4; } while (v);
    at = put(buf, at, cap, "0x");
    while (n && at < cap) buf[at++] = tmp[--n];
    return at;
}

static int lookup(uintptr_t addr, char *label) {
    for (int i = 0; i < SLOTS; i++) {
        struct slot *s = &table[i];
        uint64_t seq = s->seq;
        if (seq & 1) continue;
        __sync_synchronize();
        uintptr_t start = s->start, end = s->end;
        if (!(start <= addr && addr < end)) continue;
        for (int k = 0; k < LABEL; k++) label[k] = s->label[k];
        label[LABEL - 1] = 0;
        __sync_synchronize();
        if (s->seq == seq) return 1;
    }
    return 0;
}

static void on_fault(int sig, siginfo_t *info, void *ctx) {
    sigjmp_buf *jump = guard;  /* (a copy: guard is cleared before the jump) */
    if (jump) {
        guard = NULL;
        siglongjmp(*jump, 1);
    }
    char line[LABEL + 256], label[LABEL];
    size_t n = 0, cap = sizeof line - 1;
    uintptr_t addr = (uintptr_t)info->si_addr;
    n = put(line, n, cap, sig == SIGBUS ? "kvgate: SIGBUS at " : "kvgate: SIGSEGV at ");
    n = hex(line, n, cap, addr);
    if (lookup(addr, label)) {
        n = put(line, n, cap, " in the in-place region of ");
        n = put(line, n, cap, label);
        n = put(line, n, cap, sig == SIGBUS ? ": its client shrank the file under the mapping"
                                            : ": the address is no longer mapped");
        n = put(line, n, cap, "; the gateway dies (in_place_regions: false guards against this)\n");
    } else {
        n = put(line, n, cap, ": not in a client's in-place region\n");
    }
    ssize_t w = write(log_fd, line, n);
    (void)w;
    struct sigaction *old = &before[sig == SIGBUS ? 0 : 1];
    if ((old->sa_flags & SA_SIGINFO) && old->sa_sigaction) {
        old->sa_sigaction(sig, info, ctx);
        return;
    }
    if (!(old->sa_flags & SA_SIGINFO) && old->sa_handler != SIG_DFL && old->sa_handler != SIG_IGN) {
        old->sa_handler(sig);
        return;
    }
    /* The default action: blocked until this handler returns, then delivered (a fault also repeats). */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    raise(sig);
}

/* Whether the handler is installed: the guarded calls below guard nothing before (they return -2). */
int kvgate_fault_installed(void) { return installed; }

/* memcpy(dst, src, n) that a fault on either side ends: 0, or -1 (a page of either is gone; dst holds an
 * unknown part of src), or -2 (no handler installed: nothing copied). */
int kvgate_guarded_copy(void *dst, const void *src, size_t n) {
    if (!installed) return -2;
    sigjmp_buf jump;
    if (sigsetjmp(jump, 1)) return -1;
    guard = &jump;
    memcpy(dst, src, n);
    guard = NULL;
    return 0;
}

/* kvgate_guarded_copy of n spans, each (destination, source, length) in spans[3i .. 3i+2]: one call for a
 * whole scatter-gather copy.  0, -1 (a fault: the spans after it are not copied) or -2 (no handler). */
int kvgate_guarded_copy_spans(const uintptr_t *spans, size_t n) {
    if (!installed) return -2;
    sigjmp_buf jump;
    if (sigsetjmp(jump, 1)) return -1;
    guard = &jump;
    for (size_t i = 0; i < n; i++)
        memcpy((void *)spans[3 * i], (const void *)spans[3 * i + 1], (size_t)spans[3 * i + 2]);
    guard = NULL;
    return 0;
}

typedef int (*update_fn)(void *state, const void *src, size_t n);

/* update(state, src, n) (XXH3_64bits_update, say) that a fault in src ends: update's own result, or -1 (a
 * page of src is gone; state is spoilt), or -2 (no handler installed: nothing hashed). */
int kvgate_guarded_update(update_fn update, void *state, const void *src, size_t n) {
    if (!installed) return -2;
    sigjmp_buf jump;
    if (sigsetjmp(jump, 1)) return -1;
    guard = &jump;
    int r = update(state, src, n);
    guard = NULL;
    return r;
}

typedef int (*reset_fn)(void *state);
typedef uint64_t (*digest_fn)(const void *state);

/* reset, update and digest of state over src (XXH3_64bits_reset, _update, _digest, say) in one call, under
 * the guard: 0 with the digest in *out, or -1 (a page of src is gone), or -2 (no handler installed). */
int kvgate_guarded_hash(reset_fn reset, update_fn update, digest_fn digest, void *state, const void *src,
                        size_t n, uint64_t *out) {
    if (!installed) return -2;
    sigjmp_buf jump;
    if (sigsetjmp(jump, 1)) return -1;
    guard = &jump;
    reset(state);
    update(state, src, n);
    *out = digest(state);
    guard = NULL;
    return 0;
}

/* Install the handler for SIGBUS and SIGSEGV (once); lines go to fd.  0, or -1 with errno. */
int kvgate_fault_install(int fd) {
    if (installed) return 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    log_fd = fd;
    if (sigaction(SIGBUS, &sa, &before[0]) != 0) return -1;
    if (sigaction(SIGSEGV, &sa, &before[1]) != 0) return -1;
    installed = 1;
    return 0;
}
