"""Frontend: the mask language and batches.

``parse_mask``/``load_mask`` turn mask text into a checked :class:`MaskProgram`;
``MaskProgram.lower`` gives one sample's pieces, ``lower_batch`` the whole
packed mask, ``render`` an ASCII picture. ``load_batch``/``parse_seqlens``
read batches. The language is described in :mod:`attnplan.frontend.lang`.

Modules, one concern each: ``lang`` (the language's documentation,
``MaskProgram``, parsing), ``grammar`` (``mask.lark`` and syntax errors),
``tree`` (the syntax tree), ``names`` (name checking), ``values`` (numbers,
position terms), ``periodic`` (``//`` and ``%`` of positions), ``evaluate``
(expressions to pieces), ``cells`` (comparisons with floors to pieces),
``setops`` (mask set operations within the work limits), ``stdlib`` (named
masks), ``lower`` (whole batches), ``render`` (pictures), ``batch`` (batch
files and lengths).
"""

from .batch import Batch, load_batch, parse_batch_text, parse_seqlens
from .lang import MaskProgram, load_mask, parse_mask
from .lower import lower_batch
from .render import render
from .stdlib import BUILTINS

__all__ = ["Batch", "BUILTINS", "MaskProgram", "load_batch", "load_mask", "lower_batch", "parse_batch_text",
           "parse_mask", "parse_seqlens", "render"]
