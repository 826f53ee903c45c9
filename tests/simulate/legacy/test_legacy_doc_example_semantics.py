"""AWS's legacy doc examples whose own check cannot hold under the documented semantics, or
that come without a check (``general/nki/test`` of aws-neuron-sdk at 8a38e733, read from
``NEURON_SDK_DOCS_PATH``; nothing of it is copied here): each example kernel runs unmodified
and is checked against a NumPy reference written from the ISA reference. Without the path
these tests skip.

- ``test_nki_isa_activation.py``: AWS's check compares a ``dtype=nl.bfloat16`` activation to
  fp32 with ``np.allclose`` (1e-5); AWS's simulator computes bfloat16 "in fp32 precision"
  (general/nki/nki_known_issues.rst L60-64), the hardware rounds to the requested dtype.
- ``test_nki_isa_dropout.py::test_dropout``: AWS's check wants a non-zero output from drop
  probabilities in [0, 100); it holds only because AWS's simulator does not drop ("we don't
  have dropout simulation implementation", the file's L65); every probability >= 1 drops all.
- ``test_nki_isa_nc_match_replace8.py::test_nc_match_replace_indices8_mask`` masks with
  Python ``and``: "We do not support using ``and`` for masks" (nki_known_issues.rst L38).
- ``test_nki_isa_dma_transpose.py`` defines kernels but no check.
"""

from __future__ import annotations

import os
import runpy
from pathlib import Path

import numpy as np
import pytest
from helpers import BF16

import simulate
from simulate.core.errors import NKIError

EXAMPLES = Path(os.environ.get("NEURON_SDK_DOCS_PATH", "/nonexistent")) / "general/nki/test"

pytestmark = pytest.mark.skipif(not EXAMPLES.is_dir(), reason="NEURON_SDK_DOCS_PATH unset")


def _example(name: str) -> dict:
    """The names an AWS example file defines, with ``neuronxcc`` bound to the simulator."""
    simulate.install()
    return runpy.run_path(str(EXAMPLES / name), run_name="aws_example")


def test_activation_example_rounds_to_the_requested_dtype(rng):
    kernel = _example("test_nki_isa_activation.py")["nki_activation"]
    a = rng.uniform(-8, 8, (128, 1024)).astype(np.float32)
    b = rng.uniform(-4, 4, (128, 512)).astype(np.float32)
    c = rng.uniform(-4, 4, (128, 1)).astype(np.float32)

    a_act, b_act = kernel(a, b, c)

    np.testing.assert_allclose(a_act, np.exp(a.astype(np.float64)), rtol=2e-6)
    expected = np.square(2.0 * b.astype(np.float64) + c)
    assert np.array_equal(b_act, b_act.astype(BF16).astype(np.float32))  # a bf16 result
    np.testing.assert_allclose(b_act, expected, rtol=2.0**-8, atol=1e-6)


def test_dropout_example_drops_by_each_partitions_probability(rng):
    kernel = _example("test_nki_isa_dropout.py")["nki_dropout"]
    a = rng.uniform(1.0, 100.0, (128, 512)).astype(np.float32)
    prob = np.zeros((128, 1), np.float32)
    prob[32:64], prob[64:96], prob[96:] = 1.0, 0.5, 0.25

    c = kernel(a, prob)

    dropped = c == 0
    kept = ~dropped
    np.testing.assert_array_equal(c[kept], a[kept])  # kept values are not rescaled
    assert not dropped[:32].any() and dropped[32:64].all()
    assert 0.45 < dropped[64:96].mean() < 0.55
    assert 0.20 < dropped[96:].mean() < 0.30


def test_dropout_example_with_a_scalar_probability(rng):
    kernel = _example("test_nki_isa_dropout.py")["nki_dropout_scalar"]
    a = rng.uniform(1.0, 100.0, (128, 512)).astype(np.float32)

    b = kernel(a)

    assert 0.18 < (b == 0).mean() < 0.22
    np.testing.assert_array_equal(b[b != 0], a[b != 0])


def test_match_replace8_example_masking_with_python_and_is_rejected(rng):
    kernel = _example("test_nki_isa_nc_match_replace8.py")["nki_nc_match_replace_indices8_mask"]
    with pytest.raises(NKIError, match="mask"):
        kernel(rng.standard_normal((4, 16)).astype(np.float32), np.float32(0.0))


def test_masking_with_ampersand_is_the_legal_twin(rng):
    import neuronxcc.nki as nki
    import neuronxcc.nki.isa as nisa
    import neuronxcc.nki.language as nl

    @nki.jit
    def top8_of_a_quarter(x):
        n, m = x.shape
        out = nl.ndarray((n, 8), dtype=x.dtype, buffer=nl.shared_hbm)
        ix, iy = nl.mgrid[0:n, 0:m]
        tile = nl.load(x)
        top = nisa.max8(src=tile[ix, iy], mask=(ix < n // 2) & (iy < m // 2))
        nl.store(out[0 : n // 2, 0:8], value=top[0 : n // 2, 0:8])
        return out

    x = rng.standard_normal((8, 32)).astype(np.float32)
    out = top8_of_a_quarter(x)
    expected = -np.sort(-x[:4, :16], axis=1)[:, :8]
    np.testing.assert_array_equal(out[:4], expected)


@pytest.mark.parametrize("name", ["nki_dma_transpose_2d_hbm2sb", "nki_dma_transpose_2d_sb2sb"])
def test_dma_transpose_examples_transpose(rng, name):
    kernel = _example("test_nki_isa_dma_transpose.py")[name]
    a = rng.standard_normal((32, 64)).astype(np.float32)

    np.testing.assert_array_equal(kernel(a), a.T)


def test_returning_an_sbuf_tile_is_only_for_simulation_mode(rng):
    """A compiled kernel returns HBM tensors (nki_known_issues.rst L11-15); AWS's examples
    return an SBUF tile from ``mode="simulation"`` kernels only."""
    import neuronxcc.nki as nki

    kernel = _example("test_nki_isa_dma_transpose.py")["nki_dma_transpose_2d_sb2sb"]
    a = rng.standard_normal((32, 64)).astype(np.float32)
    for mode in ("auto", "baremetal"):
        with pytest.raises(NKIError, match="err_top_level_tensor_must_be_hbm"):
            nki.jit(kernel, mode=mode)(a)
