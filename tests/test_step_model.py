"""The step's model and mesh (issue 10, item 1): costs derived from the real
matmul shapes, checked against independent formulas and published sizes;
user models from JSON; meshes and device memory; bad input is one typed error."""

import dataclasses
import json
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnplan.backends.cost import PROFILES, load_profile_file
from attnplan.errors import MemoryCapError, PlanError, StepError
from attnplan.ir.limits import MAX_MODEL_FILE
from attnplan.step import PRESETS, Mesh, Model, load_model, parse_mesh
from attnplan.step.model import (activation_bytes, activation_per_token, attn_flops_per_pair, checkpoint_bytes,
                                 head_flops, layer_activation_bytes, layer_params, linear_flops, model_from_dict,
                                 param_count, skrull_linear_flops, static_bytes)

# published parameter counts (model cards / papers), in billions
PUBLISHED = {"llama3-8b": 8.03, "llama3-70b": 70.6, "qwen2.5-0.5b": 0.49, "qwen2.5-7b": 7.61, "llama-13b": 13.0}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_their_published_sizes(name):
    assert param_count(PRESETS[name]) / 1e9 == pytest.approx(PUBLISHED[name], rel=0.01)


def test_the_issue_lists_these_presets():
    assert {"llama3-8b", "llama3-70b", "qwen2.5-0.5b", "qwen2.5-7b", "gpt-7b", "llama-13b"} <= set(PRESETS)


@st.composite
def models(draw):
    heads = draw(st.integers(1, 64))
    kv = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    mlp = draw(st.sampled_from(["swiglu", "gelu"]))
    return Model("m", draw(st.integers(1, 100)), draw(st.integers(1, 8192)), heads, kv, draw(st.integers(1, 256)),
                 draw(st.integers(1, 40000)), draw(st.integers(1, 200000)), mlp=mlp, tied=draw(st.booleans()))


@given(models())
def test_linear_flops_are_two_per_weight(m):
    """Every matmul weight is used once per token: 2 FLOPs per weight (norms excluded)."""
    assert linear_flops(m) == 2 * (layer_params(m) - 2 * m.hidden)
    assert head_flops(m) == 2 * m.hidden * m.vocab


