/* The referee's miniature caches (kvgate.tiers.referee), compiled: one C call per sampled reference.
 *
 * While a tier holds fewer than 8K blocks the referee samples every dialog, so its two miniature caches
 * replay every add and read of the tier: in Python (a PrefixPolicy in the prefix order and a DialogLru)
 * they cost 8 and 3.5 us per reference on the synthetic trace at a cache of 2 %, more than the tier's own
 * policy (benchmarks/eviction_cost.py).  ``Miniature(order, ...)`` is either of them, evicting exactly as
 * the Python class does (tests/tiers/test_eviction.py replays random runs through both and compares every
 * victim): the same segments, demotions, young window and RecentKeys filters (_bloom.h) for "prefix",
 * dialogs by last use for "recency", short objects before long ones, each dialog cut from its tail.  It
 * keeps only what a miniature needs: no pins, no sizes, no hottest-first list, one order.
 *
 * Layout: blocks and dialogs are slots in two arrays, linked by index.  A dialog (per class, by its key: a
 * digest, or a lone object's 1-tuple) lists its blocks by position, then arrival (several objects may share
 * a position); in the prefix order it is also a group per segment holding its blocks there, listed the same
 * way, and each segment orders its groups (cold first).  In the recency order, each class orders its
 * dialogs by last use.  Two dicts map identities and dialog keys to slots.
 *
 * A CPython extension, optional like kvgate's other helpers (the referee uses the Python classes where it is
 * not built).  Called with the GIL held, from the referee's owner's one thread; nothing here blocks.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>

#include "_bloom.h"

#define CLASSES 2
#define SEGS 3
#define TAIL 0
#define NEW 1
#define REUSED 2
#define NIL (-1)
#define PREFIX 0
#define RECENCY 1
#define BITS_PER_KEY 16

typedef struct {
    PyObject *ident; /* owned; NULL while the slot is free */
    int64_t pos;
    int32_t dlg;
    int32_t seg;
    int32_t wprev, wnext; /* its dialog's blocks, by position then arrival */
    int32_t gprev, gnext; /* its dialog's group in its segment (prefix order) */
} Block;

typedef struct {
    PyObject *key; /* owned; NULL while the slot is free (next_free then links the free slots) */
    int32_t klass;
    int32_t whead, wtail;
    int32_t ghead[SEGS], gtail[SEGS];
    int64_t added[SEGS];              /* the add count when a block last joined the group (prefix) */
    int32_t oprev[SEGS], onext[SEGS]; /* the group's place in its segment; [0]: the dialog's by last use */
    int32_t next_free;
} Dialog;

typedef struct {
    PyObject_HEAD
    int order;
    Block *blocks;
    int32_t blocks_cap, free_block;
    Dialog *dialogs;
    int32_t dialogs_cap, free_dialog;
    PyObject *where;             /* ident -> block slot */
    PyObject *keyed[CLASSES];    /* per class: dialog key -> dialog slot */
    PyObject *no_dialog;         /* the digest that means "no dialog" */
    Py_ssize_t count;
    int32_t head[CLASSES][SEGS], tail[CLASSES][SEGS]; /* prefix: groups per segment; recency: [k][0] */
    Py_ssize_t reused[CLASSES];
    int64_t adds;
    Py_ssize_t young_adds, reserve_from;
    double reused_share;
    /* RecentKeys (prefix order): current and previous filters */
    unsigned char *cur, *prev;
    uint64_t cur_bytes, prev_bytes;
    Py_ssize_t rcount, span;
} Mini;

/* ---- slots ---------------------------------------------------------------------------------------- */

static int32_t new_block(Mini *m)
{
    if (m->free_block == NIL) {
        int32_t cap = m->blocks_cap ? m->blocks_cap * 2 : 1024;
        Block *grown = PyMem_Realloc(m->blocks, (size_t)cap * sizeof(Block));
        if (grown == NULL) {
            PyErr_NoMemory();
            return NIL;
        }
        for (int32_t i = cap - 1; i >= m->blocks_cap; i--) {
            grown[i].ident = NULL;
            grown[i].wnext = m->free_block;
            m->free_block = i;
        }
        m->blocks = grown;
        m->blocks_cap = cap;
    }
    int32_t b = m->free_block;
    m->free_block = m->blocks[b].wnext;
    return b;
}

