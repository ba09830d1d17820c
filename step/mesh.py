"""The device mesh of a training step: ``dp`` data-parallel × ``cp``
context-parallel × ``pp`` pipeline devices, ``devices_per_node`` to a node,
each with the memory of its cost profile (H100 80 GB, H200 141 GB, A100 80 GB;
``memory_cap`` overrides it).

With ``pp > 1`` the model's layers are cut into ``pp · vp`` *model chunks*
(``vp`` virtual stages per pipeline rank, Megatron-LM's interleaved
schedule): chunk ``c`` runs on pipeline stage ``c mod pp``, so stage ``s``
holds chunks ``s, s + pp, ...``. ``stage_layers`` gives the layers of every
chunk in pipeline order (empty: as even as possible, the first chunks one
layer more); the first chunk also holds the embedding, the last the output
layer.

Ranks are numbered as Megatron-LM orders its groups with TP = 1: context
parallelism innermost, then data parallelism, then pipeline stages — rank
``r`` is CP rank ``r mod cp`` of data-parallel replica ``(r // cp) mod dp``.
A replica's CP group is therefore ``cp`` consecutive ranks, inside one node
whenever ``cp`` divides the devices of a node. Every one of the ``dp·cp``
devices of a stage holds the whole model, and gradients are reduced over all
of them (survey §1.3: DP and CP share one gradient-reduction domain), which
is what the batch passes use when they regroup devices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..errors import StepError
from ..ir.limits import MAX_DEVICES, MAX_LAYERS, MAX_MEMORY_CAP, MAX_MESH_DEVICES
from .model import RECOMPUTE


@dataclass(frozen=True, slots=True)
class Mesh:
    dp: int
    cp: int
    pp: int = 1
    devices_per_node: int = 8
    memory_cap: int = 0        # bytes per device; 0 = the profile's memory
    recompute: str = "full"    # activation recompute: "full" (every layer's input kept) or "none"
    reserve: int = 1 << 30     # bytes per device the planner never counts on (CUDA context, NCCL, fragmentation)
    vp: int = 1                # virtual pipeline stages (model chunks) per pipeline rank: interleaved 1F1B when > 1
    stage_layers: tuple = ()   # layers of every model chunk (pp · vp of them), pipeline order; () = even

    def __post_init__(self):
        for key, hi in (("dp", MAX_MESH_DEVICES), ("cp", MAX_DEVICES), ("pp", MAX_MESH_DEVICES),
                        ("devices_per_node", MAX_MESH_DEVICES), ("vp", MAX_LAYERS)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= hi:
                raise StepError(f"mesh: {key} must be an integer in 1..{hi:,} (ir/limits.py), got {v!r:.40}")
            object.__setattr__(self, key, int(v))
        if self.dp * self.cp * self.pp > MAX_MESH_DEVICES:
            raise StepError(f"mesh: dp x cp x pp = {self.dp * self.cp * self.pp:,} devices, over the limit of "
                            f"{MAX_MESH_DEVICES:,} (ir/limits.py MAX_MESH_DEVICES)")
        for key in ("memory_cap", "reserve"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v <= MAX_MEMORY_CAP:
                raise StepError(f"mesh: {key} must be an integer number of bytes in 0..{MAX_MEMORY_CAP:,}, "
                                f"got {v!r:.40}")
            object.__setattr__(self, key, int(v))
        if self.vp > 1 and self.pp == 1:
            raise StepError(f"mesh: vp={self.vp} virtual stages need a pipeline (pp > 1)")
        object.__setattr__(self, "stage_layers", _stage_layers(self.stage_layers, self.pp * self.vp))
        if self.recompute not in RECOMPUTE:
            raise StepError(f"mesh: recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r:.40}")
        n, k = self.stage_devices, self.devices_per_node
        if n > k and n % k:
            raise StepError(f"mesh: the {n} devices of a stage must fill whole nodes of {k} devices")
        if n < k and k % n:
            fits = ", ".join(str(d) for d in [*range(1, k), k, 2 * k, 3 * k] if d % k == 0 or k % d == 0)
            raise StepError(f"mesh: a stage of {n} devices (dp x cp) must divide a node of {k} devices or fill whole "
                            f"nodes: {fits}, ... devices")

    @property
    def devices(self) -> int:
        return self.dp * self.cp * self.pp

    @property
    def stage_devices(self) -> int:
        """Devices of one pipeline stage: the ``dp · cp`` replicas that reduce gradients together."""
        return self.dp * self.cp

    @property
    def nodes(self) -> int:
        return max(1, -(-self.devices // self.devices_per_node))

    @property
    def chunks(self) -> int:
        """Model chunks: ``pp · vp``."""
        return self.pp * self.vp

    def chunk_layers(self, layers: int) -> tuple[int, ...]:
        """Layers of every model chunk for a model of ``layers`` layers (StepError when they do not add up)."""
        n = self.chunks
        if self.stage_layers:
            if sum(self.stage_layers) != layers:
                raise StepError(f"mesh: stage_layers {list(self.stage_layers)[:16]} add up to "
                                f"{sum(self.stage_layers)} layers, the model has {layers}")
            return self.stage_layers
        if layers < n:
            raise StepError(f"mesh: {layers} layers cannot fill pp x vp = {n} model chunks")
        q, r = divmod(layers, n)
        return tuple(q + (c < r) for c in range(n))

    def node_of(self, ranks) -> np.ndarray:
        return np.asarray(ranks, np.int64) // self.devices_per_node

    def cp_group(self, replica: int) -> np.ndarray:
        """The global ranks of data-parallel replica ``replica``'s CP group (pipeline stage 0)."""
        return np.arange(replica * self.cp, (replica + 1) * self.cp, dtype=np.int64)

    def cap(self, profile) -> int:
        """Memory per device: ``memory_cap`` if set, else the profile's ``memory_bytes``."""
        return self.memory_cap if self.memory_cap else int(profile.memory_bytes)

    def spec(self) -> str:
        text = f"dp={self.dp},cp={self.cp}"
        return text + (f",pp={self.pp}" if self.pp > 1 else "") + (f",vp={self.vp}" if self.vp > 1 else "")


