"""attnplan.hf: attnplan as transformers' attention implementation (issue 13).

A shortened examples/hf_train.py (3 steps, 2 gloo processes, Llama and
Qwen2, four strategies) against the same models trained in one process with
attn_implementation="sdpa"; one-process checks (one-device plans) of the
sliding window, the mask and position checks, and every refused case."""

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import attnplan  # noqa: E402
import attnplan.hf as hf  # noqa: E402
from attnplan.errors import PlanError, ShapeError  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_train.py"
TOL = 1e-5  # the acceptance: relative difference in float32


@pytest.fixture(scope="module")
def ex():
    spec = importlib.util.spec_from_file_location("hf_train", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# one process, one-device plans ---------------------------------------------------------------------

SMALL = dict(tokens=96, block_size=16, steps=1)


def packed(ex, seed=0, tokens=96):
    """A seeded packed batch of several documents: (seqlens, ids [T])."""
    b = next(ex.batches(dict(ex.CONFIG, seed=seed, tokens=tokens)))
    assert len(b["seqlens"]) > 1
    return b["seqlens"], torch.from_numpy(b["ids"])


def positions(seqlens):
    return torch.from_numpy(np.concatenate([np.arange(n) for n in seqlens]))


def one_device_plan(seqlens, mask="causal", heads=4, kv_heads=2, head_dim=8):
    return attnplan.compile(seqlens=seqlens, mask=mask, devices=1, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                            block_size=16, dtype="float32")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (the example's measure of a relative difference)."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


def llama(ex, attn="attnplan", **over):
    return ex.make_model(dict(ex.CONFIG, **SMALL, **over), attn)


def logits_in_context(model, plan, ids, pos, **kw):
    with hf.plan_context(plan, **kw):
        return model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]


def test_registered_under_its_name():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    assert AttentionInterface._global_mapping[hf.NAME] is hf.attention_forward
    hf.register()  # again: harmless
    assert AttentionInterface._global_mapping["attnplan"] is hf.attention_forward
    assert AttentionMaskInterface._global_mapping["attnplan"] is hf.mask_forward


def test_set_attn_implementation_switches_an_sdpa_model(ex):
    """A model built with sdpa and switched to attnplan gives the sdpa model's
    per-document logits and gradients on a one-device plan."""
    lens, ids = packed(ex)
    pos = positions(lens)
    ref = llama(ex, "sdpa")
    want = ref(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]
    want.square().sum().backward()
    model = llama(ex, "sdpa")
    model.set_attn_implementation("attnplan")
    assert model.config._attn_implementation == "attnplan"
    got = logits_in_context(model, one_device_plan(lens), ids, pos)
    got.square().sum().backward()
    assert rel(got, want) <= TOL
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert rel(p.grad, q.grad) <= TOL, n


def _mistral(ex, window, attn):
    from transformers import AutoModelForCausalLM, MistralConfig
    c = ex.CONFIG
    cfg = MistralConfig(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["intermediate"],
                        num_hidden_layers=2, num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
                        head_dim=c["head_dim"], sliding_window=window, use_cache=False)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def block_causal(lens, window=None) -> torch.Tensor:
    """[1, 1, T, T] bool: same document, k <= q (and q - window < k)."""
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    q, k = torch.arange(len(doc))[:, None], torch.arange(len(doc))[None, :]
    m = (doc[:, None] == doc[None, :]) & (k <= q)
    if window is not None:
        m &= k > q - window
    return m[None, None]


@pytest.mark.parametrize("window", [None, 8])
def test_mistral_sliding_window_equals_sdpa_with_an_explicit_mask(ex, window):
    """Mistral passes sliding_window to the attention function: a plan whose
    mask is that window equals sdpa with an explicit per-document window mask."""
    lens, ids = packed(ex)
    assert max(lens) > 8  # the window cuts some documents
    pos = positions(lens)
    ref = _mistral(ex, window, "sdpa")
    want = ref(input_ids=ids[None], position_ids=pos[None], attention_mask=block_causal(lens, window),
               use_cache=False).logits[0]
    model = _mistral(ex, window, "attnplan")
    plan = one_device_plan(lens, "causal" if window is None else f"sliding_window({window})")
    got = logits_in_context(model, plan, ids, pos)
    assert rel(got, want) <= TOL


def test_sliding_window_layer_refuses_a_causal_plan_when_a_document_is_longer(ex):
    lens, ids = packed(ex)
    model = _mistral(ex, 8, "attnplan")
    with pytest.raises(PlanError, match=r"sliding-window attention \(window 8\).*mask='sliding_window\(8\)'"):
        logits_in_context(model, one_device_plan(lens), ids, positions(lens))
    # a window no document reaches is causal on this batch: the causal plan is accepted
    wide = _mistral(ex, max(lens), "attnplan")
    assert logits_in_context(wide, one_device_plan(lens), ids, positions(lens)).shape == (len(ids), ex.CONFIG["vocab"])


def test_the_reference_masks_per_document(ex):
    """The sdpa reference (position_ids, no mask) equals the explicit
    block-diagonal causal mask, and differs from one causal sequence: the
    acceptance tolerance tells the masks apart."""
    lens, ids = packed(ex)
    pos = positions(lens)
    ref = llama(ex, "sdpa")
    by_pos = ref(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]
    explicit = ref(input_ids=ids[None], position_ids=pos[None], attention_mask=block_causal(lens),
                   use_cache=False).logits[0]
    one_seq = ref(input_ids=ids[None], position_ids=pos[None], attention_mask=block_causal([len(ids)]),
                  use_cache=False).logits[0]
    assert rel(by_pos, explicit) <= TOL
    assert rel(one_seq, by_pos) > 100 * TOL


@pytest.mark.parametrize("window", [None, 4, 16, 1000])
def test_mask_matches_is_the_dense_comparison(window):
    lens = [3, 17, 1, 30, 9, 36]  # shorter and longer than the windows, a one-token document
    want = block_causal(lens, window)[0, 0].numpy()  # what the layer computes, written densely
    matched = []
    for mask in ("causal", "sliding_window(4)", "sliding_window(16)", "full", "prefix_lm(3)", "chunked_causal(8)"):
        p = one_device_plan(lens, mask).problem
        same = np.array_equal(p.pieces.to_dense(p.tokens), want)
        assert hf.mask_matches(p, window) == same, (mask, window)
        matched.append(same)
    assert any(matched) and not all(matched)


def test_packed_labels_shift_inside_documents(ex):
    lens, ids = packed(ex, seed=5)
    plan = one_device_plan(lens)
    lab = hf.packed_labels(plan, ids)
    assert torch.equal(lab, ex.reference_labels(ids.numpy(), lens))
    assert int((lab == -100).sum()) == len(lens)
    assert torch.equal(hf.packed_labels(plan, ids[None].numpy()), lab)
    with pytest.raises(ShapeError, match="96 integer token ids"):
        hf.packed_labels(plan, ids[:-1])
    with pytest.raises(ShapeError):
        hf.packed_labels(plan, ids.float())


# errors ------------------------------------------------------------------------------------------

def test_no_plan_set(ex):
    lens, ids = packed(ex)
    with pytest.raises(PlanError, match="outside attnplan.hf.plan_context"):
        llama(ex)(input_ids=ids[None], position_ids=positions(lens)[None], use_cache=False)


def test_gradient_checkpointing_recomputes_inside_the_context(ex):
    """The recomputed forward runs during backward: inside the context it
    gives sdpa's gradients; outside, the no-plan error."""
    lens, ids = packed(ex)
    pos, plan = positions(lens), one_device_plan(lens)
    ref = llama(ex, "sdpa")
    ref(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits.square().sum().backward()
    model = llama(ex)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()  # transformers 5 renamed gradient_checkpointing_enable
    with hf.plan_context(plan) as ctx:
        model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits.square().sum().backward()
    assert ctx.calls == 2 * ex.CONFIG["layers"]  # forward, then forward again in backward
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert rel(p.grad, q.grad) <= TOL
    with hf.plan_context(plan):
        out = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits
    with pytest.raises(PlanError, match="call backward inside the context too"):
        out.square().sum().backward()


def test_plan_for_another_number_of_tokens(ex):
    lens, ids = packed(ex)
    other = one_device_plan(list(lens[:-1]) + [lens[-1] + 4])
    with pytest.raises(ShapeError, match=r"got 96 tokens but the plan gives this rank 100"):
        logits_in_context(llama(ex), other, ids, positions(lens))


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 8), (4, 4, 8), (4, 2, 16)])
def test_plan_for_other_heads(ex, heads, kv_heads, head_dim):
    lens, ids = packed(ex)
    plan = one_device_plan(lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    with pytest.raises(ShapeError, match=r"has 4 query heads, 2 kv heads and head_dim 8, but the plan was compiled "
                                         rf"for heads={heads}, kv_heads={kv_heads}, head_dim={head_dim}"):
        logits_in_context(llama(ex), plan, ids, positions(lens))


def test_an_encoder_is_not_supported(ex):
    from transformers import AutoModel, BertConfig
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    bert = AutoModel.from_config(cfg, attn_implementation="attnplan")
    lens, ids = packed(ex)
    with pytest.raises(PlanError, match=r"BertSelfAttention \(layer 0\) computes bidirectional \(encoder\) attention"):
        with hf.plan_context(one_device_plan(lens, heads=4, kv_heads=4)):
            bert(input_ids=ids[None])


def test_a_model_that_does_not_call_attnplan(ex):
    """A model left on sdpa inside plan_context would silently attend within
    each rank's tokens only: leaving the context says so."""
    lens, ids = packed(ex)
    with pytest.raises(PlanError, match="no attention layer ran through attnplan"):
        logits_in_context(llama(ex, "sdpa"), one_device_plan(lens), ids, positions(lens))


def test_the_model_asks_for_what_attnplan_does_not_compute(ex):
    lens, ids = packed(ex)
    plan, pos = one_device_plan(lens), positions(lens)
    padded = torch.ones(1, len(ids), dtype=torch.long)
    padded[0, -3:] = 0
    for mask in (padded, block_causal(lens)):  # a padding mask (transformers would drop it), a 4-D mask
        with pytest.raises(PlanError, match=re.escape(f"got an attention_mask of shape {list(mask.shape)}")):
            with hf.plan_context(plan):
                llama(ex)(input_ids=ids[None], position_ids=pos[None], attention_mask=mask, use_cache=False)
    # a mask that pads nothing changes nothing
    same = llama(ex)
    with hf.plan_context(plan):
        a = same(input_ids=ids[None], position_ids=pos[None], attention_mask=torch.ones(1, len(ids)), use_cache=False)
        b = same(input_ids=ids[None], position_ids=pos[None], use_cache=False)
    assert torch.equal(a.logits, b.logits)
    drop = llama(ex)
    drop.config.attention_dropout = 0.1
    for layer in drop.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(PlanError, match="attention dropout 0.1"):
        logits_in_context(drop, plan, ids, pos)
    with pytest.raises(ShapeError, match="batch size 2"):
        with hf.plan_context(plan):
            llama(ex)(input_ids=torch.stack([ids, ids]), position_ids=torch.stack([pos, pos]), use_cache=False)


def test_positions_must_be_the_plans(ex):
    lens, ids = packed(ex)
    plan = one_device_plan(lens)
    with pytest.raises(ShapeError, match=r"position_ids that are not plan.position_ids\(0\)"):
        with hf.plan_context(plan):
            llama(ex)(input_ids=ids[None], use_cache=False)  # transformers' default: 0..T-1 over the row


def test_strict_refuses_another_mask_and_strict_false_uses_it(ex):
    lens, ids = packed(ex)
    pos = positions(lens)
    full = one_device_plan(lens, "full")
    with pytest.raises(PlanError, match=r"the plan's mask 'full' differs"):
        logits_in_context(llama(ex), full, ids, pos)
    causal = logits_in_context(llama(ex), one_device_plan(lens), ids, pos)
    bidir = logits_in_context(llama(ex), full, ids, pos, strict=False)
    assert rel(bidir, causal) > 100 * TOL


def test_context_arguments_are_checked(ex):
    lens, _ = packed(ex)
    with pytest.raises(PlanError, match="plan must be an attnplan.Plan"):
        hf.plan_context("x.plan")
    with pytest.raises(PlanError, match="timeout"):
        hf.plan_context(one_device_plan(lens), timeout=float("nan"))
    with pytest.raises(PlanError, match="strict"):
        hf.plan_context(one_device_plan(lens), strict="yes")
    two = attnplan.compile(seqlens=lens, devices=2, heads=4, kv_heads=2, head_dim=8, block_size=16)
    with pytest.raises(PlanError, match="torch.distributed is not initialized"):
        hf.plan_context(two)
    assert hf.current() is None


@pytest.mark.parametrize("strategy", ["zigzag", "hypergraph", "ulysses"])
def test_a_virtual_context_runs_a_multi_device_plan_in_one_process(ex, strategy):
    """``plan_context(virtual=True)``: every device's program in this process on the whole batch (how one GPU
    checks a multi-device plan): training equals sdpa, as the one-device and distributed runs do."""
    cfg = dict(ex.CONFIG, strategy=strategy, steps=2, tokens=128, block_size=16)
    got, ref = ex.train_local(cfg, devices=2 if strategy == "ulysses" else 3), ex.train_reference(cfg)
    d = ex.differences(got, ref)
    assert d["loss"] <= TOL and d["grad"] <= TOL, d


def test_a_virtual_context_wants_the_whole_batch(ex):
    lens, ids = packed(ex)
    plan = attnplan.compile(seqlens=lens, devices=2, heads=4, kv_heads=2, head_dim=8, block_size=16, dtype="float32")
    model = llama(ex)
    with pytest.raises(ShapeError, match="virtual context runs the whole batch"):
        logits_in_context(model, plan, plan.dispatch(ids, 0), positions(lens)[:plan.local_tokens(0)], virtual=True)
    with pytest.raises(PlanError, match="virtual must be True or False"):
        hf.plan_context(plan, virtual="yes")
    out = logits_in_context(model, plan, ids, positions(lens), virtual=True)
    assert out.shape == (len(ids), ex.CONFIG["vocab"])


def test_hf_train_on_cuda_without_a_gpu_says_so(ex, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert ex.main(["--device", "cuda", "--steps", "1"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


# 2 gloo processes: the shortened example ---------------------------------------------------------

RUNS = [("llama", "zigzag"), ("llama", "hypergraph"), ("qwen2", "minheap"), ("qwen2", "dacp")]


@pytest.fixture(scope="module")
def distributed(ex):
    cfgs = [dict(ex.CONFIG, model=m, strategy=s, steps=3) for m, s in RUNS]
    return cfgs, ex.run(2, cfgs, timeout=240)


@pytest.mark.parametrize("i", range(len(RUNS)), ids=[f"{m}-{s}" for m, s in RUNS])
def test_two_processes_train_like_one_sdpa_process(ex, distributed, i):
    cfgs, results = distributed
    cfg, got = cfgs[i], results[i]
    ref = ex.train_reference(cfg)
    names = [n for n, _ in ex.make_model(cfg, "sdpa").named_parameters()]
    assert sorted(got["grads"]) == sorted(names)  # every parameter's step-1 gradient came back
    if cfg["model"] == "qwen2":
        assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias"} <= set(names)
    d = ex.differences(got, ref)
    assert len(got["losses"]) == cfg["steps"]
    assert d["loss"] <= TOL, d
    assert d["grad"] <= TOL, d
    assert got["losses"][0] != got["losses"][1]  # the optimizer steps (the losses are not one repeated value)
