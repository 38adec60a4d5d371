/* stax/cudagraph_replay.c: the replay of a CUDA graph on the last call's very tensors, and
   CompiledFunction.__call__'s hot branch, in C (issue 13: host time per replay). Built at run
   time and loaded by stax/cudagraph_c.py, whose docstring says what each step does and why; the
   Python it stands for is cudagraph.py's `_HOT_SOURCE` and `CompiledFunction.__call__`. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#ifndef T_OBJECT_EX
#define T_OBJECT_EX 16
#endif

typedef int (*launch_fn)(void *exec, void *stream);                       /* cuGraphLaunch */

/* `threading.Lock()`'s object (_threadmodule.c's lockobject, the same from 3.7 through 3.12):
   its PyThread lock taken and given without two method calls (~50 ns), when `make` has checked
   that the lock at hand has this layout; else its acquire and release methods. */
typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock_lock;
    PyObject *in_weakreflist;
    char locked;
} lock_layout;

/* A dict's version tag (PEP 509: a new value on every change of the dict), on 3.11 and 3.12: a
   tensor's dict with the tag it had when its requires_grad was read False is unchanged since. */
#if PY_VERSION_HEX < 0x030D0000
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#define DICT_TAG(d) (((PyDictObject *)(d))->ma_version_tag)
#endif
typedef int (*copy_fn)(unsigned long long dst, unsigned long long src, size_t n, void *stream);

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Py_ssize_t n;
    PyObject *tensors, *dicts;          /* tuples of n: the tensors, their __dict__s */
    PyObject *rec_dict, *token;         /* rec.__dict__ ("again"), the token it must still hold */
    PyObject *acquire, *release;        /* the GraphedCall's lock's bound methods */
    lock_layout *lock;                  /* the same lock, when its layout is known; else NULL */
    PyObject *lock_ref;
    uint64_t *tags;                     /* per tensor: its dict's tag when requires_grad was False */
    PyObject *cell;                     /* the _Generation: its `value` slot at value_off */
    Py_ssize_t value_off;
    launch_fn launch_ptr;               /* NULL: call `launch` */
    void *exec, *stream;
    PyObject *launch, *graph;           /* graph: keeps the graph exec alive while this lives */
    int has_copies;                     /* the token has copies (counted even if all are empty) */
    Py_ssize_t ncopies;                 /* the non-empty ones */
    unsigned long long *dst, *src;
    size_t *nbytes;
    PyObject *copy_args;                /* tuple of (dst, src, nbytes) for `copy` */
    copy_fn copy_ptr;                   /* NULL: call `copy` */
    PyObject *copy, *counts, *ncounted;
    PyObject *array, *meta;             /* the one output's buffer and layout; NULL: `outputs` */
    PyObject *outputs;
    PyTypeObject *array_type, *storage_type, *tensor_type;
    Py_ssize_t array_off, cell_off, gen_off;
    PyObject *fail, *python, *init;     /* init: make the context current on a new thread, or None */
} Replay;

