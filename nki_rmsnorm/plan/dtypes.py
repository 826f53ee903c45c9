"""Byte sizes of NKI dtypes, for both dialects' dtype objects.

A legacy ``neuronxcc.nki.language`` dtype is a NumPy dtype and an ``nki`` 0.6 one is not, but
``str()`` of either is the dtype's NKI name ("bfloat16", "float32", ...): AWS's 0.x kernels
size dtypes the same way (nki-library@d2ad3a5 src/nkilib_src/nkilib/core/utils/allocator.py
L32-54, ``sizeinbytes``). Tensors carry no documented ``itemsize`` in 0.6 (aws-neuron-sdk@81ce03ae
nki/api/nki/language/__init__.py L132-146), so kernels and planners size dtypes here, through
a string-keyed dict (an NKI value: nki/get-started/nki-language-guide.rst L141-155).
"""

from __future__ import annotations

from nki_rmsnorm.plan.kernel_assert import kernel_assert

__all__ = ["DTYPE_BYTES", "dtype_bytes"]

#: Bytes per element, by NKI dtype name (nki/api/nki.api.shared.rst: the dtype table).
DTYPE_BYTES = {
    "float32": 4,
    "tfloat32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int32": 4,
    "uint32": 4,
    "int16": 2,
    "uint16": 2,
    "int8": 1,
    "uint8": 1,
}


def dtype_bytes(dtype):
    """Bytes per element of ``dtype`` (an NKI dtype of either dialect)."""
    name = str(dtype)
    kernel_assert(name in DTYPE_BYTES, "no byte size known for dtype " + name)
    return DTYPE_BYTES[name]
