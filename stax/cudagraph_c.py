"""§9.9 CUDA graphs, the replay of the same tensors in C (issue 13: host µs per replay).

Layer: runtime, under cudagraph.py (which alone uses it). Imports `cache` (the cache folder, the
compiler run, the library's recorded hash) and `cuda` (the driver's function addresses); it knows
nothing of recordings: cudagraph.py hands it every object the replay touches.

`GraphedCall.replayer`'s generated Python replay of a call with the last call's very tensors
costs ~1 µs of Python around the one cuGraphLaunch (~3.4 µs on the H200 host, which runs the same
Python ~2x slower than a dev box). The C `Replay` here does the same steps for the same cases,
returns the same values (the outputs tuple; False: other tensors, or one that requires grad
under grad mode; None: the recording changed, or the replay failed and the graph is broken now):
  1. the argument count and one `is` per tensor; under grad mode requires_grad read from each
     tensor's own __dict__ (a value other than True/False: the Python replay decides);
  2. the GraphedCall's lock (its bound `acquire`: a non-blocking try first, which is the lock's
     own first step, then a wait with the GIL released; `GraphOutputArray.host` holds the same
     lock across its check and copy);
  3. `rec.again is token`, read from the recording's __dict__;
  4. the staged copies and the launch: raw driver calls (cuMemcpyDtoDAsync_v2, cuGraphLaunch
     through their addresses in the cffi library, with the GIL released around each, as cffi
     releases it) or, for a fake driver, its Python callables; a failure calls `fail(err, i)`
     (err: the CUresult or the exception; i: the copy's index, -1 the launch), which reports
     it and breaks the graph, and the replay returns None, as the Python replay does;
  5. `cell.value += 1`, then the outputs: for one output over one graph-owned buffer the
     GraphOutputArray, Storage and Tensor made without __init__ with `Recording.outputs`'s
     fields (slots written at their offsets, dict attributes set in the same order), else
     `rec.outputs(cell)` itself.
Arguments neither a tuple nor a list go to the Python replay (`python`), unchanged.

The extension is compiled at run time (as Triton builds its launchers) with the host's C compiler
($CC, else gcc, cc, clang) against `sysconfig.get_paths()['include']`, cached in
`<cache>/cpp/replay-<key>.so` (key: the source, the Python version and ABI, the compiler) with its
sha256 recorded beside it (cache.py's rule for libraries), and loaded with importlib. No compiler,
no Python.h, a failed build, or STAX_CUDAGRAPH_C=0: `unavailable()` says why, and cudagraph.py
uses the Python replay (logged once under STAX_LOGS=cudagraphs).

Where to look: `make_replay` (what the C replay is given), `raw_launch`/`raw_copy` (the driver's
addresses), `module`/`_build` (compile and load), `_SOURCE` (`replay_call` is the whole hot path;
`stub_*`: C functions with the driver's signatures for tests and bench/host_path.py, no GPU).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
import threading
from pathlib import Path

from . import cache, cuda

_SOURCE = r'''
/* stax/cudagraph_c.py: the replay of a CUDA graph on the last call's very tensors. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#ifndef T_OBJECT_EX
#define T_OBJECT_EX 16
#endif

typedef int (*launch_fn)(void *exec, void *stream);                       /* cuGraphLaunch */
typedef int (*copy_fn)(unsigned long long dst, unsigned long long src, size_t n, void *stream);

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Py_ssize_t n;
    PyObject *tensors, *dicts;          /* tuples of n: the tensors, their __dict__s */
    PyObject *rec_dict, *token;         /* rec.__dict__ ("again"), the token it must still hold */
    PyObject *acquire, *release;        /* the GraphedCall's lock's bound methods */
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
    Py_VISIT(self->fail); Py_VISIT(self->python); Py_VISIT(self->init);
    return 0;
}

static int clear(Replay *self)
{
    Py_CLEAR(self->tensors); Py_CLEAR(self->dicts); Py_CLEAR(self->rec_dict); Py_CLEAR(self->token);
    Py_CLEAR(self->acquire); Py_CLEAR(self->release); Py_CLEAR(self->cell); Py_CLEAR(self->launch);
    Py_CLEAR(self->graph); Py_CLEAR(self->copy_args); Py_CLEAR(self->copy); Py_CLEAR(self->counts);
    Py_CLEAR(self->ncounted); Py_CLEAR(self->array); Py_CLEAR(self->meta); Py_CLEAR(self->outputs);
    Py_CLEAR(self->array_type); Py_CLEAR(self->storage_type); Py_CLEAR(self->tensor_type);
    Py_CLEAR(self->fail); Py_CLEAR(self->python); Py_CLEAR(self->init);
    return 0;
}

static void dealloc(Replay *self)
{
    PyObject_GC_UnTrack(self);
    clear(self);
    PyMem_Free(self->dst); PyMem_Free(self->src); PyMem_Free(self->nbytes);
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

/* Under the lock: the copies and the launch. 1: launched; 0: failed, reported (return None);
   -1: an exception to propagate. */
static int run(Replay *self)
{
    Py_ssize_t i;
    int rc;
    PyObject *r;
    if (self->init != Py_None && !context_current) {
        if ((r = PyObject_CallNoArgs(self->init)) == NULL)
            return failed(self, NULL, -1) < 0 ? -1 : 0;
        Py_DECREF(r);
        context_current = 1;
    }
    if (self->has_copies) {
        for (i = 0; i < self->ncopies; i++) {
            if (self->copy_ptr != NULL) {
                Py_BEGIN_ALLOW_THREADS
                rc = self->copy_ptr(self->dst[i], self->src[i], self->nbytes[i], self->stream);
                Py_END_ALLOW_THREADS
                if (rc != 0) {
                    PyObject *code = PyLong_FromLong(rc);
                    if (code == NULL)
                        return -1;
                    rc = failed(self, code, i);
                    Py_DECREF(code);
                    return rc < 0 ? -1 : 0;
                }
            } else {
                r = PyObject_Call(self->copy, PyTuple_GET_ITEM(self->copy_args, i), NULL);
                if (r == NULL)
                    return failed(self, NULL, i) < 0 ? -1 : 0;
                Py_DECREF(r);
            }
        }
        PyObject *old = PyDict_GetItemWithError(self->counts, s_copies), *sum;
        if (old == NULL && !PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, s_copies);
        if (old == NULL || (sum = PyNumber_Add(old, self->ncounted)) == NULL)
            return failed(self, NULL, -1) < 0 ? -1 : 0;
        rc = PyDict_SetItem(self->counts, s_copies, sum);
        Py_DECREF(sum);
        if (rc < 0)
            return failed(self, NULL, -1) < 0 ? -1 : 0;
    }
    if (self->launch_ptr != NULL) {
        Py_BEGIN_ALLOW_THREADS
        rc = self->launch_ptr(self->exec, self->stream);
        Py_END_ALLOW_THREADS
        if (rc != 0) {
            PyObject *code = PyLong_FromLong(rc);
            if (code == NULL)
                return -1;
            rc = failed(self, code, -1);
            Py_DECREF(code);
            return rc < 0 ? -1 : 0;
        }
    } else {
        if ((r = PyObject_CallNoArgs(self->launch)) == NULL)
            return failed(self, NULL, -1) < 0 ? -1 : 0;
        Py_DECREF(r);
    }
    return 1;
}

static PyObject *replay_call(PyObject *op, PyObject *const *argv, size_t nargsf, PyObject *kw)
{
    Replay *self = (Replay *)op;
    Py_ssize_t i, size, nargs = PyVectorcall_NARGS(nargsf);
    PyObject **items, *grad, *r, *out = NULL;
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
    if (size != self->n)
        Py_RETURN_FALSE;
    for (i = 0; i < size; i++)
        if (items[i] != PyTuple_GET_ITEM(self->tensors, i))
            Py_RETURN_FALSE;
    grad = argv[1];
    if (grad != Py_False && (grad == Py_True || PyObject_IsTrue(grad))) {
        if (PyErr_Occurred())
            return NULL;
        for (i = 0; i < size; i++) {
            PyObject *v = PyDict_GetItemWithError(PyTuple_GET_ITEM(self->dicts, i), s_requires_grad);
            if (v == Py_True)
                Py_RETURN_FALSE;
            if (v != Py_False)      /* missing (KeyError), or not a bool: as the Python replay does */
                return PyErr_Occurred() ? NULL : PyObject_Vectorcall(self->python, argv, nargsf, kw);
        }
    }
    if ((r = PyObject_CallNoArgs(self->acquire)) == NULL)
        return NULL;
    Py_DECREF(r);
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
    if ((r = PyObject_CallNoArgs(self->release)) == NULL) {
        Py_XDECREF(out);
        return NULL;
    }
    Py_DECREF(r);
    return out;
}

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

static int as_pointer(PyObject *v, void **p)
{
    *p = PyLong_AsVoidPtr(v);
    return *p == NULL && PyErr_Occurred() ? -1 : 0;
}

/* make(python, tensors, dicts, rec_dict, token, acquire, release, cell, launch, copies, copy, counts,
        ncounted, single, outputs, types, fail, init) -- see cudagraph_c.make_replay */
static PyObject *make(PyObject *module, PyObject *args)
{
    PyObject *python, *tensors, *dicts, *rec_dict, *token, *acquire, *release, *cell, *launch, *copies,
        *copy, *counts, *ncounted, *single, *outputs, *types, *fail, *init;
    if (!PyArg_ParseTuple(args, "OO!O!O!OOOOOOOO!OOOO!OO", &python, &PyTuple_Type, &tensors, &PyTuple_Type,
                          &dicts, &PyDict_Type, &rec_dict, &token, &acquire, &release, &cell, &launch,
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
    self->acquire = Py_NewRef(acquire); self->release = Py_NewRef(release);
    self->cell = Py_NewRef(cell); self->counts = Py_NewRef(counts); self->ncounted = Py_NewRef(ncounted);
    self->outputs = Py_NewRef(outputs); self->fail = Py_NewRef(fail); self->python = Py_NewRef(python);
    self->init = Py_NewRef(init);
    self->array_type = (PyTypeObject *)Py_NewRef(PyTuple_GET_ITEM(types, 0));
    self->storage_type = (PyTypeObject *)Py_NewRef(PyTuple_GET_ITEM(types, 1));
    self->tensor_type = (PyTypeObject *)Py_NewRef(PyTuple_GET_ITEM(types, 2));
    PyObject_GC_Track(self);
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
    INTERN(s_grad_fn, "_grad_fn");
    if ((empty = PyTuple_New(0)) == NULL || (one = PyLong_FromLong(1)) == NULL ||
        (zero = PyLong_FromLong(0)) == NULL || PyType_Ready(&ReplayType) < 0)
        return NULL;
    return PyModule_Create(&moduledef);
}
'''

def source() -> str:
    """The extension's C source."""
    return _SOURCE


