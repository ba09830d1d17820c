"""Frontend: the mask language and batches.

``parse_mask``/``load_mask`` turn mask text into a checked :class:`MaskProgram`;
``MaskProgram.lower`` gives one sample's pieces, ``lower_batch`` the whole
packed mask, ``render`` an ASCII picture. ``load_batch``/``parse_seqlens``
read batches. The language is described in :mod:`attnplan.frontend.lang`.
"""

from .batch import Batch, load_batch, parse_seqlens
from .lang import MaskProgram, load_mask, lower_batch, parse_mask, render
from .stdlib import BUILTINS

__all__ = ["Batch", "BUILTINS", "MaskProgram", "load_batch", "load_mask", "lower_batch", "parse_mask",
           "parse_seqlens", "render"]