/* PyErr_GetRaisedException is 3.12's: the same on 3.11 through PyErr_Fetch */
static PyObject *raised_exception(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

static PyObject *s_requires_grad, *s_again, *s_copies, *s_cuda, *s_data, *s_device, *s_version,
    *s_storage, *s_meta, *s_base, *s_view_ops, *s_node, *s_grad, *s_grad_fn, *empty, *one, *zero;
static _Thread_local int context_current;   /* this thread has run `init` once */

static int traverse(Replay *self, visitproc visit, void *arg)
{
    Py_VISIT(self->tensors); Py_VISIT(self->dicts); Py_VISIT(self->rec_dict); Py_VISIT(self->token);
    Py_VISIT(self->acquire); Py_VISIT(self->release); Py_VISIT(self->cell); Py_VISIT(self->launch);
    Py_VISIT(self->graph); Py_VISIT(self->copy_args); Py_VISIT(self->copy); Py_VISIT(self->counts);
    Py_VISIT(self->ncounted); Py_VISIT(self->array); Py_VISIT(self->meta); Py_VISIT(self->outputs);
    Py_VISIT(self->array_type); Py_VISIT(self->storage_type); Py_VISIT(self->tensor_type);
    Py_VISIT(self->fail); Py_VISIT(self->python); Py_VISIT(self->init); Py_VISIT(self->lock_ref);
    return 0;
}

static int clear(Replay *self)
{
    Py_CLEAR(self->tensors); Py_CLEAR(self->dicts); Py_CLEAR(self->rec_dict); Py_CLEAR(self->token);
    Py_CLEAR(self->acquire); Py_CLEAR(self->release); Py_CLEAR(self->cell); Py_CLEAR(self->launch);
    Py_CLEAR(self->graph); Py_CLEAR(self->copy_args); Py_CLEAR(self->copy); Py_CLEAR(self->counts);
    Py_CLEAR(self->ncounted); Py_CLEAR(self->array); Py_CLEAR(self->meta); Py_CLEAR(self->outputs);
    Py_CLEAR(self->array_type); Py_CLEAR(self->storage_type); Py_CLEAR(self->tensor_type);
    Py_CLEAR(self->fail); Py_CLEAR(self->python); Py_CLEAR(self->init); Py_CLEAR(self->lock_ref);
    self->lock = NULL;
    return 0;
}

static void dealloc(Replay *self)
{
    PyObject_GC_UnTrack(self);
    clear(self);
    PyMem_Free(self->dst); PyMem_Free(self->src); PyMem_Free(self->nbytes); PyMem_Free(self->tags);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A failure in the copies or the launch: an Exception goes to `fail` (which breaks the graph),
   anything else (KeyboardInterrupt) propagates. 0: reported; -1: an exception to propagate. */
static int failed(Replay *self, PyObject *err, Py_ssize_t i)
{
    PyObject *exc = err, *r;
    if (exc == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_Exception))
            return -1;
        exc = raised_exception();
    } else {
        Py_INCREF(exc);
    }
    PyObject *index = PyLong_FromSsize_t(i);
    r = index ? PyObject_CallFunctionObjArgs(self->fail, exc, index, NULL) : NULL;
    Py_XDECREF(index);
    Py_DECREF(exc);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* object.__new__(tp): no __init__ (as `_new(Tensor)` in cudagraph.py) */
static PyObject *fresh(PyTypeObject *tp)
{
    return PyBaseObject_Type.tp_new(tp, empty, NULL);
}

static PyObject *single_output(Replay *self, PyObject *gen)
{
    PyObject *a = NULL, *s = NULL, *t = NULL, *views = NULL, *out = NULL;
    if ((a = fresh(self->array_type)) == NULL)
        return NULL;
    *(PyObject **)((char *)a + self->array_off) = Py_NewRef(self->array);
    *(PyObject **)((char *)a + self->cell_off) = Py_NewRef(self->cell);
    *(PyObject **)((char *)a + self->gen_off) = Py_NewRef(gen);
    if ((s = fresh(self->storage_type)) == NULL || PyObject_SetAttr(s, s_data, a) < 0 ||
        PyObject_SetAttr(s, s_device, s_cuda) < 0 || PyObject_SetAttr(s, s_version, zero) < 0)
        goto done;
    if ((t = fresh(self->tensor_type)) == NULL || (views = PyList_New(0)) == NULL)
        goto done;
    if (PyObject_SetAttr(t, s_storage, s) < 0 || PyObject_SetAttr(t, s_meta, self->meta) < 0 ||
        PyObject_SetAttr(t, s_base, Py_None) < 0 || PyObject_SetAttr(t, s_view_ops, views) < 0 ||
        PyObject_SetAttr(t, s_node, Py_None) < 0 || PyObject_SetAttr(t, s_requires_grad, Py_False) < 0 ||
        PyObject_SetAttr(t, s_grad, Py_None) < 0 || PyObject_SetAttr(t, s_grad_fn, Py_None) < 0)
        goto done;
    out = PyTuple_Pack(1, t);
done:
    Py_XDECREF(a); Py_XDECREF(s); Py_XDECREF(t); Py_XDECREF(views);
    return out;
}

/* A raw driver call's CUresult `rc` (copy `i`, or the launch: -1), reported through `fail`. */
static int raw_failure(Replay *self, int rc, Py_ssize_t i)
{
    PyObject *code = PyLong_FromLong(rc);
    if (code == NULL)
        return -1;
    int r = failed(self, code, i);
    Py_DECREF(code);
    return r < 0 ? -1 : 0;
}

static int count_copies(Replay *self)   /* counts["copies"] += len(token[1]) */
{
    PyObject *old = PyDict_GetItemWithError(self->counts, s_copies), *sum;
    if (old == NULL && !PyErr_Occurred())
        PyErr_SetObject(PyExc_KeyError, s_copies);
    if (old == NULL || (sum = PyNumber_Add(old, self->ncounted)) == NULL)
        return -1;
    int rc = PyDict_SetItem(self->counts, s_copies, sum);
    Py_DECREF(sum);
    return rc;
}

/* Under the lock: the copies and the launch. 1: launched; 0: failed, reported (return None);
   -1: an exception to propagate. In the order of the Python replay: the copies, their count,
   the launch (a failed copy is not counted, a failed launch is). */
static int run(Replay *self)
{
    Py_ssize_t i, at = -1;
    int rc = 0;
    PyObject *r;
    if (self->init != Py_None && !context_current) {
        if ((r = PyObject_CallNoArgs(self->init)) == NULL)
            return failed(self, NULL, -1) < 0 ? -1 : 0;
        Py_DECREF(r);
        context_current = 1;
    }
    if (self->launch_ptr != NULL && (!self->has_copies || self->copy_ptr != NULL)) {
        /* every driver call raw: the GIL released once around them all (cffi releases it
           around each call) */
        Py_BEGIN_ALLOW_THREADS
        for (i = 0; i < self->ncopies; i++)
            if ((rc = self->copy_ptr(self->dst[i], self->src[i], self->nbytes[i], self->stream)) != 0) {
                at = i;
                break;
            }
        if (rc == 0)
            rc = self->launch_ptr(self->exec, self->stream);
        Py_END_ALLOW_THREADS
        if (rc != 0 && at >= 0)
            return raw_failure(self, rc, at);
        if (self->has_copies && count_copies(self) < 0)
            return failed(self, NULL, -1) < 0 ? -1 : 0;
        return rc != 0 ? raw_failure(self, rc, -1) : 1;
    }
    for (i = 0; i < self->ncopies; i++) {
        if (self->copy_ptr != NULL) {
            Py_BEGIN_ALLOW_THREADS
            rc = self->copy_ptr(self->dst[i], self->src[i], self->nbytes[i], self->stream);
            Py_END_ALLOW_THREADS
            if (rc != 0)
                return raw_failure(self, rc, i);
        } else {
            if ((r = PyObject_Call(self->copy, PyTuple_GET_ITEM(self->copy_args, i), NULL)) == NULL)
                return failed(self, NULL, i) < 0 ? -1 : 0;
            Py_DECREF(r);
        }
    }
    if (self->has_copies && count_copies(self) < 0)
        return failed(self, NULL, -1) < 0 ? -1 : 0;
    if (self->launch_ptr != NULL) {
        Py_BEGIN_ALLOW_THREADS
        rc = self->launch_ptr(self->exec, self->stream);
        Py_END_ALLOW_THREADS
        return rc != 0 ? raw_failure(self, rc, -1) : 1;
    }
    if ((r = PyObject_CallNoArgs(self->launch)) == NULL)
        return failed(self, NULL, -1) < 0 ? -1 : 0;
    Py_DECREF(r);
    return 1;
}

/* The replay of the `size` arguments at `items` under grad mode `grad`: the outputs tuple, False
   (other tensors, or one requires grad), None (recorded again, or the replay failed), NULL (an
   exception), or a new reference to NotImplemented: the Python replay decides. */
static PyObject *replay(Replay *self, PyObject *const *items, Py_ssize_t size, int grad)
{
    Py_ssize_t i;
    PyObject *r, *out = NULL;
    if (size != self->n)
        Py_RETURN_FALSE;
    for (i = 0; i < size; i++)
        if (items[i] != PyTuple_GET_ITEM(self->tensors, i))
            Py_RETURN_FALSE;
    if (grad) {
        for (i = 0; i < size; i++) {
            PyObject *d = PyTuple_GET_ITEM(self->dicts, i);
#ifdef DICT_TAG
            if (DICT_TAG(d) == self->tags[i])
                continue;               /* unchanged since its requires_grad was False */
#endif
            PyObject *v = PyDict_GetItemWithError(d, s_requires_grad);
            if (v == Py_True)
                Py_RETURN_FALSE;
            if (v != Py_False)      /* missing (KeyError), or not a bool: as the Python replay does */
                return PyErr_Occurred() ? NULL : Py_NewRef(Py_NotImplemented);
#ifdef DICT_TAG
            self->tags[i] = DICT_TAG(d);
#endif
        }
    }
    /* the lock: a non-blocking try (what `acquire()` tries first), then `acquire()`, which waits
       with the GIL released */
    if (self->lock == NULL || !PyThread_acquire_lock(self->lock->lock_lock, NOWAIT_LOCK)) {
        if ((r = PyObject_CallNoArgs(self->acquire)) == NULL)
            return NULL;
        Py_DECREF(r);
    } else {
        self->lock->locked = 1;
    }
    PyObject *again = PyDict_GetItemWithError(self->rec_dict, s_again);
    if (again != self->token) {
        if (again == NULL && PyErr_Occurred())
            goto release;
        out = Py_NewRef(Py_None);      /* recorded again, closed, or another call's tensors */
        goto release;
    }
    int ran = run(self);
    if (ran <= 0) {
        if (ran == 0)
            out = Py_NewRef(Py_None);  /* a driver failure, reported: the usual path runs directly */
        goto release;
    }
    PyObject **slot = (PyObject **)((char *)self->cell + self->value_off), *gen;
    if (*slot == NULL) {
        PyErr_SetString(PyExc_AttributeError, "value");
        goto release;
    }
    if ((gen = PyNumber_Add(*slot, one)) == NULL)
        goto release;
    Py_SETREF(*slot, gen);          /* every output of earlier replays is now overwritten */
    out = self->array != NULL ? single_output(self, gen) : PyObject_CallOneArg(self->outputs, self->cell);
release:
    if (self->lock != NULL) {
        self->lock->locked = 0;
        PyThread_release_lock(self->lock->lock_lock);
    } else if ((r = PyObject_CallNoArgs(self->release)) == NULL) {
        Py_XDECREF(out);
        return NULL;
    } else {
        Py_DECREF(r);
    }
    return out;
}

static PyObject *replay_call(PyObject *op, PyObject *const *argv, size_t nargsf, PyObject *kw)
{
    Replay *self = (Replay *)op;
    Py_ssize_t size, nargs = PyVectorcall_NARGS(nargsf);
    PyObject **items, *out;
    if (nargs != 2 || (kw != NULL && PyTuple_GET_SIZE(kw) != 0)) {
        PyErr_SetString(PyExc_TypeError, "replay(args, grad) takes two arguments");
        return NULL;
    }
    if (PyTuple_CheckExact(argv[0])) {
        items = &PyTuple_GET_ITEM(argv[0], 0);
        size = PyTuple_GET_SIZE(argv[0]);
    } else if (PyList_CheckExact(argv[0])) {
        items = ((PyListObject *)argv[0])->ob_item;
        size = PyList_GET_SIZE(argv[0]);
    } else {
        return PyObject_Vectorcall(self->python, argv, nargsf, kw);
    }
    int grad = argv[1] == Py_True ? 1 : argv[1] == Py_False ? 0 : PyObject_IsTrue(argv[1]);
    if (grad < 0)
        return NULL;
    out = replay(self, items, size, grad);
    if (out == Py_NotImplemented) {
        Py_DECREF(out);
        return PyObject_Vectorcall(self->python, argv, nargsf, kw);
    }
    return out;
}

static PyObject *replay_how(Replay *self, void *which)   /* what it does without Python */
{
    switch ((int)(intptr_t)which) {
    case 0: return PyBool_FromLong(self->lock != NULL);
    case 1: return PyBool_FromLong(self->launch_ptr != NULL);
    default: return PyBool_FromLong(self->copy_ptr != NULL);
    }
}

static PyGetSetDef replay_getset[] = {
    {"direct_lock", (getter)replay_how, NULL, "the lock's PyThread lock taken directly", (void *)0},
    {"raw_launch", (getter)replay_how, NULL, "the launch a C call through an address", (void *)1},
    {"raw_copy", (getter)replay_how, NULL, "the copies C calls through an address", (void *)2},
    {NULL},
};

static PyTypeObject ReplayType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stax_replay.Replay",
    .tp_basicsize = sizeof(Replay),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "replay(args, grad): a CUDA graph's replay of the last call's very tensors",
    .tp_vectorcall_offset = offsetof(Replay, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_traverse = (traverseproc)traverse,
    .tp_clear = (inquiry)clear,
    .tp_dealloc = (destructor)dealloc,
    .tp_getset = replay_getset,
};

/* The offset of the __slots__ member `name` of `tp` (a T_OBJECT_EX member descriptor). */
static int slot_offset(PyObject *tp, const char *name, Py_ssize_t *off)
{
    PyObject *d = PyObject_GetAttrString(tp, name);
    if (d == NULL)
        return -1;
    int ok = Py_IS_TYPE(d, &PyMemberDescr_Type) &&
             ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX;
    if (ok)
        *off = ((PyMemberDescrObject *)d)->d_member->offset;
    Py_DECREF(d);
    if (!ok)
        PyErr_Format(PyExc_TypeError, "%s is not a __slots__ member", name);
    return ok ? 0 : -1;
}

/* `lock` as a lock_layout, if it is a `_thread.lock` of that layout: its `locked` flag agrees
   with `lock.locked()`, and taking and giving its PyThread lock shows in `lock.locked()`. NULL
   (no error) otherwise: the replay calls its methods. */
static int locked(PyObject *lock)
{
    PyObject *r = PyObject_CallMethod(lock, "locked", NULL);
    int v = r == NULL ? -1 : PyObject_IsTrue(r);
    Py_XDECREF(r);
    return v;
}

static lock_layout *known_lock(PyObject *lock)
{
    lock_layout *l = (lock_layout *)lock;
    if (PY_VERSION_HEX >= 0x030D0000 || strcmp(Py_TYPE(lock)->tp_name, "_thread.lock") != 0 ||
        Py_TYPE(lock)->tp_basicsize != sizeof(lock_layout) || (l->locked != 0 && l->locked != 1))
        return NULL;
    int was = locked(lock);
    if (was < 0 || was != l->locked) {
        PyErr_Clear();
        return NULL;
    }
    if (!was) {
        if (!PyThread_acquire_lock(l->lock_lock, NOWAIT_LOCK))
            return NULL;
        l->locked = 1;
        int now = locked(lock);
        l->locked = 0;
        PyThread_release_lock(l->lock_lock);
        if (now != 1 || locked(lock) != 0) {
            PyErr_Clear();
            return NULL;
        }
    }
    return l;
}

static int as_pointer(PyObject *v, void **p)
{
    *p = PyLong_AsVoidPtr(v);
    return *p == NULL && PyErr_Occurred() ? -1 : 0;
}

/* make(python, tensors, dicts, rec_dict, token, lock, cell, launch, copies, copy, counts,
        ncounted, single, outputs, types, fail, init) -- see cudagraph_c.make_replay */
static PyObject *make(PyObject *module, PyObject *args)
{
    PyObject *python, *tensors, *dicts, *rec_dict, *token, *lock, *cell, *launch, *copies,
        *copy, *counts, *ncounted, *single, *outputs, *types, *fail, *init;
    if (!PyArg_ParseTuple(args, "OO!O!O!OOOOOOO!OOOO!OO", &python, &PyTuple_Type, &tensors, &PyTuple_Type,
                          &dicts, &PyDict_Type, &rec_dict, &token, &lock, &cell, &launch,
                          &copies, &copy, &PyDict_Type, &counts, &ncounted, &single, &outputs,
                          &PyTuple_Type, &types, &fail, &init))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(tensors), i;
    if (PyTuple_GET_SIZE(dicts) != n || PyTuple_GET_SIZE(types) != 3) {
        PyErr_SetString(PyExc_ValueError, "make: tensors and dicts differ in length, or not 3 types");
        return NULL;
    }
    for (i = 0; i < 3; i++)
        if (!PyType_Check(PyTuple_GET_ITEM(types, i))) {
            PyErr_SetString(PyExc_TypeError, "make: types must be types");
            return NULL;
        }
    for (i = 0; i < n; i++)
        if (!PyDict_CheckExact(PyTuple_GET_ITEM(dicts, i))) {
            PyErr_SetString(PyExc_TypeError, "make: dicts must be dicts");
            return NULL;
        }
    Replay *self = PyObject_GC_New(Replay, &ReplayType);
    if (self == NULL)
        return NULL;
    memset((char *)self + sizeof(PyObject), 0, sizeof(Replay) - sizeof(PyObject));
    self->vectorcall = replay_call;
    self->n = n;
    self->tensors = Py_NewRef(tensors); self->dicts = Py_NewRef(dicts);
    self->rec_dict = Py_NewRef(rec_dict); self->token = Py_NewRef(token);
    PyObject *acquire = PyObject_GetAttrString(lock, "acquire"), *release = PyObject_GetAttrString(lock, "release");
    self->acquire = acquire; self->release = release;
    self->lock_ref = Py_NewRef(lock);
    self->cell = Py_NewRef(cell); self->counts = Py_NewRef(counts); self->ncounted = Py_NewRef(ncounted);
    self->outputs = Py_NewRef(outputs); self->fail = Py_NewRef(fail); self->python = Py_NewRef(python);
    self->init = Py_NewRef(init);
    self->array_type = (PyTypeObject *)Py_NewRef(PyTuple_GET_ITEM(types, 0));
    self->storage_type = (PyTypeObject *)Py_NewRef(PyTuple_GET_ITEM(types, 1));
    self->tensor_type = (PyTypeObject *)Py_NewRef(PyTuple_GET_ITEM(types, 2));
    PyObject_GC_Track(self);
    if (acquire == NULL || release == NULL)
        goto fail;
    self->lock = known_lock(lock);
    if (PyErr_Occurred())
        goto fail;
    if ((self->tags = PyMem_Calloc(n + 1, sizeof(uint64_t))) == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    if (slot_offset((PyObject *)Py_TYPE(cell), "value", &self->value_off) < 0 ||
        slot_offset((PyObject *)self->array_type, "_array", &self->array_off) < 0 ||
        slot_offset((PyObject *)self->array_type, "_cell", &self->cell_off) < 0 ||
        slot_offset((PyObject *)self->array_type, "_gen", &self->gen_off) < 0)
        goto fail;
    /* launch: (address, graph exec, stream, graph) or a callable */
    if (PyTuple_Check(launch)) {
        void *fn;
        if (PyTuple_GET_SIZE(launch) != 4 || as_pointer(PyTuple_GET_ITEM(launch, 0), &fn) < 0 ||
            as_pointer(PyTuple_GET_ITEM(launch, 1), &self->exec) < 0 ||
            as_pointer(PyTuple_GET_ITEM(launch, 2), &self->stream) < 0 || fn == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "make: launch is (address, exec, stream, graph)");
            goto fail;
        }
        self->launch_ptr = (launch_fn)fn;
        self->graph = Py_NewRef(PyTuple_GET_ITEM(launch, 3));
    } else {
        self->launch = Py_NewRef(launch);
    }
    /* copies: None, or a tuple of (dst, src, nbytes), the empty ones left out; copy: (address,
       stream) or a callable */
    if (copies != Py_None) {
        if (!PyTuple_Check(copies)) {
            PyErr_SetString(PyExc_TypeError, "make: copies must be a tuple or None");
            goto fail;
        }
        self->has_copies = 1;
        self->ncopies = PyTuple_GET_SIZE(copies);
        self->copy_args = Py_NewRef(copies);
        self->dst = PyMem_Calloc(self->ncopies + 1, sizeof(unsigned long long));
        self->src = PyMem_Calloc(self->ncopies + 1, sizeof(unsigned long long));
        self->nbytes = PyMem_Calloc(self->ncopies + 1, sizeof(size_t));
        if (!self->dst || !self->src || !self->nbytes) {
            PyErr_NoMemory();
            goto fail;
        }
        for (i = 0; i < self->ncopies; i++) {
            PyObject *c = PyTuple_GET_ITEM(copies, i);
            if (!PyTuple_Check(c) || PyTuple_GET_SIZE(c) != 3) {
                PyErr_SetString(PyExc_TypeError, "make: a copy is (dst, src, nbytes)");
                goto fail;
            }
            self->dst[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(c, 0));
            self->src[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(c, 1));
            self->nbytes[i] = PyLong_AsSize_t(PyTuple_GET_ITEM(c, 2));
            if (PyErr_Occurred())
                goto fail;
        }
        if (PyTuple_Check(copy)) {
            void *fn, *stream;
            if (PyTuple_GET_SIZE(copy) != 2 || as_pointer(PyTuple_GET_ITEM(copy, 0), &fn) < 0 ||
                as_pointer(PyTuple_GET_ITEM(copy, 1), &stream) < 0 || fn == NULL) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_ValueError, "make: copy is (address, stream)");
                goto fail;
            }
            if (self->launch_ptr != NULL && stream != self->stream) {
                PyErr_SetString(PyExc_ValueError, "make: the copies and the launch on two streams");
                goto fail;
            }
            self->copy_ptr = (copy_fn)fn;
            self->stream = stream;
        } else {
            self->copy = Py_NewRef(copy);
        }
    }
    /* single: (array, meta) of the one output over one graph-owned buffer, or None: `outputs` */
    if (single != Py_None) {
        if (!PyTuple_Check(single) || PyTuple_GET_SIZE(single) != 2) {
            PyErr_SetString(PyExc_TypeError, "make: single is (array, meta) or None");
            goto fail;
        }
        self->array = Py_NewRef(PyTuple_GET_ITEM(single, 0));
        self->meta = Py_NewRef(PyTuple_GET_ITEM(single, 1));
    }
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

