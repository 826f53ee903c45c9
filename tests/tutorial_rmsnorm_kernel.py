"""An RMSNorm kernel written for the real ``neuronxcc.nki``, in the pre-2.21 output-parameter
style of the Neuron RMSNorm tutorial: ``out = a / sqrt(mean(a², axis=1)) * g``.

The file is not modified to run on the simulator: tests call ``simulate.install()`` before
importing it. Rows are processed 128 at a time (the partition limit); the last, ragged tile
is masked on load, compute and store.
"""

import math

import neuronxcc.nki.language as nl


def rmsnorm_kernel(a_tensor, g_tensor, out_tensor):
    # a_tensor (rows, H), g_tensor (H,), out_tensor (rows, H) in HBM
    assert a_tensor.shape[1] == g_tensor.shape[0]
    assert a_tensor.shape == out_tensor.shape

    i_row = nl.arange(128)[:, None]
    i_one = nl.arange(1)[:, None]
    i_col = nl.arange(a_tensor.shape[1])[None, :]
    num_rows = a_tensor.shape[0]

    # the weight, loaded once as a one-partition row
    g_tile = nl.load(g_tensor.reshape((1, g_tensor.shape[0]))[i_one, i_col])

    for i in nl.affine_range(math.ceil(num_rows / 128)):
        rows_valid = i * 128 + i_row < num_rows
        a_tile = nl.load(a_tensor[i * 128 + i_row, i_col], mask=rows_valid)

        squares = nl.square(a_tile)
        square_sum = nl.sum(squares, axis=[1])
        mean = square_sum / a_tensor.shape[1]
        rms_reciprocal = nl.rsqrt(mean)

        out_tile = nl.multiply(a_tile, rms_reciprocal)
        g_bcast = g_tile.broadcast_to((128, g_tensor.shape[0]))
        out_tile[...] = nl.multiply(out_tile, g_bcast, mask=rows_valid)

        nl.store(out_tensor[i * 128 + i_row, i_col], value=out_tile, mask=rows_valid)