static int32_t new_dialog(Mini *m)
{
    if (m->free_dialog == NIL) {
        int32_t cap = m->dialogs_cap ? m->dialogs_cap * 2 : 256;
        Dialog *grown = PyMem_Realloc(m->dialogs, (size_t)cap * sizeof(Dialog));
        if (grown == NULL) {
            PyErr_NoMemory();
            return NIL;
        }
        for (int32_t i = cap - 1; i >= m->dialogs_cap; i--) {
            grown[i].key = NULL;
            grown[i].next_free = m->free_dialog;
            m->free_dialog = i;
        }
        m->dialogs = grown;
        m->dialogs_cap = cap;
    }
    int32_t d = m->free_dialog;
    Dialog *dp = &m->dialogs[d];
    m->free_dialog = dp->next_free;
    dp->whead = dp->wtail = NIL;
    for (int s = 0; s < SEGS; s++) {
        dp->ghead[s] = dp->gtail[s] = NIL;
        dp->added[s] = 0;
        dp->oprev[s] = dp->onext[s] = NIL;
    }
    return d;
}

/* ---- a dialog's blocks, by position then arrival: the whole dialog (w) or one group (g) ------------- */

#define DEFINE_LIST(NAME, PREV, NEXT)                                                                      \
    static void NAME##_insert(Mini *m, int32_t *head, int32_t *tail, int32_t b)                            \
    {                                                                                                      \
        int64_t pos = m->blocks[b].pos;                                                                    \
        int32_t at = *tail;                                                                                \
        while (at != NIL && m->blocks[at].pos > pos)                                                       \
            at = m->blocks[at].PREV;                                                                       \
        int32_t nx = at == NIL ? *head : m->blocks[at].NEXT;                                               \
        m->blocks[b].PREV = at;                                                                            \
        m->blocks[b].NEXT = nx;                                                                            \
        if (at == NIL)                                                                                     \
            *head = b;                                                                                     \
        else                                                                                               \
            m->blocks[at].NEXT = b;                                                                        \
        if (nx == NIL)                                                                                     \
            *tail = b;                                                                                     \
        else                                                                                               \
            m->blocks[nx].PREV = b;                                                                        \
    }                                                                                                      \
    static void NAME##_unlink(Mini *m, int32_t *head, int32_t *tail, int32_t b)                            \
    {                                                                                                      \
        int32_t p = m->blocks[b].PREV, n = m->blocks[b].NEXT;                                              \
        if (p == NIL)                                                                                      \
            *head = n;                                                                                     \
        else                                                                                               \
            m->blocks[p].NEXT = n;                                                                         \
        if (n == NIL)                                                                                      \
            *tail = p;                                                                                     \
        else                                                                                               \
            m->blocks[n].PREV = p;                                                                         \
    }                                                                                                      \
    /* The first block to arrive at the last position: the one a cut from the tail takes. */             \
    static int32_t NAME##_last(Mini *m, int32_t tail)                                                      \
    {                                                                                                      \
        int32_t b = tail;                                                                                  \
        int64_t pos = m->blocks[b].pos;                                                                    \
        for (int32_t p = m->blocks[b].PREV; p != NIL && m->blocks[p].pos == pos; p = m->blocks[p].PREV)    \
            b = p;                                                                                         \
        return b;                                                                                          \
    }

DEFINE_LIST(whole, wprev, wnext)
DEFINE_LIST(group, gprev, gnext)

/* ---- orders of dialogs (groups of a segment; dialogs by last use): slot s of their links ----------- */

static void order_unlink(Mini *m, int k, int s, int32_t d)
{
    Dialog *dp = &m->dialogs[d];
    int32_t p = dp->oprev[s], n = dp->onext[s];
    if (p == NIL)
        m->head[k][s] = n;
    else
        m->dialogs[p].onext[s] = n;
    if (n == NIL)
        m->tail[k][s] = p;
    else
        m->dialogs[n].oprev[s] = p;
    dp->oprev[s] = dp->onext[s] = NIL;
}

static void order_append(Mini *m, int k, int s, int32_t d)
{
    Dialog *dp = &m->dialogs[d];
    int32_t t = m->tail[k][s];
    dp->oprev[s] = t;
    dp->onext[s] = NIL;
    if (t == NIL)
        m->head[k][s] = d;
    else
        m->dialogs[t].onext[s] = d;
    m->tail[k][s] = d;
}

static void order_push_front(Mini *m, int k, int s, int32_t d)
{
    Dialog *dp = &m->dialogs[d];
    int32_t h = m->head[k][s];
    dp->onext[s] = h;
    dp->oprev[s] = NIL;
    if (h == NIL)
        m->tail[k][s] = d;
    else
        m->dialogs[h].oprev[s] = d;
    m->head[k][s] = d;
}

