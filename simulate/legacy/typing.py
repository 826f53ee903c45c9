"""``neuronxcc.nki.typing``: kernel-argument annotations.

``tensor[128, 512]`` annotates an argument's shape (checked when the kernel runs);
``mutable_tensor`` marks an input the kernel may write (it must then be returned).
"""

from __future__ import annotations


class _TensorAnnotation:
    __nki_annotation__ = "tensor"

    def __init__(self, shape=None):
        self.__nki_shape__ = shape

    def __getitem__(self, shape):
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
