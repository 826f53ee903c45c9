"""``neuronxcc.nki.typing``: kernel-argument annotations.

``tensor[128, 512]`` annotates an argument's shape (checked when the kernel runs);
``mutable_tensor`` marks an input the kernel may write (it must then be returned).
"""

from __future__ import annotations


class _TensorAnnotation:
    __nki_annotation__ = "tensor"

    def __init__(self, shape=None, dtype=None):
        self.__nki_shape__ = shape
        # ``tensor[[250, 512], nl.float32]``: a shape and a dtype, an argument that stands for
        # an input of that shape (``nki.benchmark`` / ``nki.profile`` "use the input tensors
        # mainly to specify the shape", aws-neuron-sdk@8a38e733 general/nki/api/nki/__init__.py
        # L456-458; AWS's examples general/nki/examples/prof-kernel-benchmark.py L39,
        # matrix_multiplication/matrix_multiplication_nki_kernels.py L402-403)
        self.__nki_argument_spec__ = None if dtype is None else (shape, dtype)

    def __getitem__(self, shape):
        if isinstance(shape, tuple) and len(shape) == 2 and isinstance(shape[0], list):
            return _TensorAnnotation(tuple(int(s) for s in shape[0]), shape[1])
        shape = shape if isinstance(shape, tuple) else (shape,)
        return _TensorAnnotation(tuple(int(s) for s in shape))

    def __repr__(self):
        return f"tensor{list(self.__nki_shape__ or [])}"


class _MutableTensorAnnotation(_TensorAnnotation):
    __nki_annotation__ = "mutable_tensor"

    def __getitem__(self, shape):
        shape = shape if isinstance(shape, tuple) else (shape,)
        return _MutableTensorAnnotation(tuple(int(s) for s in shape))


tensor = _TensorAnnotation()
mutable_tensor = _MutableTensorAnnotation()


def scalar(tile):
    """``nki.typing.scalar(tile)``: use a one-element tile as a scalar; a Python value stays
    itself (``cond = scalar(True)``, the do-while entry of aws-neuron-sdk@8a38e733
    general/nki/api/nki.errors.rst L937)."""
    import numpy as np

    if isinstance(tile, (bool, int, float)):
        return tile
    value = np.asarray(tile.data).reshape(-1)[0].item()
    return (_RuntimeFloat if isinstance(value, float) else _RuntimeInt)(value)


class _RuntimeCondition:
    """A comparison of a run-time scalar: a ``while`` may test it only after its first
    iteration (nki.errors.rst L902-947); the simulator knows its value."""

    __nki_runtime__ = True

    def __init__(self, value: bool):
        self.value = bool(value)

    def __bool__(self):
        return self.value

    def __repr__(self):
        return f"scalar({self.value})"


def _compare(op):
    def compare(self, other):
        return _RuntimeCondition(op(self._plain(), other))

    return compare


class _RuntimeNumber:
    """A value ``scalar(tile)`` read from a tile: known only when the kernel runs."""

    import operator as _op

    __lt__ = _compare(_op.lt)
    __le__ = _compare(_op.le)
    __gt__ = _compare(_op.gt)
    __ge__ = _compare(_op.ge)
    __eq__ = _compare(_op.eq)
    __ne__ = _compare(_op.ne)
    __hash__ = None


class _RuntimeFloat(_RuntimeNumber, float):
    def _plain(self):
        return float(self)


class _RuntimeInt(_RuntimeNumber, int):
    def _plain(self):
        return int(self)