static void order_to_end(Mini *m, int k, int s, int32_t d)
{
    if (m->tail[k][s] != d) {
        order_unlink(m, k, s, d);
        order_append(m, k, s, d);
    }
}

/* ---- RecentKeys ------------------------------------------------------------------------------------ */

/* Remember the block; whether it was remembered already (RecentKeys.add, the span set as PrefixPolicy._seen
 * sets it: three times the resident count, at least 3,072). -1 with an exception set. */
static int seen(Mini *m, PyObject *ident)
{
    Py_hash_t hashed = PyObject_Hash(ident);
    if (hashed == -1 && PyErr_Occurred())
        return -1;
    m->span = 3 * (m->count > 1024 ? m->count : 1024);
    uint64_t h1, h2;
    bloom_mix((uint64_t)hashed, &h1, &h2);
    if (bloom_has(m->cur, m->cur_bytes * 8, h1, h2))
        return 1;
    int found = m->prev != NULL && bloom_has(m->prev, m->prev_bytes * 8, h1, h2);
    bloom_set(m->cur, m->cur_bytes * 8, h1, h2);
    m->rcount++;
    if ((uint64_t)m->rcount >= m->cur_bytes * 8 / BITS_PER_KEY) {
        uint64_t bytes = (uint64_t)m->span * BITS_PER_KEY / 8;
        unsigned char *fresh = PyMem_Calloc(bytes, 1);
        if (fresh == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        PyMem_Free(m->prev);
        m->prev = m->cur;
        m->prev_bytes = m->cur_bytes;
        m->cur = fresh;
        m->cur_bytes = bytes;
        m->rcount = 0;
    }
    return found;
}

/* ---- the prefix order's segments --------------------------------------------------------------------- */

static void demote(Mini *m, int k);

/* A block joins its dialog's group in ``seg`` (PrefixPolicy._join). */
static void join(Mini *m, int32_t b, int k, int seg, int cold)
{
    int32_t d = m->blocks[b].dlg;
    Dialog *dp = &m->dialogs[d];
    if (dp->ghead[seg] == NIL) {
        dp->added[seg] = 0;
        if (cold)
            order_push_front(m, k, seg, d);
        else
            order_append(m, k, seg, d);
    } else if (!cold) {
        order_to_end(m, k, seg, d);
    }
    if (!cold)
        dp->added[seg] = m->adds;
    group_insert(m, &dp->ghead[seg], &dp->gtail[seg], b);
    m->blocks[b].seg = seg;
    if (seg == REUSED) {
        m->reused[k]++;
        demote(m, k);
    }
}

/* A block leaves its group (its segment's order loses the group once it is empty). */
static void leave(Mini *m, int32_t b, int k)
{
    int32_t d = m->blocks[b].dlg;
    int seg = m->blocks[b].seg;
    Dialog *dp = &m->dialogs[d];
    group_unlink(m, &dp->ghead[seg], &dp->gtail[seg], b);
    if (dp->ghead[seg] == NIL)
        order_unlink(m, k, seg, d);
    if (seg == REUSED)
        m->reused[k]--;
}

static void move(Mini *m, int32_t b, int seg, int cold)
{
    int k = m->dialogs[m->blocks[b].dlg].klass;
    leave(m, b, k);
    join(m, b, k, seg, cold);
}

/* Keep REUSED within its share: its coldest group's tail block goes to the cold end of NEW. */
static void demote(Mini *m, int k)
{
    Py_ssize_t n = m->count;
    Py_ssize_t limit = n;
    if (n >= m->reserve_from) {
        limit = (Py_ssize_t)((double)n * m->reused_share);
        if (limit < 1)
            limit = 1;
    }
    while (m->reused[k] > limit && m->head[k][REUSED] != NIL) {
        int32_t d = m->head[k][REUSED];
        move(m, group_last(m, m->dialogs[d].gtail[REUSED]), NEW, 1);
    }
}

/* The dialog that loses its tail block next (PrefixPolicy._coldest; DialogLru.choose_victim). */
static int32_t coldest(Mini *m)
{
    if (m->order == RECENCY) {
        for (int k = 0; k < CLASSES; k++)
            if (m->head[k][0] != NIL)
                return m->head[k][0];
        return NIL;
    }
    int64_t window = m->count / 64 > m->young_adds ? m->count / 64 : m->young_adds;
    int64_t young_after = m->adds - window;
    for (int k = 0; k < CLASSES; k++) {
        int32_t young = NIL;
        for (int s = TAIL; s <= NEW; s++) {
            int32_t g = m->head[k][s];
            if (g == NIL)
                continue;
            if (m->dialogs[g].added[s] <= young_after)
                return g;
            if (young == NIL)
                young = g;
        }
        if (m->head[k][REUSED] != NIL)
            return m->head[k][REUSED];
        if (young != NIL)
            return young;
    }
    return NIL;
}

/* ---- blocks in and out --------------------------------------------------------------------------------- */

static void unplace(Mini *m, int32_t b)
{
    Block *bp = &m->blocks[b];
    int32_t d = bp->dlg;
    int k = m->dialogs[d].klass;
    if (m->order == PREFIX)
        leave(m, b, k);
    Dialog *dp = &m->dialogs[d];
    whole_unlink(m, &dp->whead, &dp->wtail, b);
    if (dp->whead == NIL) {
        if (m->order == RECENCY)
            order_unlink(m, k, 0, d);
        PyDict_DelItem(m->keyed[k], dp->key); /* present: cannot fail but for memory, which a delete needs none of */
        Py_CLEAR(dp->key);
        dp->next_free = m->free_dialog;
        m->free_dialog = d;
    }
    PyDict_DelItem(m->where, m->blocks[b].ident);
    Py_CLEAR(m->blocks[b].ident);
    m->blocks[b].wnext = m->free_block;
    m->free_block = b;
    m->count--;
}

/* A read of a resident block. 0, or -1 with an exception set. */
static int touch(Mini *m, int32_t b)
{
    int32_t d = m->blocks[b].dlg;
    int k = m->dialogs[d].klass;
    if (m->order == RECENCY) {
        order_to_end(m, k, 0, d);
        return 0;
    }
    if (m->blocks[b].seg == REUSED)
        order_to_end(m, k, REUSED, d);
    else
        move(m, b, REUSED, 0);
    return seen(m, m->blocks[b].ident) < 0 ? -1 : 0;
}

/* A block that is not resident. 0, or -1 with an exception set. */
static int add(Mini *m, PyObject *ident, PyObject *label, int64_t position, int k, int tail)
{
    int again = 0;
    if (m->order == PREFIX && (again = seen(m, ident)) < 0)
        return -1;
    PyObject *key;
    int lone = position < 0 || !PyBytes_Check(label) || PyBytes_GET_SIZE(label) == 0;
    if (!lone) {
        int none = PyObject_RichCompareBool(label, m->no_dialog, Py_EQ);
        if (none < 0)
            return -1;
        lone = none;
    }
    if (lone) {
        key = PyTuple_Pack(1, ident);
        position = 0;
    } else {
        key = Py_NewRef(label);
    }
    if (key == NULL)
        return -1;
    int32_t d;
    PyObject *slot = PyDict_GetItemWithError(m->keyed[k], key);
    if (slot != NULL) {
        d = (int32_t)PyLong_AsLong(slot);
        Py_DECREF(key);
        if (m->order == RECENCY)
            order_to_end(m, k, 0, d);
    } else {
        if (PyErr_Occurred() || (d = new_dialog(m)) == NIL) {
            Py_DECREF(key);
            return -1;
        }
        PyObject *n = PyLong_FromLong(d);
        if (n == NULL || PyDict_SetItem(m->keyed[k], key, n) < 0) {
            Py_XDECREF(n);
            Py_DECREF(key);
            m->dialogs[d].next_free = m->free_dialog;
            m->free_dialog = d;
            return -1;
        }
        Py_DECREF(n);
        m->dialogs[d].key = key; /* the reference the slot keeps */
        m->dialogs[d].klass = k;
        if (m->order == RECENCY)
            order_append(m, k, 0, d);
    }
    int32_t b = new_block(m);
    PyObject *n = b == NIL ? NULL : PyLong_FromLong(b);
    if (n == NULL || PyDict_SetItem(m->where, ident, n) < 0) {
        Py_XDECREF(n);
        if (b != NIL) {
            m->blocks[b].wnext = m->free_block;
            m->free_block = b;
        }
        if (m->dialogs[d].whead == NIL) { /* a dialog made for this block alone */
            if (m->order == RECENCY)
                order_unlink(m, k, 0, d);
            PyDict_DelItem(m->keyed[k], m->dialogs[d].key);
            Py_CLEAR(m->dialogs[d].key);
            m->dialogs[d].next_free = m->free_dialog;
            m->free_dialog = d;
        }
        return -1;
    }
    Py_DECREF(n);
    Block *bp = &m->blocks[b];
    bp->ident = Py_NewRef(ident);
    bp->pos = position;
    bp->dlg = d;
    bp->seg = NEW;
    m->count++;
    Dialog *dp = &m->dialogs[d];
    whole_insert(m, &dp->whead, &dp->wtail, b);
    if (m->order == PREFIX) {
        m->adds++;
        join(m, b, k, again ? REUSED : tail ? TAIL : NEW, 0);
    }
    return 0;
}

/* ---- the Python type ------------------------------------------------------------------------------------ */

static int32_t slot_of(Mini *m, PyObject *ident)
{
    PyObject *slot = PyDict_GetItemWithError(m->where, ident);
    if (slot == NULL)
        return PyErr_Occurred() ? -2 : NIL;
    return (int32_t)PyLong_AsLong(slot);
}

/* replay(ident, label, position, klass, tail, capacity) -> int: PrefixPolicy.replay / DialogLru.replay. */
static PyObject *Mini_replay(Mini *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "replay(ident, label, position, klass, tail, capacity) takes 6 arguments");
        return NULL;
    }
    PyObject *ident = args[0];
    int32_t b = slot_of(m, ident);
    if (b == -2)
        return NULL;
    if (b != NIL)
        return touch(m, b) < 0 ? NULL : PyLong_FromLong(-1);
    long long position = PyLong_AsLongLong(args[2]);
    if (position == -1 && PyErr_Occurred())
        return NULL;
    long klass = PyLong_Check(args[3]) && !PyBool_Check(args[3]) ? PyLong_AsLong(args[3]) : -1;
    if (klass < 0 || klass >= CLASSES) {
        PyErr_Clear();
        PyObject *r = PyObject_Repr(args[3]);
        PyErr_Format(PyExc_ValueError, "retention class must be 0 (short) or 1 (long), got %S", r ? r : Py_None);
        Py_XDECREF(r);
        return NULL;
    }
    int tail = PyObject_IsTrue(args[4]);
    Py_ssize_t capacity = PyLong_AsSsize_t(args[5]);
    if (tail < 0 || (capacity == -1 && PyErr_Occurred()))
        return NULL;
    if (add(m, ident, args[1], position, (int)klass, tail) < 0)
        return NULL;
    long evicted = 0;
    while (m->count > capacity) {
        int32_t d = coldest(m);
        if (d == NIL)
            break;
        unplace(m, whole_last(m, m->dialogs[d].wtail));
        evicted++;
    }
    return PyLong_FromLong(evicted);
}

