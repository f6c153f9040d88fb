/* The probes of kvgate.tiers.eviction's RecentKeys filters, one C call per add or test.
 *
 * Every add and read of a block asks RecentKeys whether it was seen lately (the prefix policy's sign of
 * reuse), and the referee's miniature caches ask it again: in Python the hash mix and four probes were
 * some 40 bytecodes, 4-7 us a call on these machines, a sixth of the policy's time per block of a replay
 * (benchmarks/eviction_cost.py).  Here they are one call.  Same hash, same bits as the Python path in
 * eviction.py (tests/tiers/test_eviction.py checks they agree): _bloom.h.
 *
 * A CPython extension (it hashes the identity), optional like kvgate's other helpers: setup.py builds it
 * where a C compiler and Python's headers are.  Called with the GIL held; nothing here blocks or allocates.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "_bloom.h"

/* The filter's bytes, or NULL with TypeError set where it is not a non-empty bytearray. */
static unsigned char *filter_bits(PyObject *f, const char *what, uint64_t *nbits)
{
    if (!PyByteArray_Check(f) || PyByteArray_GET_SIZE(f) == 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a non-empty bytearray, not %.100s", what, Py_TYPE(f)->tp_name);
        return NULL;
    }
    *nbits = (uint64_t)PyByteArray_GET_SIZE(f) * 8;
    return (unsigned char *)PyByteArray_AS_STRING(f);
}

/* remember(ident, current: bytearray, previous: bytearray | None, add: bool) -> int
 * bit 0: ``ident`` is in ``current``; bit 1: it is in ``previous``.  With ``add`` and bit 0 clear, its bits
 * are set in ``current`` (the caller counts it). */
static PyObject *remember(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "remember(ident, current, previous, add) takes 4 arguments");
        return NULL;
    }
    Py_hash_t hashed = PyObject_Hash(args[0]);
    if (hashed == -1 && PyErr_Occurred())
        return NULL;
    uint64_t nbits, pbits = 0;
    unsigned char *bits = filter_bits(args[1], "current", &nbits);
    if (bits == NULL)
        return NULL;
    unsigned char *prev = NULL;
    if (args[2] != Py_None && (prev = filter_bits(args[2], "previous", &pbits)) == NULL)
        return NULL;
    int add = PyObject_IsTrue(args[3]);
    if (add < 0)
        return NULL;
    uint64_t h1, h2;
    bloom_mix((uint64_t)hashed, &h1, &h2);
    long out = 0;
    if (bloom_has(bits, nbits, h1, h2))
        out |= 1;
    if (prev != NULL && bloom_has(prev, pbits, h1, h2))
        out |= 2;
    if (add && !(out & 1))
        bloom_set(bits, nbits, h1, h2);
    return PyLong_FromLong(out);
}

static PyMethodDef methods[] = {
    {"remember", (PyCFunction)(void (*)(void))remember, METH_FASTCALL,
     "remember(ident, current, previous, add) -> int: bit 0 in current, bit 1 in previous; add sets it"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvgate._recent", NULL, -1, methods};

PyMODINIT_FUNC PyInit__recent(void)
{
    return PyModule_Create(&module);
}
