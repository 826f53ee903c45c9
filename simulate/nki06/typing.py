"""``nki.typing``: ``nt.tensor[128, 512]`` shape annotations, checked at kernel entry (spec
decision; MIG 0.2->0.3 introduces them without saying whether a mismatch is an error)."""

from __future__ import annotations


class TensorAnnotation:
    def __init__(self, shape=None):
        self.shape = shape

    def __getitem__(self, shape):
        shape = shape if isinstance(shape, tuple) else (shape,)
        return TensorAnnotation(tuple(int(n) for n in shape))

    def __repr__(self):
        return "nt.tensor" + ("" if self.shape is None else str(list(self.shape)))


tensor = TensorAnnotation()