/* remove_dialogs(drop): every block whose dialog key ``drop`` says yes to leaves. */
static PyObject *Mini_remove_dialogs(Mini *m, PyObject *drop)
{
    PyObject *gone = PyList_New(0);
    if (gone == NULL)
        return NULL;
    for (int32_t d = 0; d < m->dialogs_cap; d++) {
        if (m->dialogs[d].key == NULL)
            continue;
        PyObject *yes = PyObject_CallOneArg(drop, m->dialogs[d].key);
        int truth = yes == NULL ? -1 : PyObject_IsTrue(yes);
        Py_XDECREF(yes);
        if (truth < 0) {
            Py_DECREF(gone);
            return NULL;
        }
        for (int32_t b = m->dialogs[d].whead; truth && b != NIL; b = m->blocks[b].wnext) {
            PyObject *n = PyLong_FromLong(b);
            if (n == NULL || PyList_Append(gone, n) < 0) {
                Py_XDECREF(n);
                Py_DECREF(gone);
                return NULL;
            }
            Py_DECREF(n);
        }
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(gone); i++)
        unplace(m, (int32_t)PyLong_AsLong(PyList_GET_ITEM(gone, i)));
    Py_DECREF(gone);
    Py_RETURN_NONE;
}

static PyObject *Mini_choose_victim(Mini *m, PyObject *unused)
{
    int32_t d = coldest(m);
    if (d == NIL)
        Py_RETURN_NONE;
    return Py_NewRef(m->blocks[whole_last(m, m->dialogs[d].wtail)].ident);
}

