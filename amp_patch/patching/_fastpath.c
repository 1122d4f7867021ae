/* The no-cast check of a patched op, in C.

   amp_patch's wrappers are wrapt FunctionWrappers whose wrapper function has
   wrapt's signature (wrapped, instance, args, kwargs) and does all the work
   in Python. On a call that needs no cast that costs a C-to-Python call, an
   args tuple, an empty kwargs dict and a Python frame: 1-2 us on this kind of
   machine, more than the op itself on small tensors.

   This module defines two subclasses of wrapt.FunctionWrapper, one for torch
   functions and one for torch.Tensor methods. Their call (vectorcall: no
   tuple, no dict) does the common case itself:

     * positional arguments only, no thread inside disable_casts(), no
       diagnostics watching every call, the session live, and no
       list/tuple/dict argument;
     * no tensor argument in a dtype that must be cast -> the original op;
     * a promote op given a mix of castable dtypes -> the Python wrapper,
       which applies torch's promotion (0-dim tensors); an op whose kernel
       promotes by itself (wrappers.NATIVE_PROMOTE) -> always the original;
     * some tensor argument to cast -> each such tensor converted, then the
       original op. A weight is looked up in the weight-cast cache here
       (cache_hit, the hit branch of _cast.CastCache.cast); a miss goes to
       the Python cache, which converts and stores.

   Every other call goes to wrapt's own call and so to the Python wrapper
   (wrappers.py), which decides exactly as before. The layout of wrapt's
   object is not assumed: the extra fields sit after the base type's
   tp_basicsize, read at type creation.

   What an op does is its spec.OpSpec, built once in Python and handed to the
   constructor; the module imports nothing of amp_patch: wrappers.py calls
   bind() once with the switches read on every call and the field names of the
   tuples read here by position, which bind() checks against the enums below.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stddef.h>

/* spec.OpSpec's fields, by position */
enum spec_field { SPEC_CASTABLE, SPEC_TO, SPEC_CONVERT, SPEC_WEIGHTS, SPEC_LIVE, SPEC_MODE, SPEC_MIN_FLOPS, SPEC_FLOPS,
                  SPEC_READ };
static const char *spec_names[SPEC_READ] = {"castable", "to", "convert", "weights", "live", "mode", "min_flops", "flops"};
/* cast.CacheEntry's fields, by position */
enum entry_field { ENTRY_TENSOR, ENTRY_TO, ENTRY_VERSION, ENTRY_DATA_PTR, ENTRY_COPY, ENTRY_SIZE };
static const char *entry_names[ENTRY_SIZE] = {"tensor", "to", "version", "data_ptr", "copy"};
/* spec.OpSpec.mode */
enum mode { MODE_FIXED, MODE_PROMOTE, MODE_NATIVE };
/* costs.FLOPS's codes: how a call's FLOPs follow from its arguments */
enum flops_kind { FLOPS_NONE, FLOPS_LINEAR, FLOPS_MM, FLOPS_ADDMM, FLOPS_CONV };

typedef struct {
    vectorcallfunc vectorcall; /* fast_call once initialized, NULL before and after clear */
    PyObject *original;        /* the unwrapped op (unbound for Tensor methods) */
    PyObject *castable;        /* tuple of the dtypes that trigger a cast */
    PyObject *to;              /* the dtype cast to */
    PyObject *convert;         /* TensorBase.bfloat16 / .half / .float */
    PyObject *cache_maps;      /* CastCache._maps: ({id: entry} without grad, with grad), or None: no cache */
    PyObject *cache_counts;    /* CastCache.counts: [hits, misses] */
    PyObject *live;            /* the session's Live flag object (.on) */
    int promote;               /* enum mode: FIXED casts to `to`; PROMOTE hands a mix of castable
                                  dtypes to the Python wrapper; NATIVE never casts */
    double min_flops;          /* cast_policy="auto": a call under this many FLOPs is not cast
                                  to half (0: every call is); see patching/costs.py */
    int flops_kind;            /* enum flops_kind: how its FLOPs follow from the shapes */
} Fast;

