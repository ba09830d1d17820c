"""attnplan as an attention implementation of Hugging Face ``transformers``.

Importing this module registers :func:`attention_forward` with transformers'
``AttentionInterface`` under the name ``"attnplan"``, so a decoder model built
with ``AutoModelForCausalLM.from_config(cfg, attn_implementation="attnplan")``
(or switched with ``model.set_attn_implementation("attnplan")``) runs every
attention layer through :func:`attnplan.attention` with the plan and process
group of the enclosing :func:`plan_context`::

    import attnplan, attnplan.hf

    plan = attnplan.compile(seqlens=doc_lengths, mask="causal", devices=world, heads=cfg.num_attention_heads,
                            kv_heads=cfg.num_key_value_heads, head_dim=head_dim, strategy="hypergraph")
    labels = attnplan.hf.packed_labels(plan, input_ids)          # shifted inside documents, BEFORE dispatch
    n_labels = int((labels != -100).sum())                       # the whole batch's label count
    ids, lab = plan.dispatch(input_ids), plan.dispatch(labels)   # this rank's tokens
    pos = torch.from_numpy(plan.position_ids(rank))              # RoPE restarts at every document
    with attnplan.hf.plan_context(plan, group):
        logits = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]
    loss = F.cross_entropy(logits.float(), lab, ignore_index=-100, reduction="sum") / n_labels
    loss.backward()
    attnplan.hf.sum_gradients(model.parameters(), group)         # the whole batch's gradient on every rank

What the layers hand to the attention function (read from transformers 5.24):
``query [1, Hq, T_local, D]``, ``key``/``value [1, Hkv, T_local, D]`` after
RoPE, ``attention_mask``, ``scaling``, ``dropout`` and keyword arguments
(``sliding_window``, ``softcap``, ``position_ids``, ``s_aux``, ...). It
returns ``(out [1, T_local, Hq, D], None)``. Supported: decoder
self-attention that is causal inside each document, or a sliding window
(``sliding_window=w``: ``q - w < k <= q``) when the plan's mask is that
window on the batch. Refused with one :class:`~attnplan.errors.PlanError`
naming the layer: bidirectional (encoder) attention, logit soft-capping,
attention sinks, position biases, attention dropout, a KV cache or
cross-attention (keys of another length), an explicit ``attention_mask``
(a 4-D mask, or a 2-D padding mask that pads something: the plan's mask
decides), a batch dimension other than 1. Tokens, heads or
head dim that disagree with the plan raise :class:`~attnplan.errors.ShapeError`.

With ``strict=True`` (the default) the context also checks, once per plan
and window, that the plan's mask *is* the mask the layer computes on this
batch (per-document causal, or the window), and that the layers see
``position_ids == plan.position_ids(rank)``; ``strict=False`` skips both (a
plan with another mask language expression, e.g. ``prefix_lm``, on purpose).
Leaving the context without any layer having called attnplan (the model was
built with another ``attn_implementation``, or its attention does not go
through ``AttentionInterface``) raises :class:`~attnplan.errors.PlanError`.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field

import numpy as np
import torch

from .api import Plan, _check_plan, positive_real
from .api import attention as _attention
from .api import execute as _execute
from .errors import PlanError, ShapeError
from .ir import limits
from .ir.mask import HI, INF, K0, K1, LO, Q0, Q1, normalize, piece_counts

try:
    from transformers import AttentionInterface
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError("attnplan.hf needs transformers: pip install 'attnplan[hf]'") from e
try:
    from transformers.masking_utils import AttentionMaskInterface
except ImportError:  # pragma: no cover - transformers before masking_utils (< 4.53) builds masks in the models
    AttentionMaskInterface = None

NAME = "attnplan"
IGNORE_INDEX = -100

# keyword arguments that change what attention computes, and why attnplan refuses them when set
_UNSUPPORTED = {
    "softcap": "logit soft-capping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias",
}


@dataclass
class PlanContext:
    """The plan, group and checks the attention layers use inside :func:`plan_context`."""

    plan: Plan
    group: object
    rank: int
    timeout: float | None
    strict: bool
    calls: int = 0                                   # attention layers run through attnplan in this context
    virtual: bool = False                            # every device of the plan in this process, global tokens
    _mask_ok: dict = field(default_factory=dict)     # sliding window (None: causal) -> checked
    _positions: torch.Tensor | None = None

    def tokens(self) -> int:
        """The tokens a layer sees: this rank's, or (virtual) the whole batch's."""
        return self.plan.problem.tokens if self.virtual else self.plan.local_tokens(self.rank)

    def positions(self) -> torch.Tensor:
        if self._positions is None:
            if self.virtual:
                off = self.plan.problem.offsets
                pos = np.arange(int(off[-1]), dtype=np.int64) - np.repeat(off[:-1], np.diff(off))
            else:
                pos = self.plan.position_ids(self.rank)
            self._positions = torch.from_numpy(pos)
        return self._positions

    def __enter__(self) -> PlanContext:
        self._token = _CURRENT.set(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        _CURRENT.reset(self._token)
        if exc_type is None and self.calls == 0:
            raise PlanError("attnplan.hf.plan_context: no attention layer ran through attnplan inside the context; "
                            "build the model with attn_implementation=\"attnplan\" (or call "
                            "model.set_attn_implementation(\"attnplan\")), after `import attnplan.hf`; a model whose "
                            "attention does not go through transformers' AttentionInterface is not supported")


_CURRENT: contextvars.ContextVar[PlanContext | None] = contextvars.ContextVar("attnplan_hf_plan", default=None)


def plan_context(plan: Plan, group=None, *, timeout: float | None = None, strict: bool = True,
                 virtual: bool = False) -> PlanContext:
    """A context manager under which every ``"attnplan"`` attention layer runs
    this rank's share of ``plan`` over ``group`` (rank ``d`` of the group is
    the plan's device ``d``; default: the default group; a one-device plan
    also runs without torch.distributed). Put the model's forward inside it;
    the backward needs it only with gradient checkpointing (which runs the
    forward again during backward). ``timeout``: seconds a transfer
    may take. ``strict``: check that the plan's mask and positions are the
    ones the layers compute with (module docstring). ``virtual``: run every
    device's program of the plan in this process (``attnplan.execute``: the
    transfers become copies) on the whole batch in global token order — one
    GPU checking a multi-device plan; feed the undispatched ids with
    per-document positions."""
    _check_plan(plan)
    if timeout is not None:
        timeout = positive_real("timeout", timeout, limits.MAX_TIMEOUT_S)
    if not isinstance(strict, (bool, np.bool_)):
        raise PlanError(f"strict must be True or False, got {type(strict).__name__}")
    if not isinstance(virtual, (bool, np.bool_)):
        raise PlanError(f"virtual must be True or False, got {type(virtual).__name__}")
    if virtual:
        return PlanContext(plan, None, 0, timeout, bool(strict), virtual=True)
    return PlanContext(plan, group, _rank(plan, group), timeout, bool(strict))


def _rank(plan: Plan, group) -> int:
    """This process's device in ``plan`` (the group must have ``plan.devices`` ranks)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        if plan.devices == 1:
            return 0
        raise PlanError(f"the plan has {plan.devices} devices but torch.distributed is not initialized: call "
                        f"torch.distributed.init_process_group before entering attnplan.hf.plan_context")
    from .runtime.dist import resolve_group
    return resolve_group(plan.ir, group).rank


