"""Equinox module: :class:`RMSNorm`, ``equinox.nn.RMSNorm`` with the NKI kernels.

A subclass of ``equinox.nn.RMSNorm``: the fields (``shape``, ``eps``, ``use_weight``,
``use_bias``, ``weight``, ``bias``), the constructor and its defaults (``eps=1e-5``, weight
ones, bias zeros, both on) are equinox's, so the module is a drop-in replacement and its
parameters load from either. As in equinox, ``x`` must have the module's ``shape`` (use
``jax.vmap`` over batches: the binding runs all batch elements' rows in one launch), the
statistics cover the whole ``shape``, the math is float32 and the output has ``x``'s dtype;
the weight and bias enter in float32 (their gradients come back in their own dtypes).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from nki_rmsnorm import jax as nki_jax
from nki_rmsnorm._optional import require

eqx = require("equinox", extra="equinox")

__all__ = ["RMSNorm"]

_SENTINEL = object()


class RMSNorm(eqx.nn.RMSNorm):
    """``equinox.nn.RMSNorm`` computed by the NKI RMSNorm kernels (see the module docstring)."""

    def __call__(self, x, state=_SENTINEL, *, key=None):
        """Normalise ``x`` (of the module's ``shape``); ``state`` and ``key`` are passed
        through / ignored as in equinox."""
        del key
        if x.shape != self.shape:
            raise ValueError(
                f"x must have the module's shape {self.shape}, got {x.shape}; "
                "use jax.vmap over a batch"
            )
        size = math.prod(self.shape)
        weight = None if self.weight is None else self.weight.astype(jnp.float32).reshape(size)
        bias = None if self.bias is None else self.bias.astype(jnp.float32).reshape(size)
        y = nki_jax.rms_norm(x.reshape(1, size), weight, self.eps, bias=bias).reshape(x.shape)
        return y if state is _SENTINEL else (y, state)
