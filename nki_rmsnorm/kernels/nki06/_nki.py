"""Where the ``nki`` 0.6 kernels import NKI from (the legacy kernels' twin is
:mod:`nki_rmsnorm.nki`).

Kernels say ``from nki_rmsnorm.kernels.nki06._nki import nki, nl, nisa``. With a real ``nki``
0.4 – 0.6 installed (:func:`nki_rmsnorm.dialect.hardware_dialect`) that is the Neuron SDK's
``nki``; anywhere else it is :mod:`simulate.nki06`, the simulator's 0.6 front-end.
``SIMULATED`` says which one was picked.
"""

from __future__ import annotations

from nki_rmsnorm import dialect

SIMULATED = dialect.hardware_dialect() != dialect.NKI06

if SIMULATED:
    import simulate.nki06 as nki
    import simulate.nki06.isa as nisa
    import simulate.nki06.language as nl
else:  # pragma: no cover - needs the Neuron SDK 2.30+
    import nki
    import nki.isa as nisa
    import nki.language as nl

__all__ = ["SIMULATED", "nki", "nisa", "nl", "usable_sbuf_bytes"]


def usable_sbuf_bytes() -> int:
    """SBUF bytes per partition a kernel may allocate on the running target:
    ``nl.tile_size.sbuf_fmax_bytes`` (``total_available_sbuf_size`` is deprecated since
    NKI 0.4; aws-neuron-sdk@81ce03ae nki/api/nki.language.tile_size.rst)."""
    return nl.tile_size.sbuf_fmax_bytes