def current() -> PlanContext | None:
    """The innermost active :func:`plan_context`, or None."""
    return _CURRENT.get()


# the attention function ----------------------------------------------------------------------

def _layer(module) -> str:
    idx = getattr(module, "layer_idx", None)
    return f"{type(module).__name__}" + ("" if idx is None else f" (layer {idx})")


def _check_supported(module, query, key, attention_mask, dropout, kwargs) -> None:
    """PlanError for attention that attnplan does not compute (module docstring)."""
    where = f"attnplan.hf: {_layer(module)}"
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    if not causal:
        raise PlanError(f"{where} computes bidirectional (encoder) attention; attnplan.hf supports decoder "
                        f"self-attention only (causal inside each document, or a sliding window)")
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise PlanError(f"{where} uses {what} ({name}=...), which attnplan does not compute")
    if dropout:
        raise PlanError(f"{where} asks for attention dropout {dropout:g}; attnplan computes attention without "
                        f"dropout: set config.attention_dropout = 0.0")
    if attention_mask is not None:
        raise PlanError(f"{where} got an attention_mask of shape {list(getattr(attention_mask, 'shape', []))}; the "
                        f"plan's mask decides which tokens attend: call the model with attention_mask=None (pack "
                        f"documents, no padding) and position_ids=plan.position_ids(rank)")
    if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() == 4
            and key.dim() == 4):
        raise ShapeError(f"{where}: expected query and key of shape [batch, heads, tokens, head_dim], got "
                         f"{list(getattr(query, 'shape', []))} and {list(getattr(key, 'shape', []))}")
    if query.shape[0] != 1:
        raise ShapeError(f"{where}: batch size {query.shape[0]}; attnplan runs one packed row: feed "
                         f"plan.dispatch(input_ids)[None] (documents are the plan's samples)")
    if key.shape[2] != query.shape[2]:
        raise PlanError(f"{where}: {query.shape[2]} queries but {key.shape[2]} keys: a KV cache or "
                        f"cross-attention is not supported; call the model with use_cache=False")