/* ---- CompiledFunction.__call__'s hot branch (stax/__init__.py) in C: `install_entry` ---- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *python;                   /* the class's own (Python) __call__: everything else */
    PyObject *tls, *precision, *mode;   /* tensor._TLS, template_tuning._precision, autograd._mode */
    PyTypeObject *last_type;            /* specialize.LastCall: its hot, reads, spec slots */
    Py_ssize_t hot_off, reads_off, spec_off;
} Entry;

static PyObject *s_fast, *s_reads, *s_precision, *s_stats, *s_calls, *s_tracer, *s_enabled, *s_result;

static int count_call(PyObject *d)      /* self.stats["calls"] += 1 */
{
    PyObject *stats = PyDict_GetItemWithError(d, s_stats), *old, *sum;
    if (stats == NULL || (old = PyObject_GetItem(stats, s_calls)) == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_AttributeError, s_stats);
        return -1;
    }
    sum = PyNumber_Add(old, one);
    Py_DECREF(old);
    if (sum == NULL)
        return -1;
    int rc = PyObject_SetItem(stats, s_calls, sum);
    Py_DECREF(sum);
    return rc;
}

/* self(*args): when the last call's LastCall holds a C Replay and the hot branch's checks hold
   (no keywords; fast.reads is self.reads; no tracer; the matmul precision compiled for; grad
   mode read), the replay, counted, and its result; anything else (a check fails, the replay
   refuses or fails) runs the Python __call__ from its first line, as if this were not here. */