static Py_ssize_t fast_offset;      /* where Fast starts inside the object */
static PyTypeObject *wrapt_type;    /* wrapt.FunctionWrapper: call, GC, dealloc */
static initproc base_init;          /* wrapt._FunctionWrapperBase's, takes the binding */
static int wrapt_heap;              /* wrapt >= 2.2 builds heap types, which visit and
                                       release the object's type themselves */
static PyTypeObject *tensor_type;   /* torch.Tensor */
static PyTypeObject *parameter_type; /* torch.nn.Parameter */
static PyObject *entry_type;        /* cast.CacheEntry; set by bind() */
static PyObject *disabled;          /* wrappers.disabled: {thread: depth}; set by bind() */
static PyObject *python_only;       /* wrappers.python_only: non-empty = Python only; set by bind() */
static PyObject *grad_enabled;      /* torch._C.is_grad_enabled */
static PyObject *one;               /* the int 1 */
static PyObject *str_dtype, *str_on, *str_requires_grad, *str_is_leaf, *str_staticmethod, *str_version, *str_data_ptr;
static PyObject *str_shape;
static PyObject *float32;           /* torch.float32 */

/* a vectorcall type must not let Python code reassign its __call__ */
#ifdef Py_TPFLAGS_IMMUTABLETYPE
#define IMMUTABLE Py_TPFLAGS_IMMUTABLETYPE
#else
#define IMMUTABLE 0
#endif

#define FAST(o) ((Fast *)((char *)(o) + fast_offset))

static int
in_tuple(PyObject *tuple, PyObject *item)
{
    /* dtypes are singletons, so identity is equality */
    Py_ssize_t i, n = PyTuple_GET_SIZE(tuple);
    for (i = 0; i < n; i++)
        if (PyTuple_GET_ITEM(tuple, i) == item)
            return 1;
    return 0;
}

/* A tensor's dtype, borrowed: torch keeps every dtype object alive and only
   its identity is used. NULL with an exception set on error. */
static PyObject *
dtype_of(PyObject *tensor)
{
    PyObject *dt = PyObject_GetAttr(tensor, str_dtype);
    Py_XDECREF(dt);
    return dt;
}

/* bool(obj.name): 1, 0, or -1 with an exception set */
static int
attr_true(PyObject *obj, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    int r;
    if (value == NULL)
        return -1;
    r = PyObject_IsTrue(value);
    Py_DECREF(value);
    return r;
}

/* 0: call the original; 1: cast; 2: leave it to the Python wrapper; -1: error.
   The scan always runs to the end: a container argument anywhere means 2,
   since only the Python wrapper casts inside containers. */
static int
plan(Fast *f, PyObject *const *args, Py_ssize_t n)
{
    PyObject *seen = NULL;
    Py_ssize_t i;
    int cast = 0;
    for (i = 0; i < n; i++) {
        PyObject *a = args[i];
        if (PyObject_TypeCheck(a, tensor_type)) {
            PyObject *dt;
            if (cast)
                continue;
            dt = dtype_of(a);
            if (dt == NULL)
                return -1;
            if (!in_tuple(f->castable, dt))
                continue;
            if (!f->promote)
                cast = 1;
            else if (seen != NULL && dt != seen)
                return 2; /* which dtype wins depends on dimensions: Python decides */
            seen = dt;
        }
        else if (PyList_Check(a) || PyTuple_Check(a) || PyDict_Check(a)) {
            return 2;
        }
    }
    return cast;
}

/* 1 when obj.name() (or obj.name, call=0) equals value, 0 when not, -1 on error */
static int
equals(PyObject *obj, PyObject *name, int call, PyObject *value)
{
    PyObject *now = call ? PyObject_CallMethodNoArgs(obj, name) : PyObject_GetAttr(obj, name);
    int r;
    if (now == NULL)
        return -1;
    r = PyObject_RichCompareBool(now, value, Py_EQ);
    Py_DECREF(now);
    return r;
}

/* The cached copy of weight `a` if CastCache.cast would return it: the entry
   under `key` (id(a)) in `map` (the cache's map of this grad mode) names a, the
   same target dtype, a's version counter and its data pointer (the caller checked
   requires_grad). A new reference; NULL and no exception on a miss; NULL and an
   exception on error. */