static Py_ssize_t Mini_len(Mini *m)
{
    return m->count;
}

static int Mini_contains(Mini *m, PyObject *ident)
{
    return PyDict_Contains(m->where, ident);
}

static int Mini_init(Mini *m, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"order", "no_dialog", "young_adds", "reserve_from", "reused_share", "span", NULL};
    const char *order;
    PyObject *no_dialog;
    Py_ssize_t young_adds, reserve_from, span;
    double share;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sSnndn", names, &order, &no_dialog, &young_adds,
                                     &reserve_from, &share, &span))
        return -1;
    if (m->where != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a Miniature is initialised once");
        return -1;
    }
    if (strcmp(order, "prefix") == 0)
        m->order = PREFIX;
    else if (strcmp(order, "recency") == 0)
        m->order = RECENCY;
    else {
        PyErr_Format(PyExc_ValueError, "unknown order '%s'; choose one of prefix, recency", order);
        return -1;
    }
    m->where = PyDict_New();
    for (int k = 0; k < CLASSES; k++)
        m->keyed[k] = PyDict_New();
    m->span = span > 1 ? span : 1;
    m->cur_bytes = (uint64_t)m->span * BITS_PER_KEY / 8;
    m->cur = PyMem_Calloc(m->cur_bytes, 1);
    if (m->where == NULL || m->keyed[0] == NULL || m->keyed[1] == NULL || m->cur == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    m->no_dialog = Py_NewRef(no_dialog);
    m->young_adds = young_adds;
    m->reserve_from = reserve_from;
    m->reused_share = share;
    m->blocks_cap = m->dialogs_cap = 0;
    m->free_block = m->free_dialog = NIL;
    for (int k = 0; k < CLASSES; k++)
        for (int s = 0; s < SEGS; s++)
            m->head[k][s] = m->tail[k][s] = NIL;
    return 0;
}

