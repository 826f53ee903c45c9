"""The base class of every container the planners define for the kernels.

NKI 0.6 compiles a user class only when it "must inherit from NKIObject and no other classes"
(nki/get-started/nki-language-guide.rst@81ce03ae, L572), so the planners' containers (tiles,
tensors, plans a kernel builds or receives) are dataclasses over :data:`NKIObject`, never
tuples. It is the ``nl.NKIObject`` of the ``nki.language`` the 0.6 kernels use
(:mod:`nki_rmsnorm.kernels.nki06._nki`): the Neuron SDK's with a real ``nki`` 0.5 – 0.6
installed, the simulator's 0.6 front-end (shipped with this package) anywhere else. The
legacy dialect's kernels share the same classes; its compiler does not look at the base.
"""

from __future__ import annotations

from nki_rmsnorm.kernels.nki06._nki import nl

NKIObject = nl.NKIObject

__all__ = ["NKIObject"]