_STATE: dict = {}           # "module" / "why": the outcome of the one build per process
_LOCK = threading.Lock()
CFLAGS = ["-O2", "-shared", "-fPIC", "-fno-strict-aliasing"]


def _compiler() -> str | None:
    for name in [os.environ.get("CC", "").split()[0] if os.environ.get("CC", "").strip() else None,
                 "gcc", "cc", "clang"]:
        found = name and shutil.which(name)
        if found:
            return found
    return None


def _build():
    """(module, None) or (None, why)."""
    include = sysconfig.get_paths().get("include") or ""
    if not os.path.exists(os.path.join(include, "Python.h")):
        return None, f"no Python.h under {include!r} (install the Python development headers)"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler ($CC, gcc, cc, clang)"
    text = source()
    key = cache.content_hash(text, sys.version, sysconfig.get_config_var("EXT_SUFFIX") or "", cc,
                             " ".join(CFLAGS), include)
    so = cache.folder("cpp") / f"replay-{key}.so"
    if not cache._verified_library(so):                  # (cache.py's load path for libraries)
        kept = cache.atomic_write(so.with_suffix(".c"), text)
        with cache._work_dir() as work:
            src, out = Path(work) / "replay.c", Path(work) / "replay.so"
            src.write_text(text)
            rc, log = cache._run_compiler([cc, *CFLAGS, f"-I{include}", str(src), "-o", str(out)])
            if rc != 0 or not out.exists():
                lines = log.replace(str(src), str(kept)).splitlines()
                return None, f"{cc} failed (exit {rc}): " + " | ".join(lines[:3])
            cache._store_library(so, out.read_bytes())
    spec = importlib.util.spec_from_file_location("stax_replay", str(so))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, None