static PyObject *
cache_hit(Fast *f, PyObject *a, PyObject *map, PyObject *key)
{
    PyObject *entry, *copy = NULL, *hits;
    int same;

    entry = PyDict_GetItemWithError(map, key);
    if (entry == NULL || !PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != ENTRY_SIZE ||
        PyTuple_GET_ITEM(entry, ENTRY_TENSOR) != a || PyTuple_GET_ITEM(entry, ENTRY_TO) != f->to)
        return NULL;
    Py_INCREF(entry); /* the reads below may run Python code that drops it */
    same = equals(a, str_version, 0, PyTuple_GET_ITEM(entry, ENTRY_VERSION));
    if (same > 0)
        same = equals(a, str_data_ptr, 1, PyTuple_GET_ITEM(entry, ENTRY_DATA_PTR));
    if (same > 0) {
        hits = PyNumber_Add(PyList_GET_ITEM(f->cache_counts, 0), one);
        if (hits != NULL) {
            PyList_SetItem(f->cache_counts, 0, hits); /* steals hits */
            copy = PyTuple_GET_ITEM(entry, ENTRY_COPY);
            Py_INCREF(copy);
        }
    }
    Py_DECREF(entry);
    return copy;
}

/* Weight `a` converted and its copy kept under `key` in `map`, as CastCache.cast
   does on a miss. The cache is emptied at every forward, so every weight misses
   once per forward; a trip through Python there cost more than converting a small
   weight. A new reference. */
static PyObject *
cache_miss(Fast *f, PyObject *a, PyObject *map, PyObject *key)
{
    PyObject *out, *fields[ENTRY_SIZE], *entry, *misses;
    int stored = -1;

    out = PyObject_Vectorcall(f->convert, &a, 1, NULL);
    /* a subclass (torch.compile's FakeTensor) has no storage to key on: converted only */
    if (out == NULL || (Py_TYPE(a) != tensor_type && Py_TYPE(a) != parameter_type))
        return out;
    fields[ENTRY_TENSOR] = a;
    fields[ENTRY_TO] = f->to;
    fields[ENTRY_VERSION] = PyObject_GetAttr(a, str_version);
    fields[ENTRY_DATA_PTR] = fields[ENTRY_VERSION] ? PyObject_CallMethodNoArgs(a, str_data_ptr) : NULL;
    if (fields[ENTRY_VERSION] != NULL && fields[ENTRY_DATA_PTR] == NULL &&
        PyErr_ExceptionMatches(PyExc_RuntimeError)) {
        /* a tensor with no storage (torch.func's wrappers inside grad, vmap,
           jacrev): converted only, as CastCache.cast does */
        PyErr_Clear();
        Py_DECREF(fields[ENTRY_VERSION]);
        return out;
    }
    fields[ENTRY_COPY] = out;
    entry = fields[ENTRY_DATA_PTR] ? PyObject_Vectorcall(entry_type, fields, ENTRY_SIZE, NULL) : NULL;
    if (entry != NULL)
        stored = PyDict_SetItem(map, key, entry);
    if (stored == 0) {
        misses = PyNumber_Add(PyList_GET_ITEM(f->cache_counts, 1), one);
        stored = misses == NULL ? -1 : PyList_SetItem(f->cache_counts, 1, misses); /* steals misses */
    }
    Py_XDECREF(fields[ENTRY_VERSION]);
    Py_XDECREF(fields[ENTRY_DATA_PTR]);
    Py_XDECREF(entry);
    if (stored < 0)
        Py_CLEAR(out);
    return out;
}

/* One castable tensor converted as wrappers.cast_args converts it: a leaf
   that requires grad may be a weight, served by the cache (the map of the
   current grad mode, under id(a): looked up once for a hit and a miss); a new
   reference. The cache never holds anything else (CastCache.cast stores leaves
   only), so an activation is converted here without asking it. */
