"""``flax.nnx`` module: :class:`RMSNorm`, ``flax.nnx.RMSNorm`` with the NKI kernels.

A subclass of ``flax.nnx.RMSNorm``: the constructor, its arguments and defaults
(``num_features``, ``epsilon=1e-6``, ``dtype``, ``param_dtype=float32``, ``use_scale``,
``scale_init``, ``reduction_axes=-1``, ``feature_axes=-1``, ``promote_dtype``, ``rngs``, ...)
and the ``scale`` parameter are flax's own, so checkpoints and ``nnx.state`` are
interchangeable. Only the computation differs: the inputs are promoted as flax promotes them
(``promote_dtype((x, scale), dtype=dtype)``: a bfloat16 input with the default float32 scale
gives a float32 output, as in flax), then :func:`nki_rmsnorm.jax.rms_norm` normalises in
float32 and rounds once to that dtype, with a custom gradient.

Supported: ``reduction_axes`` that are the last axes of the input (the kernels normalise rows;
several trailing axes are flattened into one), ``feature_axes=-1``. Not supported (a
``ValueError`` naming the argument): ``axis_name`` / ``axis_index_groups`` (statistics
reduced across devices) and ``mask``. ``use_fast_variance`` does not apply (RMSNorm subtracts
no mean).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from nki_rmsnorm import jax as nki_jax
from nki_rmsnorm._optional import require

nnx = require("flax.nnx", extra="flax")

__all__ = ["RMSNorm"]


def _trailing_axes(axes, ndim: int, name: str) -> int:
    """How many trailing axes ``axes`` names; a ValueError unless they are the last ones."""
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    positive = sorted(a % ndim if -ndim <= a < ndim else a for a in axes)
    count = len(positive)
    if not count or positive != list(range(ndim - count, ndim)):
        raise ValueError(
            f"{name} must name the last axes of the input (e.g. -1 or (-2, -1)) "
            f"for the NKI kernels, got {axes} for a {ndim}-d input"
        )
    return count


class RMSNorm(nnx.RMSNorm):
    """``flax.nnx.RMSNorm`` computed by the NKI RMSNorm kernels (see the module docstring)."""

    def __call__(self, x, mask=None):
        """Normalise ``x`` over ``reduction_axes`` and scale it by ``scale``."""
        if mask is not None:
            raise ValueError(
                "mask is not supported by the NKI RMSNorm kernels; use "
                "flax.nnx.RMSNorm for masked statistics"
            )
        if self.axis_name is not None or self.axis_index_groups is not None:
            raise ValueError(
                "axis_name / axis_index_groups (statistics across devices) are not "
                "supported; shard the rows instead (each row is normalised on "
                "the device that holds it)"
            )
        scale = self.scale[...] if self.scale is not None else None
        x, scale = self.promote_dtype((x, scale), dtype=self.dtype)
        reduced = _trailing_axes(self.reduction_axes, x.ndim, "reduction_axes")
        if _trailing_axes(self.feature_axes, x.ndim, "feature_axes") != 1:
            raise ValueError(f"feature_axes must be -1 (the scale's axis), got {self.feature_axes}")
        rows_shape = x.shape[: x.ndim - reduced]
        flat = jnp.reshape(x, (*rows_shape, math.prod(x.shape[x.ndim - reduced :])))
        if scale is not None and reduced > 1:
            # The scale runs along the last axis only: repeat it over the other reduced axes.
            scale = jnp.tile(scale, math.prod(x.shape[x.ndim - reduced : -1]))
        return jnp.reshape(nki_jax.rms_norm(flat, scale, self.epsilon), x.shape)