static void Mini_dealloc(Mini *m)
{
    for (int32_t b = 0; b < m->blocks_cap; b++)
        Py_XDECREF(m->blocks[b].ident);
    for (int32_t d = 0; d < m->dialogs_cap; d++)
        Py_XDECREF(m->dialogs[d].key);
    PyMem_Free(m->blocks);
    PyMem_Free(m->dialogs);
    PyMem_Free(m->cur);
    PyMem_Free(m->prev);
    Py_XDECREF(m->where);
    Py_XDECREF(m->keyed[0]);
    Py_XDECREF(m->keyed[1]);
    Py_XDECREF(m->no_dialog);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyObject *Mini_get_span(Mini *m, void *unused)
{
    return PyLong_FromSsize_t(m->span);
}

static PyMethodDef Mini_methods[] = {
    {"replay", (PyCFunction)(void (*)(void))Mini_replay, METH_FASTCALL,
     "replay(ident, label, position, klass, tail, capacity) -> int: -1 if resident (read), else the evictions "
     "that cut the cache back to capacity after the add"},
    {"remove_dialogs", (PyCFunction)Mini_remove_dialogs, METH_O,
     "remove_dialogs(drop): remove every block whose dialog key drop(key) is true for"},
    {"choose_victim", (PyCFunction)Mini_choose_victim, METH_NOARGS, "the block evicted next, or None"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Mini_members[] = {
    {"young_adds", T_PYSSIZET, offsetof(Mini, young_adds), 0, "the prefix order's young window, in adds"},
    {"reserve_from", T_PYSSIZET, offsetof(Mini, reserve_from), 0, "objects from which REUSED keeps a reserve"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef Mini_getset[] = {
    {"recent_span", (getter)Mini_get_span, NULL, "the span of its RecentKeys filters now", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Mini_sequence = {
    .sq_length = (lenfunc)Mini_len,
    .sq_contains = (objobjproc)Mini_contains,
};

static PyTypeObject MiniType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvgate._mini.Miniature",
    .tp_basicsize = sizeof(Mini),
    .tp_dealloc = (destructor)Mini_dealloc,
    .tp_as_sequence = &Mini_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Miniature(order, no_dialog, young_adds, reserve_from, reused_share, span): a referee's miniature "
              "cache in one order (see kvgate/_mini.c)",
    .tp_methods = Mini_methods,
    .tp_members = Mini_members,
    .tp_getset = Mini_getset,
    .tp_init = (initproc)Mini_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvgate._mini", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__mini(void)
{
    if (PyType_Ready(&MiniType) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL)
        return NULL;
    if (PyModule_AddObjectRef(mod, "Miniature", (PyObject *)&MiniType) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