static PyObject *
cast_one(Fast *f, PyObject *a)
{
    if (f->cache_maps != Py_None) {
        int grad = attr_true(a, str_requires_grad);
        if (grad > 0)
            grad = attr_true(a, str_is_leaf);
        if (grad < 0)
            return NULL;
        if (grad) {
            PyObject *mode, *map, *key, *copy;
            mode = PyObject_CallNoArgs(grad_enabled);
            if (mode == NULL)
                return NULL;
            map = PyTuple_GET_ITEM(f->cache_maps, mode == Py_True); /* borrowed: the tuple holds it */
            Py_DECREF(mode);
            key = PyLong_FromVoidPtr(a);
            if (key == NULL)
                return NULL;
            copy = cache_hit(f, a, map, key);
            if (copy == NULL && !PyErr_Occurred())
                copy = cache_miss(f, a, map, key);
            Py_DECREF(key);
            return copy;
        }
    }
    return PyObject_Vectorcall(f->convert, &a, 1, NULL);
}

/* The original op on the arguments with every castable tensor converted to
   f->to (plan() returned 1, so the arguments are flat and positional). */
static PyObject *
cast_and_call(Fast *f, PyObject *const *args, Py_ssize_t n)
{
    PyObject *small[8], **out = small, *result = NULL;
    Py_ssize_t i, done = 0;

    if (n > 8) {
        out = PyMem_New(PyObject *, n);
        if (out == NULL)
            return PyErr_NoMemory();
    }
    for (; done < n; done++) {
        PyObject *a = args[done];
        out[done] = NULL;
        if (PyObject_TypeCheck(a, tensor_type)) {
            PyObject *dt = dtype_of(a);
            if (dt == NULL)
                goto finally;
            if (dt != f->to && in_tuple(f->castable, dt)) {
                out[done] = cast_one(f, a);
                if (out[done] == NULL)
                    goto finally;
                continue;
            }
        }
        Py_INCREF(a);
        out[done] = a;
    }
    result = PyObject_Vectorcall(f->original, out, n, NULL);
finally:
    for (i = 0; i < done; i++)
        Py_XDECREF(out[i]);
    if (out != small)
        PyMem_Free(out);
    return result;
}

/* wrapt's call with a tuple and a dict, which reaches the Python wrapper */
static PyObject *
general(PyObject *self, PyObject *const *args, Py_ssize_t n, PyObject *kwnames)
{
    PyObject *tuple, *kwargs = NULL, *result;
    Py_ssize_t i, nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;

    tuple = PyTuple_New(n);
    if (tuple == NULL)
        return NULL;
    for (i = 0; i < n; i++) {
        Py_INCREF(args[i]);
        PyTuple_SET_ITEM(tuple, i, args[i]);
    }
    if (nk) {
        kwargs = PyDict_New();
        if (kwargs == NULL) {
            Py_DECREF(tuple);
            return NULL;
        }
        for (i = 0; i < nk; i++) {
            if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), args[n + i]) < 0) {
                Py_DECREF(tuple);
                Py_DECREF(kwargs);
                return NULL;
            }
        }
    }
    result = wrapt_type->tp_call(self, tuple, kwargs);
    Py_DECREF(tuple);
    Py_XDECREF(kwargs);
    return result;
}

/* A tensor's shape into dims (at most 8); its number of dimensions, -1 on error,
   -2 when it is no tensor or has more dimensions */
