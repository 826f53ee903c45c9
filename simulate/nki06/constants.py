"""``nki.isa.constants``: the ISA enums under the module path AWS's kernels import them from
(``from nki.isa.constants import dge_mode, oob_mode``,
aws-neuron/nki-library@d2ad3a5 ``src/nkilib_src/nkilib/core/qkv/qkv_cte.py`` L26,
``core/subkernels/find_nonzero_indices.py`` L20, L177). The same objects as ``nki.isa.*``."""

from __future__ import annotations

from .isa import dge_mode, dma_engine, engine, matmul_perf_mode, nc_version, oob_mode, reduce_cmd

__all__ = [
    "dge_mode",
    "dma_engine",
    "engine",
    "matmul_perf_mode",
    "nc_version",
    "oob_mode",
    "reduce_cmd",
]