def module():
    """The compiled extension (built or loaded once per process), or None: `unavailable()`."""
    if os.environ.get("STAX_CUDAGRAPH_C", "1") == "0":
        return None
    if "why" not in _STATE:
        with _LOCK:
            if "why" not in _STATE:
                try:
                    mod, why = _build()
                except Exception as e:  # noqa: BLE001 -- any failure: the Python replay serves
                    mod, why = None, f"{type(e).__name__}: {e}"
                _STATE["module"], _STATE["why"] = mod, why
    return _STATE["module"]


def unavailable() -> str | None:
    """Why the replay runs in Python (None: the C replay serves)."""
    if os.environ.get("STAX_CUDAGRAPH_C", "1") == "0":
        return "STAX_CUDAGRAPH_C=0"
    return None if module() is not None else _STATE["why"]


def _address(name: str) -> int:
    st = cuda._state
    return int(st.ffi.cast("uintptr_t", st.ffi.addressof(st.lib, name)))


def raw_launch(graph):
    """(cuGraphLaunch's address, the graph exec, the stream, graph) for a recorded cuda.CUDAGraph;
    a test graph's `raw_launch()`; None: call the graph's `replay`."""
    if graph.__class__ is cuda.CUDAGraph:
        st = cuda._state
        if st is None or graph._exec is None:
            return None
        ffi = st.ffi
        return (_address("cuGraphLaunch"), int(ffi.cast("uintptr_t", graph._exec)),
                int(ffi.cast("uintptr_t", st.stream.handle)), graph)
    raw = getattr(graph, "raw_launch", None)
    return raw() if raw is not None else None