static int
shape_of(PyObject *t, long long *dims, double *numel)
{
    PyObject *shape;
    Py_ssize_t i, nd;
    if (!PyObject_TypeCheck(t, tensor_type))
        return -2;
    shape = PyObject_GetAttr(t, str_shape);
    if (shape == NULL)
        return -1;
    nd = PyTuple_Check(shape) ? PyTuple_GET_SIZE(shape) : 9;
    if (nd > 8) {
        Py_DECREF(shape);
        return -2;
    }
    *numel = 1.0;
    for (i = 0; i < nd; i++) {
        dims[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
        if (dims[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(shape);
            return -1;
        }
        *numel *= (double)dims[i];
    }
    Py_DECREF(shape);
    return (int)nd;
}

/* cast_policy="auto", on a call that would be cast: 0 when it is not small (cast it),
   1 when it is and every argument is FP32 already (call the original), 2 when it is
   and an argument is half (the Python wrapper casts it up), -1 on error. The same
   FLOPs as costs.FLOPS, in the same double arithmetic. */
static int
small_call(Fast *f, PyObject *const *args, Py_ssize_t n)
{
    long long d0[8], d1[8];
    double n0, n1, flops;
    int first = f->flops_kind == FLOPS_ADDMM ? 1 : 0, nd0, nd1;
    Py_ssize_t i;
    if (n < first + 2)
        return 0;
    nd0 = shape_of(args[first], d0, &n0);
    if (nd0 == -1)
        return -1;
    nd1 = shape_of(args[first + 1], d1, &n1);
    if (nd1 == -1)
        return -1;
    if (nd0 < 0 || nd1 < 0)
        return 0;
    switch (f->flops_kind) {
    case FLOPS_LINEAR: /* linear(x, w): 2 * x.numel() * out_features */
        if (nd1 < 1)
            return 0;
        flops = 2.0 * n0 * (double)(nd1 > 1 ? d1[0] : 1);
        break;
    case FLOPS_MM: /* mm(a, b) and the like: 2 * a.numel() * b.shape[-1] */
    case FLOPS_ADDMM: /* addmm(c, a, b) */
        if (nd0 < 1 || nd1 < 1)
            return 0;
        flops = 2.0 * n0 * (double)(nd1 > 1 ? d1[nd1 - 1] : 1);
        break;
    case FLOPS_CONV: /* conv(x, w): 2 * x.numel() / in_channels * w.numel() */
        if (nd0 < 2 || nd1 < 2 || d0[1] == 0)
            return 0;
        flops = 2.0 * n0 / (double)d0[1] * n1;
        break;
    default:
        return 0;
    }
    if (!(flops < f->min_flops))
        return 0;
    for (i = 0; i < n; i++) {
        if (PyObject_TypeCheck(args[i], tensor_type)) {
            PyObject *dt = dtype_of(args[i]);
            if (dt == NULL)
                return -1;
            if (dt == f->to || (dt != float32 && in_tuple(f->castable, dt))) /* a half dtype */
                return 2;
        }
    }
    return 1;
}

static PyObject *
fast_call(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Fast *f = FAST(self);
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    int on, r;

    if ((kwnames && PyTuple_GET_SIZE(kwnames)) || PyDict_GET_SIZE(disabled) || PyDict_GET_SIZE(python_only))
        return general(self, args, n, kwnames);
    on = attr_true(f->live, str_on);
    if (on < 0)
        return NULL;
    if (!on)
        return general(self, args, n, kwnames);
    if (f->promote == MODE_NATIVE)
        return PyObject_Vectorcall(f->original, args, nargsf, NULL);
    r = plan(f, args, n);
    if (r == 0)
        return PyObject_Vectorcall(f->original, args, nargsf, NULL);
    if (r == 1) {
        if (f->min_flops > 0) {
            int small = small_call(f, args, n);
            if (small < 0)
                return NULL;
            if (small == 1)
                return PyObject_Vectorcall(f->original, args, nargsf, NULL);
            if (small == 2)
                return general(self, args, n, kwnames);
        }
        return cast_and_call(f, args, n);
    }
    if (r < 0)
        return NULL;
    return general(self, args, n, kwnames);
}

/* (wrapped, wrapper, spec): spec is a spec.OpSpec; the wrapt wrapper is set up
   as wrappers.OpWrapper sets it up, with the "staticmethod" binding. */
static int
fast_init(PyObject *self, PyObject *args, PyObject *kwargs)
{
    PyObject *wrapped, *wrapper, *spec, *castable, *cache, *mode, *kind, *base_args;
    PyObject *cache_maps = Py_None, *cache_counts = Py_None;
    int result = -1;
    double min_flops;
    Fast *f = FAST(self);

    if (kwargs && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "takes positional arguments only");
        return -1;
    }
    if (disabled == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "amp_patch.patching._fastpath is not bound (wrappers.py binds it)");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OOO!", &wrapped, &wrapper, &PyTuple_Type, &spec))
        return -1;
    if (PyTuple_GET_SIZE(spec) < SPEC_READ) {
        PyErr_SetString(PyExc_TypeError, "spec is not an amp_patch.patching.spec.OpSpec");
        return -1;
    }
    castable = PyTuple_GET_ITEM(spec, SPEC_CASTABLE);
    cache = PyTuple_GET_ITEM(spec, SPEC_WEIGHTS);
    mode = PyTuple_GET_ITEM(spec, SPEC_MODE);
    kind = PyTuple_GET_ITEM(spec, SPEC_FLOPS);
    if (!PyTuple_Check(castable) || !PyLong_Check(mode) || !PyLong_Check(kind)) {
        PyErr_SetString(PyExc_TypeError, "spec is not an amp_patch.patching.spec.OpSpec");
        return -1;
    }
    min_flops = PyFloat_AsDouble(PyTuple_GET_ITEM(spec, SPEC_MIN_FLOPS));
    if (min_flops == -1.0 && PyErr_Occurred())
        return -1;
    if (cache != Py_None) {
        cache_maps = PyObject_GetAttrString(cache, "_maps");
        cache_counts = PyObject_GetAttrString(cache, "counts");
        if (!cache_maps || !cache_counts)
            goto finally;
        if (!(PyTuple_CheckExact(cache_maps) && PyTuple_GET_SIZE(cache_maps) == 2 &&
              PyDict_CheckExact(PyTuple_GET_ITEM(cache_maps, 0)) && PyDict_CheckExact(PyTuple_GET_ITEM(cache_maps, 1)) &&
              PyList_CheckExact(cache_counts) && PyList_GET_SIZE(cache_counts) == 2)) {
            PyErr_SetString(PyExc_TypeError, "spec.weights is not an amp_patch.patching.cast.CastCache");
            goto finally;
        }
    }
    base_args = PyTuple_Pack(5, wrapped, Py_None, wrapper, Py_None, str_staticmethod);
    if (base_args == NULL)
        goto finally;
    result = base_init(self, base_args, NULL);
    Py_DECREF(base_args);
    if (result < 0)
        goto finally;
#define SET(field, value) do { Py_INCREF(value); Py_XSETREF(f->field, value); } while (0)
    SET(original, wrapped);
    SET(castable, castable);
    SET(to, PyTuple_GET_ITEM(spec, SPEC_TO));
    SET(convert, PyTuple_GET_ITEM(spec, SPEC_CONVERT));
    SET(cache_maps, cache_maps);
    SET(cache_counts, cache_counts);
    SET(live, PyTuple_GET_ITEM(spec, SPEC_LIVE));
#undef SET
    f->promote = (int)PyLong_AsLong(mode);
    f->min_flops = min_flops;
    f->flops_kind = (int)PyLong_AsLong(kind);
    f->vectorcall = fast_call;
finally:
    /* what getattr returned; the fields hold their own references */
    if (cache != Py_None) {
        Py_XDECREF(cache_maps);
        Py_XDECREF(cache_counts);
    }
    return result;
}

static int
fast_traverse(PyObject *self, visitproc visit, void *arg)
{
    Fast *f = FAST(self);
    if (!wrapt_heap)
        Py_VISIT(Py_TYPE(self));
    Py_VISIT(f->original);
    Py_VISIT(f->castable);
    Py_VISIT(f->to);
    Py_VISIT(f->convert);
    Py_VISIT(f->cache_maps);
    Py_VISIT(f->cache_counts);
    Py_VISIT(f->live);
    return wrapt_type->tp_traverse(self, visit, arg);
}

static int
fast_clear(PyObject *self)
{
    Fast *f = FAST(self);
    /* A cleared object is not callable, so fast_call always finds its fields
       set (as an object never initialized: fast_init sets the call last). */
    f->vectorcall = NULL;
    Py_CLEAR(f->original);
    Py_CLEAR(f->castable);
    Py_CLEAR(f->to);
    Py_CLEAR(f->convert);
    Py_CLEAR(f->cache_maps);
    Py_CLEAR(f->cache_counts);
    Py_CLEAR(f->live);
    return wrapt_type->tp_clear(self);
}

static void
fast_dealloc(PyObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    fast_clear(self);
    /* wrapt's dealloc frees the object. The object owns a reference to its
       (heap) type: wrapt's own heap types release it, its static ones do not */
    wrapt_type->tp_dealloc(self);
    if (!wrapt_heap)
        Py_DECREF(type);
}

/* A torch function kept as a class attribute binds as the original does: a
   builtin (torch.mm) is no descriptor and stays unbound; a Python function
   (F.mse_loss) binds through wrapt, as wrappers.OpWrapper does. */
static PyObject *
function_get(PyObject *self, PyObject *obj, PyObject *type)
{
    PyObject *original = FAST(self)->original;
    if (original == NULL || Py_TYPE(original)->tp_descr_get == NULL) {
        Py_INCREF(self);
        return self;
    }
    return wrapt_type->tp_descr_get(self, obj, type);
}

/* A Tensor method binds as a Python function does: x.add is a bound method
   of the wrapper, called with the receiver as args[0]. */
static PyObject *
method_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None) {
        Py_INCREF(self);
        return self;
    }
    return PyMethod_New(self, obj);
}