static PyObject *entry_call(PyObject *op, PyObject *const *argv, size_t nargsf, PyObject *kwnames)
{
    Entry *e = (Entry *)op;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *d = NULL, *fast = NULL, *hot = NULL, *v, *out = NULL, *result = NULL;
    int grad;
    if (nargs < 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0))
        goto python;
    if ((d = PyObject_GenericGetDict(argv[0], NULL)) == NULL)
        goto python;
    fast = PyDict_GetItemWithError(d, s_fast);
    if (fast == NULL || Py_TYPE(fast) != e->last_type)
        goto python;
    hot = *(PyObject **)((char *)fast + e->hot_off);
    if (hot == NULL || Py_TYPE(hot) != &ReplayType)
        goto python;
    v = *(PyObject **)((char *)fast + e->reads_off);
    if (v == NULL || v != PyDict_GetItemWithError(d, s_reads))
        goto python;
    if ((v = PyObject_GetAttr(e->tls, s_tracer)) == NULL)
        goto python;
    Py_DECREF(v);
    if (v != Py_None || PyList_GET_SIZE(e->precision) < 1 ||
        PyList_GET_ITEM(e->precision, 0) != PyDict_GetItemWithError(d, s_precision))
        goto python;
    if ((v = PyObject_GetAttr(e->mode, s_enabled)) == NULL)
        goto python;
    grad = v == Py_True ? 1 : v == Py_False ? 0 : PyObject_IsTrue(v);
    Py_DECREF(v);
    if (grad < 0)
        goto python;
    Py_INCREF(fast);                    /* (another thread may replace self._fast meanwhile) */
    Py_INCREF(hot);
    out = replay((Replay *)hot, argv + 1, nargs - 1, grad);
    Py_DECREF(hot);
    if (out != NULL && !PyTuple_CheckExact(out)) {      /* refused: the Python __call__ decides */
        Py_CLEAR(out);
        Py_CLEAR(fast);
        goto python;
    }
    if (count_call(d) < 0) {
        Py_XDECREF(out);
        Py_DECREF(fast);
        Py_DECREF(d);
        return NULL;
    }
    if (out != NULL) {
        v = *(PyObject **)((char *)fast + e->spec_off);
        if (v == Py_None && PyTuple_GET_SIZE(out) >= 1) {
            result = Py_NewRef(PyTuple_GET_ITEM(out, 0));
        } else {
            PyObject *args = PyTuple_New(nargs - 1);
            if (args != NULL) {
                for (Py_ssize_t i = 1; i < nargs; i++)
                    PyTuple_SET_ITEM(args, i - 1, Py_NewRef(argv[i]));
                result = PyObject_CallMethodObjArgs(fast, s_result, out, args, NULL);
                Py_DECREF(args);
            }
        }
        Py_DECREF(out);
    }
    Py_DECREF(fast);
    Py_DECREF(d);
    return result;
