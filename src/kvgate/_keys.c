/* Full keys and key digests of a whole request in one C pass each (kvgate.keys.full_keys, joined_digests).
 *
 * A request of 1,000 keys made 1,000 concatenations and 1,000 xxh3-128 calls from Python, 60-70 us each
 * pass on these machines, a fifth of a lookup's time in the gateway.  Here the loop over the list is C;
 * the hash is python-xxhash's own XXH3_128bits (its extension exports it: kvgate.keys passes its address
 * once, ``init``), so a digest is the same 16 bytes as ``xxhash.xxh3_128_digest``: the canonical form,
 * the high half big-endian, then the low half.
 *
 * A CPython extension (it reads the list and makes the bytes objects), optional like kvgate's other
 * helpers: setup.py builds it where a C compiler and Python's headers are; kvgate.keys keeps the Python
 * loops where it is not built.  Called with the GIL held; nothing here blocks.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint64_t low64;
    uint64_t high64;
} xxh128_hash;

typedef xxh128_hash (*xxh3_128_fn)(const void *data, size_t len);

static xxh3_128_fn xxh3_128 = NULL;

static PyObject *init(PyObject *self, PyObject *arg)
{
    void *fn = PyLong_AsVoidPtr(arg);
    if (fn == NULL && PyErr_Occurred())
        return NULL;
    if (fn == NULL) {
        PyErr_SetString(PyExc_ValueError, "init needs the address of XXH3_128bits");
        return NULL;
    }
    xxh3_128 = (xxh3_128_fn)fn;
    Py_RETURN_NONE;
}

static void put_be64(unsigned char *out, uint64_t v)
{
    for (int i = 7; i >= 0; i--) {
        out[i] = (unsigned char)(v & 0xff);
        v >>= 8;
    }
}

/* keys[i], or NULL with TypeError set where it is not bytes (the caller drops what it made). */
static PyObject *key_at(PyObject *keys, Py_ssize_t i)
{
    PyObject *k = PyList_GET_ITEM(keys, i);
    if (!PyBytes_Check(k)) {
        PyErr_Format(PyExc_TypeError, "keys[%zd] is %.100s, not bytes", i, Py_TYPE(k)->tp_name);
        return NULL;
    }
    return k;
}

/* digests(keys: list[bytes]) -> bytes: the 16-byte digest of each key, one after the other. */
static PyObject *digests(PyObject *self, PyObject *keys)
{
    if (xxh3_128 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvgate._keys.init was not called");
        return NULL;
    }
    if (!PyList_Check(keys)) {
        PyErr_SetString(PyExc_TypeError, "digests takes a list of bytes");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(keys);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 16);
    if (out == NULL)
        return NULL;
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = key_at(keys, i);
        if (k == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        xxh128_hash h = xxh3_128(PyBytes_AS_STRING(k), (size_t)PyBytes_GET_SIZE(k));
        put_be64(dst + 16 * i, h.high64);
        put_be64(dst + 16 * i + 8, h.low64);
    }
    return out;
}

/* prefixed(prefix: bytes, keys: list[bytes]) -> list[bytes]: prefix + key for each key. */
static PyObject *prefixed(PyObject *self, PyObject *args)
{
    const char *prefix;
    Py_ssize_t plen;
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "y#O!", &prefix, &plen, &PyList_Type, &keys))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = key_at(keys, i);
        if (k == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        Py_ssize_t klen = PyBytes_GET_SIZE(k);
        PyObject *f = PyBytes_FromStringAndSize(NULL, plen + klen);
        if (f == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        memcpy(PyBytes_AS_STRING(f), prefix, (size_t)plen);
        memcpy(PyBytes_AS_STRING(f) + plen, PyBytes_AS_STRING(k), (size_t)klen);
        PyList_SET_ITEM(out, i, f);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"init", init, METH_O, "init(address of XXH3_128bits): the hash digests() uses"},
    {"digests", digests, METH_O, "digests(keys: list[bytes]) -> bytes: each key's 16-byte XXH3-128 digest"},
    {"prefixed", prefixed, METH_VARARGS, "prefixed(prefix: bytes, keys: list[bytes]) -> list[bytes]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvgate._keys", NULL, -1, methods};

PyMODINIT_FUNC PyInit__keys(void)
{
    return PyModule_Create(&module);
}
