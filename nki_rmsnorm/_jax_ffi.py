"""A host call that XLA knows by name: one typed-FFI custom-call target (``nki_rmsnorm_host``)
whose handler runs a registered Python function on NumPy views of XLA's buffers.

Why not ``jax.experimental.buffer_callback`` (what :mod:`nki_rmsnorm.jax` uses elsewhere):
a host callback is referenced by its index in the *lowered module's* list of callbacks, and
``custom_partitioning`` lowers the per-shard function into a separate, temporary module at
compile time; the index then points into a list the executable never receives, and running
it crashes the process (JAX 0.10.2: ``_custom_partitioning_partition`` builds the shard's
module with ``mlir.build_mlir_module_helper``, whose host callbacks are dropped). A custom
call names its target instead, so it lowers the same inside and outside the partitioner.

The handler is a ``ctypes`` function implementing XLA's FFI C API
(``xla/ffi/api/c_api.h``, shipped in ``jaxlib/include``): it answers the registration's
metadata query with the framework's API version, reads the call's buffers and its one
``key`` attribute (which registered function to run), and turns a Python exception into an
FFI error, so a failing kernel raises in the caller like any XLA error.
"""

from __future__ import annotations

import ctypes as C
import itertools
import threading

import jax
import ml_dtypes
import numpy as np

__all__ = ["host_call"]

TARGET = "nki_rmsnorm_host"


class _ExtensionBase(C.Structure):
    pass


_ExtensionBase._fields_ = [
    ("struct_size", C.c_size_t),
    ("type", C.c_int),
    ("next", C.POINTER(_ExtensionBase)),
]


class _ApiVersion(C.Structure):
    _fields_ = [
        ("struct_size", C.c_size_t),
        ("extension_start", C.c_void_p),
        ("major", C.c_int),
        ("minor", C.c_int),
    ]


class _Metadata(C.Structure):
    _fields_ = [
        ("struct_size", C.c_size_t),
        ("api_version", _ApiVersion),
        ("traits", C.c_uint32),
        ("state_type_id", C.c_int64),
    ]


class _MetadataExtension(C.Structure):
    _fields_ = [("base", _ExtensionBase), ("metadata", C.POINTER(_Metadata))]


class _ErrorCreateArgs(C.Structure):
    _fields_ = [
        ("struct_size", C.c_size_t),
        ("extension_start", C.c_void_p),
        ("message", C.c_char_p),
        ("errc", C.c_int),
    ]


class _Api(C.Structure):
    _fields_ = [
        ("struct_size", C.c_size_t),
        ("extension_start", C.c_void_p),
        ("api_version", _ApiVersion),
        ("internal_api", C.c_void_p),
        ("error_create", C.CFUNCTYPE(C.c_void_p, C.POINTER(_ErrorCreateArgs))),
    ]


class _Buffer(C.Structure):
    _fields_ = [
        ("struct_size", C.c_size_t),
        ("extension_start", C.c_void_p),
        ("dtype", C.c_int),
        ("data", C.c_void_p),
        ("rank", C.c_int64),
        ("dims", C.POINTER(C.c_int64)),
    ]


class _List(C.Structure):
    """``XLA_FFI_Args`` and ``XLA_FFI_Rets`` (same layout)."""

    _fields_ = [
        ("struct_size", C.c_size_t),
        ("extension_start", C.c_void_p),
        ("size", C.c_int64),
        ("types", C.POINTER(C.c_int)),
        ("items", C.POINTER(C.c_void_p)),
    ]


class _Attrs(C.Structure):
    _fields_ = [
        ("struct_size", C.c_size_t),
        ("extension_start", C.c_void_p),
        ("size", C.c_int64),
        ("types", C.POINTER(C.c_int)),
        ("names", C.c_void_p),
        ("items", C.POINTER(C.c_void_p)),
    ]


class _Scalar(C.Structure):
    _fields_ = [("dtype", C.c_int), ("value", C.c_void_p)]


class _CallFrame(C.Structure):
    _fields_ = [
        ("struct_size", C.c_size_t),
        ("extension_start", C.POINTER(_ExtensionBase)),
        ("api", C.POINTER(_Api)),
        ("ctx", C.c_void_p),
        ("stage", C.c_int),
        ("args", _List),
        ("rets", _List),
        ("attrs", _Attrs),
        ("future", C.c_void_p),
    ]


