"""Array helpers every layer uses.

:func:`unique` exists because plain ``np.unique(a)`` of a 1-D integer array
takes a hash-table path in numpy 2.4 that is 40x slower than sorting: 1.43 s
against 0.035 s for 1.6M int64 (measured on this machine with numpy 2.4.6;
with ``return_index``/``return_inverse``/``return_counts`` numpy sorts and is
fast). Per-document zigzag of 100,000 documents on 8 devices cuts the token
axis at 1.6M points, and every re-tiling takes the unique cut points.
"""

from __future__ import annotations

import numpy as np


def unique(a) -> np.ndarray:
    """The sorted distinct values of ``a`` (flattened): ``np.unique(a)``, by sorting."""
    s = np.sort(np.asarray(a).ravel())
    if len(s) < 2:
        return s
    keep = np.empty(len(s), bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]