def _stage_layers(v, chunks: int) -> tuple:
    if v is None or (isinstance(v, (tuple, list)) and not len(v)):
        return ()
    if not isinstance(v, (tuple, list)) or len(v) != chunks or any(
            isinstance(x, bool) or not isinstance(x, (int, np.integer)) or not 1 <= x <= MAX_LAYERS for x in v):
        raise StepError(f"mesh: stage_layers must give one positive layer count per model chunk (pp x vp = "
                        f"{chunks}), got {v!r:.60}")
    return tuple(int(x) for x in v)


_SPEC = re.compile(r"\s*(dp|cp|pp|vp)\s*=\s*([0-9]{1,12})\s*")


def gib(nbytes) -> str:
    """Bytes as GiB for messages and tables: 80, 80.5, 0.5 (four significant digits), not rounded to 0."""
    return f"{nbytes / 2**30:.4g}"


def parse_mesh(text: str, devices_per_node: int = 8, **kw) -> Mesh:
    """``"dp=4,cp=8[,pp=2[,vp=2]]"`` → :class:`Mesh` (StepError naming the bad part)."""
    if not isinstance(text, str) or not text.strip() or len(text) > 200:
        raise StepError("mesh must be text like dp=4,cp=8 (optionally ,pp=2 and ,vp=2)")
    seen: dict[str, int] = {}
    for part in text.split(","):
        m = _SPEC.fullmatch(part)
        if not m:
            raise StepError(f"mesh {text[:60]!r}: cannot read {part.strip()[:30]!r}; expected dp=D,cp=C[,pp=P][,vp=V]")
        if m.group(1) in seen:
            raise StepError(f"mesh {text[:60]!r}: {m.group(1)} is given twice")
        seen[m.group(1)] = int(m.group(2))
    if "dp" not in seen or "cp" not in seen:
        raise StepError(f"mesh {text[:60]!r}: give both dp and cp, e.g. dp=4,cp=8")
    return Mesh(seen["dp"], seen["cp"], seen.get("pp", 1), devices_per_node, vp=seen.get("vp", 1), **kw)