@given(st.integers(1, 200), st.sampled_from([1, 2, 4, 8]), st.sampled_from(["gelu", "swiglu"]))
def test_skrull_formula_where_it_applies(x, kv, mlp):
    """Skrull's 20h² + 4h·h_kv (survey §1.1) assumes attention width h and 8h² MLP multiply-adds:
    a GELU MLP of 4h or a SwiGLU MLP of 8h/3."""
    h = 24 * x
    ffn = 4 * h if mlp == "gelu" else 8 * h // 3
    m = Model("s", 2, h, 8, kv, h // 8, ffn, 1000, mlp=mlp)
    assert linear_flops(m) == skrull_linear_flops(m)


def test_skrull_check_on_presets():
    # GPT-7B: MHA, GELU 4h -> exact; Llama-3-8B: SwiGLU with ffn 3.5h > 8h/3 -> more than Skrull's estimate
    assert linear_flops(PRESETS["gpt-7b"]) == skrull_linear_flops(PRESETS["gpt-7b"])
    m = PRESETS["llama3-8b"]
    mlp_extra = 2 * (3 * m.hidden * m.ffn - 8 * m.hidden ** 2)
    assert linear_flops(m) == skrull_linear_flops(m) + mlp_extra


def test_attention_flops_match_the_cost_model():
    m = PRESETS["llama3-8b"]
    assert attn_flops_per_pair(m) == 4 * m.head_dim * m.heads  # backends/cost.py: 4 · d · pairs × heads


def test_llama3_activations_are_korthikantis_34h():
    """Korthikanti et al. count 34·h bytes a token a layer (+ dropout masks and the s² term, both absent here)."""
    m = PRESETS["llama3-8b"]
    assert layer_activation_bytes(m) / m.hidden == pytest.approx(34, rel=0.01)


@given(models(), st.integers(0, 10 ** 6), st.integers(0, 10 ** 9))
def test_recompute_keeps_less_and_memory_grows_with_tokens(m, t, buf):
    full, none = (int(activation_bytes(m, t, r, buf)) for r in ("full", "none"))
    assert full <= none + t * layer_activation_bytes(m)
    assert checkpoint_bytes(m) < layer_activation_bytes(m)
    assert int(activation_bytes(m, t + 1, "full", buf)) > full
    assert activation_per_token(m, "full") * t == int(activation_bytes(m, t, "full", 0))


def test_zero1_shards_only_the_optimizer():
    m = PRESETS["llama3-8b"]
    p = param_count(m)
    assert static_bytes(m, 1) == 16 * p
    assert static_bytes(m, 32) == 4 * p + -(-12 * p // 32)
    assert static_bytes(m, 10 ** 6) < 4.01 * p


def test_model_json_round_trip_and_errors(tmp_path):
    m = PRESETS["qwen2.5-0.5b"]
    path = tmp_path / "m.json"
    path.write_text(json.dumps(m.to_dict()))
    assert load_model(str(path)) == m
    for data, match in [({**m.to_dict(), "hiden": 3}, "unknown key"), ({"name": "x"}, "missing key"),
                        ({**m.to_dict(), "layers": 0}, "layers"), ({**m.to_dict(), "heads": True}, "heads"),
                        ({**m.to_dict(), "vocab": 10 ** 30}, "vocab"), ({**m.to_dict(), "kv_heads": 3}, "multiple"),
                        ({**m.to_dict(), "mlp": "relu"}, "mlp"), ([1, 2], "JSON object")]:
        path.write_text(json.dumps(data))
        with pytest.raises(StepError, match=match):
            load_model(str(path))
    path.write_text("{")
    with pytest.raises(StepError, match="not a JSON file"):
        load_model(str(path))
    path.write_bytes(b" " * (MAX_MODEL_FILE + 1))
    with pytest.raises(StepError, match="over the limit"):
        load_model(str(path))
    with pytest.raises(StepError, match="not a regular file"):
        load_model(_dir_json(tmp_path))
    with pytest.raises(StepError, match="unknown model"):
        load_model("llama9")
    with pytest.raises(StepError, match="cannot read"):
        load_model(str(tmp_path / "missing.json"))
    assert model_from_dict({k: v for k, v in m.to_dict().items() if k not in ("mlp",)}, "x").mlp == "swiglu"


def _dir_json(tmp_path):
    d = tmp_path / "dir.json"
    d.mkdir()
    return str(d)


def test_mesh_text_and_memory():
    mesh = parse_mesh("dp=4, cp=8")
    assert (mesh.dp, mesh.cp, mesh.pp, mesh.devices, mesh.nodes) == (4, 8, 1, 32, 4)
    assert mesh.cap(PROFILES["h100"]) == 80 * 2 ** 30 == mesh.cap(PROFILES["a100"])
    assert mesh.cap(PROFILES["h200"]) == 141 * 2 ** 30
    assert Mesh(2, 2, memory_cap=10 ** 9).cap(PROFILES["h200"]) == 10 ** 9
    assert mesh.cp_group(2).tolist() == list(range(16, 24))
    for text, match in [("dp=4", "both"), ("dp=4,cp=8,dp=2", "twice"), ("dp=0,cp=8", "dp"), ("dq=1,cp=2", "cannot"),
                        ("dp=1,cp=100000", "cp"), ("", "mesh"), ("dp=99999999,cp=9999", "dp"), ("dp=3,cp=1", "nodes")]:
        with pytest.raises(StepError, match=match):
            parse_mesh(text)
    with pytest.raises(StepError, match="whole nodes"):
        Mesh(3, 4)
    with pytest.raises(StepError, match="recompute"):
        Mesh(1, 2, recompute="some")


def test_profile_memory_is_optional_in_files_and_checked(tmp_path):
    full = dataclasses.asdict(PROFILES["h200"])
    path = tmp_path / "p.json"
    path.write_text(json.dumps({k: v for k, v in full.items() if k != "memory_bytes"}))
    assert load_profile_file(path).memory_bytes == 80 * 2 ** 30
    path.write_text(json.dumps(full | {"memory_bytes": -1}))
    with pytest.raises(PlanError, match="memory_bytes"):
        load_profile_file(path)
    path.write_text(json.dumps(full))
    assert load_profile_file(path) == PROFILES["h200"]


def test_memory_cap_error_keeps_its_fields_across_processes():
    e = MemoryCapError("device 3 over", device=3, micro_batch=1, nbytes=10, cap=5)
    back = pickle.loads(pickle.dumps(e))
    assert isinstance(back, StepError) and (back.device, back.micro_batch, back.bytes, back.cap) == (3, 1, 10, 5)
    assert str(back) == "device 3 over"