def raw_copy():
    """(cuMemcpyDtoDAsync_v2's address, the stream) of the driver now, for CudaDriver's copies."""
    st = cuda._state
    if st is None:
        return None
    return _address("cuMemcpyDtoDAsync_v2"), int(st.ffi.cast("uintptr_t", st.stream.handle))


def driver_error(rc: int, copy=None) -> Exception:
    """The CudaError the Python call raises for CUresult `rc` of cuGraphLaunch, or of the copy
    (dst, src, nbytes) (cuda.copy_device_to_device's message)."""
    call, detail = ("cuGraphLaunch", "") if copy is None else \
        ("cuMemcpyDtoDAsync_v2", f"0x{copy[0]:x}, 0x{copy[1]:x}, {copy[2]} bytes")
    if cuda._state is None:         # (a test's stubs: no driver to name the error)
        return cuda.CudaError(rc, f"CUDA_ERROR_{rc}", call, detail)
    try:
        cuda._check(rc, call, detail)
    except cuda.CudaError as e:
        return e
    return cuda.CudaError(rc, f"CUDA_ERROR_{rc}", call, detail)


def make_replay(mod, *, python, tensors, rec, token, lock, cell, launch, copies, copy, counts,
                single, outputs, types, fail, init):
    """The C replay (see the module docstring) of `tensors` under `token`, in `mod`.

    python: the generated Python replay of the same (for arguments neither tuple nor list);
    rec: the Recording (its `again` read from its __dict__); lock: the GraphedCall's;
    cell: its _Generation; launch: `raw_launch`'s tuple or the graph's `replay`;
    copies: the token's copies or None (the empty ones skipped, all counted in counts["copies"]);
    copy: `raw_copy`'s tuple or the driver's `copy(dst, src, nbytes)`;
    single: (buffer, meta) of the one output over one graph-owned buffer, or None: `outputs(cell)`;
    types: (GraphOutputArray, Storage, Tensor); fail(err, i): a failed copy (i) or launch (-1);
    init: called once per thread before the first raw driver call (cuda.init), or None."""
    tensors = tuple(tensors)
    made = [c for c in copies if c[2]] if copies else None
    return mod.make(python, tensors, tuple([t.__dict__ for t in tensors]), rec.__dict__, token, lock.acquire,
                    lock.release, cell, launch, None if not copies else tuple(made), copy, counts,
                    len(copies) if copies else 0, single, outputs, types, fail, init)
