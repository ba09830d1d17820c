"""The model a step is planned for, and the per-token costs derived from it
(survey §1.1: per document of length s, per layer, linear work c1·s, attention
work c2·(allowed pairs), activation memory α·s + β).

Everything is derived from the real matmul shapes of a decoder layer:

* **Linear FLOPs per token per layer** (forward): Q projection ``h × H·d``,
  K and V ``h × Hkv·d`` each (GQA), O ``H·d × h``, and the MLP — SwiGLU's
  three matmuls ``h × f`` (gate, up) and ``f × h`` (down), or a GELU MLP's
  two — at 2 FLOPs per multiply-add. With ``H·d = h``, GELU and ``f = 4h``
  (or SwiGLU and ``f = 8h/3``) this is exactly Skrull's ``20h² + 4h·h_kv``
  (:func:`skrull_linear_flops`, survey §1.1). Norms, RoPE, residual adds and
  biases are left out (O(h) per token, under 0.1% of the matmuls).
* **Output layer** (once per token, not per layer): ``2·h·V`` FLOPs forward.
* **Attention FLOPs per allowed pair per layer** (forward): ``4·d·H``, as
  :mod:`attnplan.backends.cost` prices it (QKᵀ and PV).
* **Backward**: linear layers cost :data:`LINEAR_BWD_FACTOR` = 2 × forward
  (the input gradient and the weight gradient, one matmul each); attention
  costs the profile's ``bwd_factor`` × forward (flash-attention's five matmuls
  against two). With full recompute every layer's forward runs once more in
  the backward.
* **Activation bytes per token per layer** kept for the backward, bf16, with
  flash attention (no s² term) and no dropout (:func:`layer_activation_bytes`):
  the two norms' inputs and outputs (4 × 2h), Q, K and V (2·(H·d + 2·Hkv·d)),
  the attention output and its log-sum-exp (2·H·d + 4·H), and the MLP's
  intermediates (SwiGLU: gate, up and their product, 3 × 2f; GELU: the
  pre- and post-activation, 2 × 2f). For Llama-3-8B this is 34.0·h bytes,
  Korthikanti et al.'s 34·s·b·h without the dropout masks and the s² term.
  With full recompute only each layer's input (2h) is kept, plus one layer's
  full set while that layer is recomputed.
* **Logits**: ``6·V`` bytes per token (the bf16 logits and the loss's fp32
  copy; the loss gradient is written in place).
* **Parameters** (:func:`param_count`): the matmuls above, two norms a layer,
  the embedding, the output layer unless tied, the final norm. Per device
  (:func:`static_bytes`): bf16 weights (2 B) and bf16 gradients (2 B) whole
  on every device, the fp32 master weights and Adam's two moments (12 B)
  sharded ZeRO-1 style over the gradient-reduction group (every data- and
  context-parallel replica: Megatron-LM's distributed optimizer shards over
  the data-parallel group with context parallelism folded in).

A user's model is a JSON object with the fields of :class:`Model`
(:func:`load_model`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import numpy as np

from ..errors import StepError
from ..ir.files import read_json
from ..ir.limits import MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_MODEL_DIM, MAX_MODEL_FILE

LINEAR_BWD_FACTOR = 2.0     # linear backward / forward: input gradient + weight gradient
PARAM_BYTES = 2             # bf16 weights
GRAD_BYTES = 2              # bf16 gradients
OPTIMIZER_BYTES = 12        # fp32 master weights + Adam's first and second moments, sharded ZeRO-1
ACT_BYTES = 2               # bf16 activations
LSE_BYTES = 4               # fp32 log-sum-exp per query row and head
LOGIT_BYTES = 6             # bf16 logits + the loss's fp32 copy, per vocabulary entry
MLPS = ("swiglu", "gelu")
RECOMPUTE = ("full", "none")


@dataclass(frozen=True, slots=True)
class Model:
    """A decoder-only transformer: ``layers`` × (attention with ``heads`` query
    heads and ``kv_heads`` KV heads of ``head_dim``, MLP of width ``ffn``),
    ``hidden`` the model width, ``vocab`` the vocabulary, ``tied`` when the
    output layer shares the embedding's weights."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    mlp: str = "swiglu"
    tied: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.strip() or len(self.name) > 100:
            raise StepError(f"model: name must be a non-empty string of at most 100 characters, got {self.name!r:.60}")
        owner = f"model {self.name!r}"
        for key, hi in (("layers", MAX_LAYERS), ("hidden", MAX_MODEL_DIM), ("heads", MAX_HEADS),
                        ("kv_heads", MAX_HEADS), ("head_dim", MAX_HEAD_DIM), ("ffn", MAX_MODEL_DIM),
                        ("vocab", MAX_MODEL_DIM)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
                raise StepError(f"{owner}: {key} must be an integer in 1..{hi:,} (ir/limits.py), got {v!r:.60}")
        if self.heads % self.kv_heads:
            raise StepError(f"{owner}: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.mlp not in MLPS:
            raise StepError(f"{owner}: mlp must be one of {', '.join(MLPS)}, got {self.mlp!r:.60}")
        if not isinstance(self.tied, bool):
            raise StepError(f"{owner}: tied must be true or false, got {self.tied!r:.60}")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


PRESETS: dict[str, Model] = {m.name: m for m in (
    # Llama 3 (Meta, config.json of Meta-Llama-3-8B / -70B): GQA with 8 KV heads, SwiGLU, 128K vocabulary.
    Model("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    Model("llama3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
    # Qwen2.5 (config.json of Qwen2.5-0.5B / -7B): the 0.5B ties its embedding; QKV biases are left out.
    Model("qwen2.5-0.5b", 24, 896, 14, 2, 64, 4864, 151936, tied=True),
    Model("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064),
    # FlexSP's GPT-7B (arXiv:2412.01523 §7): GPT shape, hidden 4096, 32 layers and heads, GELU MLP of 4h,
    # GPT-2 vocabulary, tied embedding (Megatron's GPT default).
    Model("gpt-7b", 32, 4096, 32, 32, 128, 16384, 50257, mlp="gelu", tied=True),
    # LLaMA-13B, the model of Megatron-LM's Dynamic CP blog: 40 layers, hidden 5120, MHA, SwiGLU 13824.
    Model("llama-13b", 40, 5120, 40, 40, 128, 13824, 32000),
)}


# ---------------------------------------------------------------------------------------- FLOPs

def linear_flops(m: Model) -> int:
    """Forward FLOPs per token of one layer's matmuls (QKV, O, MLP; 2 FLOPs per multiply-add)."""
    qo = 2 * m.hidden * m.heads * m.head_dim
    kv = 2 * m.hidden * m.kv_heads * m.head_dim
    mlp = (3 if m.mlp == "swiglu" else 2) * m.hidden * m.ffn
    return 2 * (qo + kv + mlp)


def skrull_linear_flops(m: Model) -> int:
    """Skrull's per-layer linear term ``20h² + 4h·h_kv`` (survey §1.1), with
    ``h_kv = kv_heads · head_dim``; equal to :func:`linear_flops` when the
    attention width is ``h`` and the MLP has ``8h²`` multiply-adds."""
    h, hkv = m.hidden, m.kv_heads * m.head_dim
    return 20 * h * h + 4 * h * hkv


def head_flops(m: Model) -> int:
    """Forward FLOPs per token of the output layer (logits), once per token."""
    return 2 * m.hidden * m.vocab


def attn_flops_per_pair(m: Model) -> int:
    """Forward attention FLOPs of one allowed (q, k) pair over all query heads, per layer."""
    return 4 * m.head_dim * m.heads


# ---------------------------------------------------------------------------------------- memory

def layer_activation_bytes(m: Model) -> int:
    """Bytes per token one layer keeps for its backward without recompute (see the module doc)."""
    norms = 4 * ACT_BYTES * m.hidden
    qkv = ACT_BYTES * (m.heads + 2 * m.kv_heads) * m.head_dim
    out = ACT_BYTES * m.heads * m.head_dim + LSE_BYTES * m.heads
    mlp = (3 if m.mlp == "swiglu" else 2) * ACT_BYTES * m.ffn
    return norms + qkv + out + mlp


def checkpoint_bytes(m: Model) -> int:
    """Bytes per token one layer keeps under full recompute: its input."""
    return ACT_BYTES * m.hidden


def logits_bytes(m: Model) -> int:
    return LOGIT_BYTES * m.vocab


def activation_bytes(m: Model, tokens, recompute: str, attn_buffers=0, kept=0):
    """Peak activation bytes of a device holding ``tokens`` tokens of one
    micro-batch (numpy arrays broadcast): with full recompute, every layer's
    input plus the larger of the logits and one layer's full set with the
    attention plan's buffers; without, every layer's full set and the KV its
    attention keeps for its backward (``kept``, ``Problem.keep_kv``: under
    full recompute a layer's kept KV lives from its recomputed forward to its
    backward, inside the buffers) plus the larger of the logits and the
    attention buffers."""
    if recompute == "full":
        return tokens * (m.layers * checkpoint_bytes(m)) + np.maximum(tokens * logits_bytes(m),
                                                                    tokens * layer_activation_bytes(m) + attn_buffers)
    return tokens * (m.layers * layer_activation_bytes(m)) + m.layers * kept + np.maximum(tokens * logits_bytes(m),
                                                                                          attn_buffers)


def activation_per_token(m: Model, recompute: str) -> int:
    """Bytes per token of :func:`activation_bytes` without attention buffers (the planners' token caps)."""
    if recompute == "full":
        return m.layers * checkpoint_bytes(m) + max(logits_bytes(m), layer_activation_bytes(m))
    return m.layers * layer_activation_bytes(m) + logits_bytes(m)


def layer_params(m: Model) -> int:
    attn = 2 * m.hidden * m.heads * m.head_dim + 2 * m.hidden * m.kv_heads * m.head_dim
    mlp = (3 if m.mlp == "swiglu" else 2) * m.hidden * m.ffn
    return attn + mlp + 2 * m.hidden


def param_count(m: Model) -> int:
    """Parameters: the layers, the embedding, the output layer unless tied, the final norm."""
    return m.layers * layer_params(m) + m.vocab * m.hidden * (1 if m.tied else 2) + m.hidden


def static_bytes(m: Model, shards: int) -> int:
    """Bytes per device that do not depend on the batch: bf16 weights and
    gradients, and the fp32 optimizer states sharded over ``shards`` replicas (ZeRO-1)."""
    p = param_count(m)
    return (PARAM_BYTES + GRAD_BYTES) * p + -(-OPTIMIZER_BYTES * p // shards)


def stage_param_count(m: Model, layers: int, first: bool, last: bool) -> int:
    """Parameters of one pipeline stage holding ``layers`` layers: the embedding on the first stage, the
    output layer (a copy of the embedding when tied, as Megatron-LM keeps one) and the final norm on the
    last."""
    return layers * layer_params(m) + m.vocab * m.hidden * (int(first) + int(last)) + m.hidden * int(last)


def stage_static_bytes(m: Model, layers: int, first: bool, last: bool, shards: int) -> int:
    """:func:`static_bytes` of one pipeline stage (its parameters only, optimizer states over ``shards``)."""
    p = stage_param_count(m, layers, first, last)
    return (PARAM_BYTES + GRAD_BYTES) * p + -(-OPTIMIZER_BYTES * p // shards)


def kv_bytes(m: Model) -> int:
    """Bytes per token per layer of K and V (bf16), what a chunk keeps for the later chunks of its
    document (ChunkFlow's state store); their gradients take as much again."""
    return 2 * ACT_BYTES * m.kv_heads * m.head_dim


# ---------------------------------------------------------------------------------------- loading

def model_from_dict(data, source: str) -> Model:
    """A model from a JSON object with the fields of :class:`Model` (``mlp``
    and ``tied`` may be left out); StepError naming ``source`` and the key otherwise."""
    if not isinstance(data, dict):
        raise StepError(f"model {source}: must be a JSON object with the fields of a model, got {type(data).__name__}")
    known = [f.name for f in fields(Model)]
    unknown = sorted(str(k)[:40] for k in data if k not in known)
    if unknown:
        raise StepError(f"model {source}: unknown key(s) {', '.join(map(repr, unknown[:5]))}; "
                        f"the fields are {', '.join(known)}")
    missing = [k for k in known if k not in data and k not in ("mlp", "tied")]
    if missing:
        raise StepError(f"model {source}: missing key(s) {', '.join(map(repr, missing))}")
    try:
        return Model(**data)
    except StepError as e:
        raise StepError(f"{source}: {e}") from None


def load_model(spec) -> Model:
    """A :class:`Model`, a preset name (:data:`PRESETS`) or the path of a JSON file."""
    if isinstance(spec, Model):
        return spec
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str):
        raise StepError(f"model must be a preset name, a JSON file or a Model, got {type(spec).__name__}")
    if spec in PRESETS:
        return PRESETS[spec]
    if not spec.endswith(".json"):
        raise StepError(f"unknown model {spec[:60]!r}; presets: {', '.join(PRESETS)}, or a FILE.json")
    data = read_json(spec, MAX_MODEL_FILE, "MAX_MODEL_FILE", f"model {spec}", StepError)
    return model_from_dict(data, spec)