static PyObject *
make_type(const char *name, PyObject *base, int method)
{
    PyMemberDef members[] = {
        {"__vectorcalloffset__", T_PYSSIZET, 0, READONLY, NULL},
        {NULL, 0, 0, 0, NULL},
    };
    PyType_Slot slots[] = {
        {Py_tp_init, fast_init},
        {Py_tp_call, PyVectorcall_Call},
        {Py_tp_traverse, fast_traverse},
        {Py_tp_clear, fast_clear},
        {Py_tp_dealloc, fast_dealloc},
        {Py_tp_members, members},
        {Py_tp_descr_get, method ? (void *)method_get : (void *)function_get},
        {0, NULL},
    };
    PyType_Spec spec = {
        name,
        (int)(fast_offset + sizeof(Fast)),
        0,
        Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | IMMUTABLE |
            (method ? Py_TPFLAGS_METHOD_DESCRIPTOR : 0),
        slots,
    };
    PyObject *bases, *type;

    members[0].offset = fast_offset + offsetof(Fast, vectorcall);
    bases = PyTuple_Pack(1, base);
    if (bases == NULL)
        return NULL;
    type = PyType_FromSpecWithBases(&spec, bases);
    Py_DECREF(bases);
    return type;
}

/* 1 when the tuple of str `names` is exactly `expected`, else 0 with an ImportError naming `what` */
static int
same_names(PyObject *names, const char **expected, Py_ssize_t n, const char *what)
{
    Py_ssize_t i;
    if (!PyTuple_Check(names) || PyTuple_GET_SIZE(names) < n)
        goto differ;
    for (i = 0; i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        if (!PyUnicode_Check(name) || PyUnicode_CompareWithASCIIString(name, expected[i]) != 0)
            goto differ;
    }
    return 1;
differ:
    PyErr_Format(PyExc_ImportError, "%s's fields are not the ones _fastpath.c reads by position; rebuild the C fast path", what);
    return 0;
}

