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
        # L451-455; AWS's examples general/nki/examples/prof-kernel-benchmark.py L39,
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
    """``nki.typing.scalar(tile)``: use a one-element tile as a scalar."""
    import numpy as np

    return np.asarray(tile.data).reshape(-1)[0].item()
