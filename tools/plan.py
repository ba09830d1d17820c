"""The ``Plan`` value: a compiled plan (the verified IR down to per-device
programs) with its metadata, and the methods a training loop uses on it.
``attnplan.compile`` and ``attnplan.load`` make one (:mod:`attnplan.api`);
``strategy="auto"`` too (:mod:`attnplan.tools.auto`), which is why it lives
below the face."""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import PlanError
from ..ir.module import PlanIR
from ..ir.problem import Problem


def _show(v) -> str:
    """A short description of a bad value for an error message (never a huge repr)."""
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return f"{_num(int(v))} ({type(v).__name__})"
    if isinstance(v, np.ndarray):
        return f"a numpy array of dtype {v.dtype} and shape {v.shape}"
    return f"{reprlib.repr(v)} ({type(v).__name__})"


def _num(v: int) -> str:
    """``v`` with thousands separators, or its order of magnitude if it is huge."""
    if abs(v).bit_length() <= 64:
        return f"{v:,}"
    return f"{'-' if v < 0 else ''}about 10^{int(abs(v).bit_length() * math.log10(2))}"


@dataclass(frozen=True, eq=False)
class Plan:
    """A compiled plan: the verified IR down to per-device programs."""

    ir: PlanIR
    meta: dict = field(default_factory=dict)      # pipeline, strategy, block size, profile
    measured: dict = field(default_factory=dict)  # plan_s (the only non-deterministic field)
    # the cost profile given to compile (in memory only: a plan file records a builtin profile name at most)
    profile: object = field(default=None, repr=False)

    @property
    def devices(self) -> int:
        return self.ir.devices

    @property
    def problem(self) -> Problem:
        return self.ir.problem

    def stats(self, profile: str | None = None, sim: dict | None = None) -> dict:
        from ..backends.cost import resolve_profile
        from ..backends.stats import compute_stats
        prof = resolve_profile(self.profile if profile is None else profile, self.meta.get("profile"))
        s = compute_stats(self.ir, self.measured.get("plan_s"), prof, sim)  # None: a loaded file stores no timing
        s["pipeline"] = self.meta.get("pipeline", "")
        return s

    def to_text(self, device: int | None = None) -> str:
        if device is not None and (isinstance(device, bool) or not isinstance(device, (int, np.integer))):
            raise PlanError(f"device must be an integer, got {_show(device)}")
        if device is not None and not 0 <= device < self.devices:
            raise PlanError(f"device {device} does not exist; the plan has devices 0..{self.devices - 1}")
        return self.ir.need_program().to_text(device)

    def to_bytes(self) -> bytes:
        """The plan file: a pure function of the compile inputs (no timing; ``measured`` stays in memory)."""
        from ..backends.planfile import pack
        return pack(self.ir, self.meta)

    def canonical_bytes(self) -> bytes:
        """The plan file's body before compression (what ``to_bytes`` compresses)."""
        from ..backends.planfile import canonical_bytes
        return canonical_bytes(self.ir, self.meta)

    def save(self, path) -> None:
        """Write the plan file (PlanError if ``path`` is not a writable regular file path)."""
        p = Path(path)
        if p.exists() and not p.is_file():  # a folder, a FIFO (would block), a device
            raise PlanError(f"{path}: cannot write plan file: not a regular file")
        data = self.to_bytes()
        try:
            p.write_bytes(data)
        except OSError as e:
            raise PlanError(f"{path}: cannot write plan file: {e.strerror or e}") from None

    @staticmethod
    def from_bytes(data: bytes, source: str = "<bytes>") -> "Plan":
        from ..backends.planfile import unpack
        ir, meta = unpack(data, source)
        return Plan(ir, meta)

    # token ownership (the training API; see attnplan.runtime.layout) ---------------
    def local_index(self, rank: int) -> np.ndarray:
        """Global (packed) token index of each of ``rank``'s local rows: its home
        token blocks in increasing block order, each block's rows in token order
        (a varlen group's spans one after another, so the whole array of a
        grouped plan need not increase)."""
        from ..runtime.layout import local_index
        return local_index(self.ir, rank)

    def local_tokens(self, rank: int) -> int:
        from ..runtime.layout import local_tokens
        return local_tokens(self.ir, rank)

    def position_ids(self, rank: int, kind: str = "sample") -> np.ndarray:
        """Positions of ``rank``'s local tokens for RoPE: by default the position
        inside each token's own sample (0 at every sample start, as packed
        training needs); ``kind="global"`` gives the packed-axis position."""
        from ..runtime.layout import position_ids
        return position_ids(self.ir, rank, kind)

    def sample_ids(self, rank: int) -> np.ndarray:
        """The sample each of ``rank``'s local tokens belongs to (for labels and loss weights)."""
        from ..runtime.layout import sample_ids
        return sample_ids(self.ir, rank)

    def dispatch(self, x_global, rank: int | None = None, group=None, side: str | None = None):
        """``rank``'s rows of ``x_global`` (tokens first: a torch tensor or numpy
        array of the whole batch), in local order. ``rank`` defaults to this
        process's rank in ``group``. Differentiable. A cross-attention plan
        has two token axes: ``side="q"`` for query-side tensors (queries,
        outputs), ``side="k"`` for key-side ones (keys, values)."""
        from ..runtime.dist import dispatch
        return dispatch(self.ir, x_global, self._rank(rank, group), side)

    def undispatch(self, x_local, group=None, timeout: float | None = None, side: str | None = None):
        """Every rank's local rows gathered into global token order, on every rank
        (an all_gather over ``group``). Its backward returns this rank's rows of
        the incoming gradient and communicates nothing: every rank must compute
        the same function of the result (then sum parameter gradients over the
        group, as for a loss over ``dispatch``-ed tokens). ``side``: as for
        :meth:`dispatch`."""
        from ..runtime.dist import undispatch
        return undispatch(self.ir, x_local, group, timeout, side)

    def _rank(self, rank, group) -> int:
        if rank is not None:
            return rank
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(group)
        if self.devices == 1:
            return 0
        raise PlanError("no rank given and torch.distributed is not initialized")