/* bind(disabled, python_only, OpSpec._fields, CacheEntry): the two dicts read on every
   call, the cache's entry type (made on a miss), and the layouts read by position,
   checked here once */
static PyObject *
fast_bind(PyObject *module, PyObject *args)
{
    PyObject *off, *only, *spec_fields, *entry, *entry_fields;
    int same;
    if (!PyArg_ParseTuple(args, "O!O!OO!", &PyDict_Type, &off, &PyDict_Type, &only, &spec_fields, &PyType_Type, &entry))
        return NULL;
    entry_fields = PyObject_GetAttrString(entry, "_fields");
    if (entry_fields == NULL)
        return NULL;
    same = same_names(spec_fields, spec_names, SPEC_READ, "spec.OpSpec") &&
           same_names(entry_fields, entry_names, ENTRY_SIZE, "cast.CacheEntry");
    Py_DECREF(entry_fields);
    if (!same)
        return NULL;
    if (!PyDict_CheckExact(off) || !PyDict_CheckExact(only)) {
        PyErr_SetString(PyExc_TypeError, "disabled and python_only must be plain dicts");
        return NULL;
    }
    Py_INCREF(entry);
    Py_XSETREF(entry_type, entry);
    Py_INCREF(off);
    Py_XSETREF(disabled, off);
    Py_INCREF(only);
    Py_XSETREF(python_only, only);
    Py_RETURN_NONE;
}

