"""The one place the package imports NKI from.

Kernels say ``from nki_rmsnorm.nki import nki, nl, nisa``. With the Neuron compiler installed
that is the real ``neuronxcc.nki`` and the kernels compile for a NeuronDevice; anywhere else
it is :mod:`simulate`, the package's NumPy NKI simulator, which runs the same kernel code on
the CPU. ``SIMULATED`` says which one was picked.
"""

from __future__ import annotations

import simulate

SIMULATED = not simulate.real_nki_available()

if SIMULATED:
    import simulate as nki
    import simulate.isa as nisa
    import simulate.language as nl
else:  # pragma: no cover - needs the Neuron SDK
    import neuronxcc.nki as nki
    import neuronxcc.nki.isa as nisa
    import neuronxcc.nki.language as nl

__all__ = ["SIMULATED", "nki", "nisa", "nl"]