python:
    if (PyErr_Occurred())               /* (the Python __call__ meets it again and raises it) */
        PyErr_Clear();
    Py_XDECREF(d);
    return PyObject_Vectorcall(e->python, argv, nargsf, kwnames);
}

static PyObject *entry_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);     /* `cf.__call__`: bound, as a function's would be */
}

static int entry_traverse(Entry *self, visitproc visit, void *arg)
{
    Py_VISIT(self->python); Py_VISIT(self->tls); Py_VISIT(self->precision); Py_VISIT(self->mode);
    Py_VISIT(self->last_type);
    return 0;
}

static int entry_clear(Entry *self)
{
    Py_CLEAR(self->python); Py_CLEAR(self->tls); Py_CLEAR(self->precision); Py_CLEAR(self->mode);
    Py_CLEAR(self->last_type);
    return 0;
}

static void entry_dealloc(Entry *self)
{
    PyObject_GC_UnTrack(self);
    entry_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *entry_name(Entry *self, void *which)    /* the Python __call__'s names */
{
    return PyObject_GetAttrString(self->python, which ? "__qualname__" : "__name__");
}

static PyGetSetDef entry_getset[] = {
    {"__name__", (getter)entry_name, NULL, NULL, NULL},
    {"__qualname__", (getter)entry_name, NULL, NULL, (void *)1},
    {NULL},
};

static PyMemberDef entry_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(Entry, python), READONLY, "the Python __call__"},
    {NULL},
};