static PyMethodDef fastpath_methods[] = {
    {"bind", fast_bind, METH_VARARGS,
     "bind(disabled, python_only, spec_fields, entry_type): the switches every call reads, the weight cache's "
     "entry type, and a check of the layouts read by position. Called once by amp_patch.patching.wrappers."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fastpath_module = {
    PyModuleDef_HEAD_INIT, "amp_patch.patching._fastpath",
    "The no-cast check of a patched op, in C (see wrappers.py).", -1, fastpath_methods,
};

static PyObject *
import_attr(const char *module, const char *attr)
{
    PyObject *m = PyImport_ImportModule(module), *a;
    if (m == NULL)
        return NULL;
    a = PyObject_GetAttrString(m, attr);
    Py_DECREF(m);
    return a;
}

PyMODINIT_FUNC
PyInit__fastpath(void)
{
    PyObject *m, *function_wrapper, *c_wrapper, *function_type = NULL, *method_type = NULL;

    str_dtype = PyUnicode_InternFromString("dtype");
    str_on = PyUnicode_InternFromString("on");
    str_requires_grad = PyUnicode_InternFromString("requires_grad");
    str_is_leaf = PyUnicode_InternFromString("is_leaf");
    str_staticmethod = PyUnicode_InternFromString("staticmethod");
    str_version = PyUnicode_InternFromString("_version");
    str_data_ptr = PyUnicode_InternFromString("data_ptr");
    str_shape = PyUnicode_InternFromString("shape");
    one = PyLong_FromLong(1);
    if (!str_dtype || !str_on || !str_requires_grad || !str_is_leaf || !str_staticmethod || !str_version || !str_data_ptr ||
        !str_shape ||
        !one)
        return NULL;
    grad_enabled = import_attr("torch._C", "is_grad_enabled");
    if (grad_enabled == NULL)
        return NULL;
    tensor_type = (PyTypeObject *)import_attr("torch", "Tensor");
    parameter_type = (PyTypeObject *)import_attr("torch.nn", "Parameter");
    float32 = import_attr("torch", "float32");
    function_wrapper = import_attr("wrapt", "FunctionWrapper");
    if (!tensor_type || !parameter_type || !float32 || !function_wrapper)
        goto fail;
    if (!PyType_Check(tensor_type) || !PyType_Check(parameter_type) || !PyType_Check(function_wrapper)) {
        PyErr_SetString(PyExc_ImportError, "unexpected torch.Tensor or wrapt");
        goto fail;
    }
    /* with wrapt's pure-Python fallback there is no C object to extend */
    c_wrapper = import_attr("wrapt._wrappers", "FunctionWrapper");
    if (c_wrapper == NULL || c_wrapper != function_wrapper) {
        Py_XDECREF(c_wrapper);
        PyErr_Clear();
        PyErr_SetString(PyExc_ImportError, "wrapt's C extension is not in use");
        goto fail;
    }
    Py_DECREF(c_wrapper);
    wrapt_type = (PyTypeObject *)function_wrapper;
    if (!(wrapt_type->tp_flags & Py_TPFLAGS_HAVE_GC) || wrapt_type->tp_base == NULL || !wrapt_type->tp_call ||
        !wrapt_type->tp_descr_get || !wrapt_type->tp_base->tp_init) {
        PyErr_SetString(PyExc_ImportError, "wrapt.FunctionWrapper is not the C type this module extends");
        goto fail;
    }
    wrapt_heap = (wrapt_type->tp_flags & Py_TPFLAGS_HEAPTYPE) != 0;
    base_init = wrapt_type->tp_base->tp_init;
    fast_offset = wrapt_type->tp_basicsize;
    function_type = make_type("amp_patch.patching._fastpath.FastOpWrapper", function_wrapper, 0);
    method_type = make_type("amp_patch.patching._fastpath.FastMethodWrapper", function_wrapper, 1);
    if (!function_type || !method_type)
        goto fail;
    m = PyModule_Create(&fastpath_module);
    if (m == NULL)
        goto fail;
    if (PyModule_AddObject(m, "FastOpWrapper", function_type) < 0) {
        Py_DECREF(m);
        goto fail;
    }
    function_type = NULL;
    if (PyModule_AddObject(m, "FastMethodWrapper", method_type) < 0) {
        Py_DECREF(m);
        goto fail;
    }
    Py_DECREF(function_wrapper);
    return m;

fail:
    Py_XDECREF(function_type);
    Py_XDECREF(method_type);
    Py_XDECREF(function_wrapper);
    return NULL;
}