def _check_shapes(ctx: PlanContext, module, query, key) -> None:
    """ShapeError when the layer's tokens, heads or head dim are not the plan's."""
    p = ctx.plan.problem
    _, hq, t, d = query.shape
    hkv = key.shape[1]
    where = f"attnplan.hf: {_layer(module)} on device {ctx.rank}"
    if (hq, hkv, d) != (p.heads, p.kv_heads, p.head_dim) or key.shape[3] != d:
        raise ShapeError(f"{where} has {hq} query heads, {hkv} kv heads and head_dim {d}, but the plan was compiled "
                         f"for heads={p.heads}, kv_heads={p.kv_heads}, head_dim={p.head_dim}: compile with "
                         f"heads=config.num_attention_heads, kv_heads=config.num_key_value_heads and the model's "
                         f"head_dim")
    n = ctx.tokens()
    if t != n and ctx.virtual:
        raise ShapeError(f"{where} got {t} tokens but the plan's batch has {n} (a virtual context runs the whole "
                         f"batch: feed every token, undispatched)")
    if t != n:
        raise ShapeError(f"{where} got {t} tokens but the plan gives this rank {n} of the batch's {p.tokens}: feed "
                         f"plan.dispatch(input_ids) of a batch with the plan's document lengths")


def _window(module, kwargs) -> int | None:
    w = kwargs.get("sliding_window")
    if w is None:
        return None
    if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w <= 0:
        raise PlanError(f"attnplan.hf: {_layer(module)}: sliding_window must be a positive integer, got {w!r}")
    return int(w)


def required_pieces(seqlens: np.ndarray, window: int | None) -> np.ndarray:
    """The mask a decoder layer computes on a packed batch, as normalized
    pieces: causal inside each document, or (``window``) keys ``q - window <
    k <= q`` inside each document. One piece per document."""
    off = np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int64)
    a = np.empty((len(seqlens), 6), np.int64)
    a[:, Q0] = a[:, K0] = off[:-1]
    a[:, Q1] = a[:, K1] = off[1:]
    a[:, LO] = -INF if window is None else 1 - window
    a[:, HI] = 0
    return normalize(a)


def mask_matches(problem, window: int | None) -> bool:
    """Whether the plan's mask (``problem.pieces``) is exactly the decoder mask
    of :func:`required_pieces` on the plan's batch. The plan's pieces are
    disjoint and lie inside their sample (verified), so the masks are equal iff
    both have as many pairs as their intersection, which is computed piece by
    piece against the one required piece of the piece's document."""
    want = required_pieces(problem.seqlens, window)
    have = normalize(problem.pieces.a)
    if not len(have):
        return not len(want)
    doc = np.searchsorted(problem.offsets, have[:, Q0], "right") - 1
    both = have.copy()
    other = want[doc]
    for lo_col in (Q0, K0, LO):
        both[:, lo_col] = np.maximum(both[:, lo_col], other[:, lo_col])
    for hi_col in (Q1, K1, HI):
        both[:, hi_col] = np.minimum(both[:, hi_col], other[:, hi_col])
    n_want = int(piece_counts(want).sum())
    return int(piece_counts(have).sum()) == n_want == int(piece_counts(normalize(both)).sum())


def _check_mask(ctx: PlanContext, module, window: int | None) -> None:
    if window not in ctx._mask_ok:
        ctx._mask_ok[window] = mask_matches(ctx.plan.problem, window)
    if not ctx._mask_ok[window]:
        need = "causal" if window is None else f"sliding_window({window})"
        what = "causal attention inside each document" if window is None else \
            f"sliding-window attention (window {window}) inside each document"
        raise PlanError(f"attnplan.hf: {_layer(module)} computes {what}, but the plan's mask "
                        f"{ctx.plan.problem.mask!r} differs from it on this batch: compile the plan with "
                        f"mask={need!r} (or enter plan_context with strict=False to use another mask on purpose)")