static PyTypeObject EntryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stax_replay.Entry",
    .tp_basicsize = sizeof(Entry),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "CompiledFunction.__call__ with its CUDA-graph hot branch in C (cudagraph_c.install_entry)",
    .tp_vectorcall_offset = offsetof(Entry, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = entry_get,
    .tp_members = entry_members,
    .tp_getset = entry_getset,
    .tp_traverse = (traverseproc)entry_traverse,
    .tp_clear = (inquiry)entry_clear,
    .tp_dealloc = (destructor)entry_dealloc,
};

/* entry(python, tls, precision, mode, last_type) -- see cudagraph_c.install_entry */
static PyObject *entry(PyObject *module, PyObject *args)
{
    PyObject *python, *tls, *precision, *mode, *last_type;
    if (!PyArg_ParseTuple(args, "OOO!OO!", &python, &tls, &PyList_Type, &precision, &mode, &PyType_Type,
                          &last_type))
        return NULL;
    Entry *self = PyObject_GC_New(Entry, &EntryType);
    if (self == NULL)
        return NULL;
    self->vectorcall = entry_call;
    self->python = Py_NewRef(python); self->tls = Py_NewRef(tls); self->precision = Py_NewRef(precision);
    self->mode = Py_NewRef(mode); self->last_type = (PyTypeObject *)Py_NewRef(last_type);
    PyObject_GC_Track(self);
    if (slot_offset(last_type, "hot", &self->hot_off) < 0 || slot_offset(last_type, "reads", &self->reads_off) < 0 ||
        slot_offset(last_type, "spec", &self->spec_off) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* Driver-shaped C functions for tests and the CPU bench: they count calls and return `stub_rc`. */
static long long stub_launches, stub_copies;
static int stub_rc;
static int stub_launch(void *exec, void *stream) { (void)exec; (void)stream; stub_launches++; return stub_rc; }
static int stub_copy(unsigned long long d, unsigned long long s, size_t n, void *stream)
{
    (void)d; (void)s; (void)n; (void)stream;
    stub_copies++;
    return stub_rc;
}

static PyObject *stubs(PyObject *module, PyObject *args)
{
    int rc = -1;
    if (!PyArg_ParseTuple(args, "|i", &rc))
        return NULL;
    if (rc >= 0)
        stub_rc = rc;
    return Py_BuildValue("(KKLLi)", (unsigned long long)(uintptr_t)stub_launch,
                         (unsigned long long)(uintptr_t)stub_copy, stub_launches, stub_copies, stub_rc);
}

static PyMethodDef methods[] = {
    {"make", make, METH_VARARGS, "make(...) -> Replay (cudagraph_c.make_replay)"},
    {"entry", entry, METH_VARARGS, "entry(python, tls, precision, mode, last_type) -> Entry (cudagraph_c.install_entry)"},
    {"stubs", stubs, METH_VARARGS,
     "stubs([rc]) -> (launch address, copy address, launches, copies, rc); rc: what they return from now on"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "stax_replay", NULL, -1, methods};

PyMODINIT_FUNC PyInit_stax_replay(void)
{
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(s_requires_grad, "requires_grad"); INTERN(s_again, "again"); INTERN(s_copies, "copies");
    INTERN(s_cuda, "cuda"); INTERN(s_data, "data"); INTERN(s_device, "device"); INTERN(s_version, "version");
    INTERN(s_storage, "_storage"); INTERN(s_meta, "_meta"); INTERN(s_base, "_base");
    INTERN(s_view_ops, "_view_ops"); INTERN(s_node, "_node"); INTERN(s_grad, "grad");
    INTERN(s_grad_fn, "_grad_fn"); INTERN(s_fast, "_fast"); INTERN(s_reads, "reads");
    INTERN(s_precision, "_precision"); INTERN(s_stats, "stats"); INTERN(s_calls, "calls");
    INTERN(s_tracer, "tracer"); INTERN(s_enabled, "enabled"); INTERN(s_result, "result");
    if ((empty = PyTuple_New(0)) == NULL || (one = PyLong_FromLong(1)) == NULL ||
        (zero = PyLong_FromLong(0)) == NULL || PyType_Ready(&ReplayType) < 0 || PyType_Ready(&EntryType) < 0)
        return NULL;
    return PyModule_Create(&moduledef);
}