_METADATA_EXTENSION = 1  # XLA_FFI_Extension_Metadata
_ERROR_INTERNAL = 13  # XLA_FFI_Error_Code_INTERNAL
#: XLA_FFI_DataType → NumPy dtype, for the dtypes the kernels take.
_DTYPES = {
    10: np.dtype(np.float16),
    11: np.dtype(np.float32),
    16: np.dtype(ml_dtypes.bfloat16),
}

#: key → (host function, which of its arguments are present); kept for the process's life,
#: since compiled executables hold the keys.
_registered: dict[int, tuple] = {}
_keys: dict[tuple, int] = {}
_next_key = itertools.count(1)
_lock = threading.Lock()


def _array(pointer) -> np.ndarray:
    """A NumPy view of an ``XLA_FFI_Buffer``."""
    buffer = C.cast(pointer, C.POINTER(_Buffer)).contents
    shape = tuple(buffer.dims[i] for i in range(buffer.rank))
    dtype = _DTYPES[buffer.dtype]
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size == 0:
        return np.empty(shape, dtype)
    return np.frombuffer((C.c_char * size).from_address(buffer.data), dtype).reshape(shape)


def _handle(frame_pointer):
    frame = frame_pointer.contents
    extension = frame.extension_start
    if extension and extension.contents.type == _METADATA_EXTENSION:
        # Registration asks which FFI API version the handler speaks: the framework's own.
        metadata = C.cast(extension, C.POINTER(_MetadataExtension)).contents.metadata.contents
        metadata.api_version.major = frame.api.contents.api_version.major
        metadata.api_version.minor = frame.api.contents.api_version.minor
        metadata.traits = 0
        return None
    try:
        scalar = C.cast(frame.attrs.items[0], C.POINTER(_Scalar)).contents
        function, present = _registered[C.cast(scalar.value, C.POINTER(C.c_int64)).contents.value]
        arrays = iter(_array(frame.args.items[i]) for i in range(frame.args.size))
        outputs = [_array(frame.rets.items[i]) for i in range(frame.rets.size)]
        function(outputs, *(next(arrays) if flag else None for flag in present))
        return None
    except BaseException as error:  # noqa: BLE001 - handed to XLA, raised in the caller
        message = f"{type(error).__name__}: {error}".encode()
        args = _ErrorCreateArgs(C.sizeof(_ErrorCreateArgs), None, message, _ERROR_INTERNAL)
        return frame.api.contents.error_create(C.byref(args))


_HANDLER = C.CFUNCTYPE(C.c_void_p, C.POINTER(_CallFrame))(_handle)
_target_registered = False


def _register_target() -> None:
    global _target_registered
    with _lock:
        if _target_registered:
            return
        new_capsule = C.pythonapi.PyCapsule_New
        new_capsule.restype = C.py_object
        new_capsule.argtypes = [C.c_void_p, C.c_char_p, C.c_void_p]
        capsule = new_capsule(C.cast(_HANDLER, C.c_void_p).value, b"xla._CUSTOM_CALL_TARGET", None)
        jax.ffi.register_ffi_target(TARGET, capsule, platform="cpu", api_version=1)
        _target_registered = True


def _key(host_function, present: tuple[bool, ...]) -> int:
    with _lock:
        identity = (id(host_function), present)
        key = _keys.get(identity)
        if key is None or _registered[key][0] is not host_function:
            key = next(_next_key)
            _keys[identity] = key
            _registered[key] = (host_function, present)
        return key


def host_call(host_function, result_types, *args):
    """``host_function(outputs, *args)`` on NumPy views of XLA's buffers (absent arguments
    passed as None), as one custom call on the CPU; returns the outputs ``result_types``
    describe. ``host_function`` must stay alive (the caller caches it)."""
    _register_target()
    present = tuple(a is not None for a in args)
    key = _key(host_function, present)
    call = jax.ffi.ffi_call(TARGET, tuple(result_types), vmap_method="sequential")
    return tuple(call(*(a for a in args if a is not None), key=np.int64(key)))