def _check_positions(ctx: PlanContext, module, position_ids) -> None:
    want = ctx.positions()
    got = position_ids if isinstance(position_ids, torch.Tensor) else None
    if got is None or got.numel() != want.numel() or not torch.equal(got.reshape(-1).to(want), want):
        raise ShapeError(f"attnplan.hf: {_layer(module)} on device {ctx.rank} sees position_ids that are not "
                         f"plan.position_ids({ctx.rank}): call the model with position_ids=torch.from_numpy("
                         f"plan.position_ids(rank))[None] (RoPE restarts at every document)")


def attention_forward(module, query, key, value, attention_mask=None, scaling: float | None = None,
                      dropout: float = 0.0, **kwargs):
    """transformers' attention function signature: ``query [1, Hq, T, D]``,
    ``key``/``value [1, Hkv, T, D]`` (after RoPE) -> ``(out [1, T, Hq, D], None)``,
    computed by :func:`attnplan.attention` under the current :func:`plan_context`."""
    ctx = _CURRENT.get()
    if ctx is None:
        raise PlanError(f"attnplan.hf: {_layer(module)} ran outside attnplan.hf.plan_context: wrap the model's "
                        f"forward in `with attnplan.hf.plan_context(plan, group):` (no plan is set; with gradient "
                        f"checkpointing the backward runs the forward again: call backward inside the context too)")
    _check_supported(module, query, key, attention_mask, dropout, kwargs)
    _check_shapes(ctx, module, query, key)
    if ctx.strict:
        _check_mask(ctx, module, _window(module, kwargs))
        if "position_ids" in kwargs:
            _check_positions(ctx, module, kwargs["position_ids"])
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))   # [T, H, D] views; attention copies once
    # the layer's scaling (head_dim ** -0.5 in Llama/Qwen2/Mistral; the runtime checks it is finite and > 0)
    if ctx.virtual:
        out = _execute(ctx.plan, q, k, v, softmax_scale=scaling)
    else:
        out = _attention(q, k, v, ctx.plan, ctx.group, softmax_scale=scaling, timeout=ctx.timeout)
    ctx.calls += 1
    return out.unsqueeze(0), None


def mask_forward(batch_size=1, q_length=0, kv_length=0, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, **kwargs):
    """transformers' mask function for ``"attnplan"``: no mask, the plan's
    decides; except a 2-D padding mask that pads something, which is handed on
    so that the attention layers refuse it (without a mask function for the
    name, transformers would drop it silently)."""
    if isinstance(attention_mask, torch.Tensor) and not bool(attention_mask.all()):
        return attention_mask
    return None


def register() -> None:
    """Register :func:`attention_forward` (and :func:`mask_forward`) as
    ``attn_implementation="attnplan"`` (done on import; calling it again is harmless)."""
    AttentionInterface.register(NAME, attention_forward)
    if AttentionMaskInterface is not None:
        AttentionMaskInterface.register(NAME, mask_forward)


register()


# the rest of the recipe -------------------------------------------------------------------------

def packed_labels(plan: Plan, input_ids, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token labels of the whole packed batch, shifted *before* dispatch:
    ``labels[i] = input_ids[i + 1]`` when token ``i + 1`` is in the same
    document (plan sample), ``ignore_index`` at each document's last token.
    ``input_ids``: the global ids ``[T]`` (or ``[1, T]``), torch or numpy.
    Dispatch the result with ``plan.dispatch`` like the ids: no label then
    crosses a document or a rank boundary."""
    _check_plan(plan)
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    T = plan.problem.tokens
    if ids.dim() != 1 or ids.shape[0] != T or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ShapeError(f"packed_labels: expected the batch's {T} integer token ids, got {ids.dtype} "
                         f"{list(ids.shape)}")
    labels = torch.roll(ids, -1).clone()
    labels[torch.from_numpy(plan.problem.offsets[1:] - 1)] = ignore_index
    return labels


def sum_gradients(parameters, group=None) -> None:
    """Sum every parameter's gradient over ``group`` in place (one all_reduce of
    one flat buffer; a missing gradient counts as zeros). With the loss divided
    by the whole batch's label count on every rank, the sum is the gradient of
    the whole batch's mean loss, the same on every rank."""
    import torch.distributed as dist
    params = [p for p in parameters if p.requires_grad]
    if not params or not (dist.is_available() and dist.is_initialized()):
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    i = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[i:i + n].view_as(p.grad))
        i += n
