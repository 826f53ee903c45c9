"""The emulated NKI release of the ``nki`` front-end: 0.4 (Neuron SDK 2.30), 0.5 (2.31) or 0.6
(2.32, the default), and which API appears in which one, from the NKI release notes
(aws-neuron-sdk@81ce03ae ``release-notes/components/nki.rst``).

``NKI_SIM_NKI_RELEASE=0.4`` in the environment, or the :func:`nki_release` context manager,
choose it (as ``NKI_SIM_SDK`` / :func:`simulate.core.sdk.sdk` do for the legacy front-end). An
API the chosen release does not have yet raises :class:`NkiReleaseError` (an
``AttributeError``) naming the first release that has it and the release-notes line.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys

from .errors import NkiValidationError

RELEASES = ("0.4", "0.5", "0.6")
NEWEST = RELEASES[-1]
SDK_OF = {"0.4": "2.30", "0.5": "2.31", "0.6": "2.32"}
ENV = "NKI_SIM_NKI_RELEASE"
_RN = "aws-neuron-sdk@81ce03ae release-notes/components/nki.rst"
_VIEWS = f"{_RN} L127-132 (new NkiTensor view primitives in 0.5)"

#: name -> (first release, citation)
API_TABLE: dict[str, tuple[str, str]] = {
    "nl.fori_loop": ("0.6", f"{_RN} L29-32"),
    "nl.while_loop": ("0.6", f"{_RN} L29-32"),
    "nl.float8_e8m0fnu": ("0.5", f"{_RN} L123-125"),
    "nl.tile_size.psum_num_banks": ("0.5", f"{_RN} L156"),
    "NkiTensor.slice": ("0.5", _VIEWS),
    "NkiTensor.select": ("0.5", _VIEWS),
    "NkiTensor.permute": ("0.5", _VIEWS),
    "NkiTensor.broadcast": ("0.5", _VIEWS),
    "NkiTensor.expand_dim": ("0.5", _VIEWS),
    "NkiTensor.squeeze_dim": ("0.5", _VIEWS),
    "NkiTensor.reshape_dim": ("0.5", _VIEWS),
    "NkiTensor.flatten_dims": ("0.5", _VIEWS),
    "NkiTensor.is_contiguous": ("0.5", f"{_RN} L133-134"),
    "NkiTensor.is_indirect": ("0.5", f"{_RN} L133-134"),
    # "Nested slicing is not available" (nki/migration/index.rst L860) until the composable
    # views of 0.5; the 0.6 guide chains indexing (nki-language-guide.rst L441-449)
    "indexing a view made by indexing (chained slicing)": (
        "0.5",
        f"{_VIEWS}; aws-neuron-sdk@81ce03ae nki/migration/index.rst L860",
    ),
}

_selected: contextvars.ContextVar[str | None] = contextvars.ContextVar("nki_release", default=None)


class NkiReleaseError(NkiValidationError, AttributeError):
    """An API the emulated NKI release does not have yet."""


def _checked(release: str) -> str:
    release = str(release).strip()
    if release not in RELEASES:
        raise NkiValidationError(
            f"{ENV}={release!r}: the nki front-end emulates NKI " + ", ".join(RELEASES)
        )
    return release


def current() -> str:
    """The emulated NKI release: the context's, else ``NKI_SIM_NKI_RELEASE``, else 0.6."""
    chosen = _selected.get()
    if chosen is not None:
        return chosen
    return _checked(os.environ.get(ENV, "") or NEWEST)


@contextlib.contextmanager
def nki_release(release: str):
    """Emulate ``release`` (e.g. ``"0.4"``) inside the block (per thread / task)."""
    token = _selected.set(_checked(release))
    try:
        yield
    finally:
        _selected.reset(token)


def require(name: str, from_kernel_only: bool = True) -> None:
    """Raise :class:`NkiReleaseError` when the emulated release predates ``name``, used by
    kernel code: with ``from_kernel_only`` only when the API's caller (two frames up) is not
    the simulator itself, whose implementations of older APIs may use newer primitives
    (``nl.broadcast_to`` through a broadcast view)."""
    if from_kernel_only:
        caller = sys._getframe(2).f_globals.get("__name__", "")
        if caller.startswith("simulate."):
            return
    first, citation = API_TABLE[name]
    release = current()
    if RELEASES.index(release) < RELEASES.index(first):
        raise NkiReleaseError(
            f"{name} is not in NKI {release} (Neuron SDK {SDK_OF[release]}): it first appears "
            f"in NKI {first} (SDK {SDK_OF[first]}) — {citation}; {ENV} selects the release"
        )
