"""``python -m simulate.nki06 module:function ...``: every violation of the NKI language that the
static check finds in each kernel and everything it reaches, without launching anything
(:func:`simulate.nki06.language_check.report`). Exit status 1 when any is found."""

from __future__ import annotations

import sys

from .language_check import report

if len(sys.argv) < 2:
    print("usage: python -m simulate.nki06 module:function [module:function ...]")
    sys.exit(2)
sys.exit(report(sys.argv[1:]))
