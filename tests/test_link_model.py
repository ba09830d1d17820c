"""``benchmarks/link_model.py``: the link model measured with the runtime's
point-to-point calls, written as a cost profile. On a GPU cluster it runs
under torchrun with NCCL; here its every path runs on local gloo processes
split into pretend nodes, and its model choice is checked on made-up
timings."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from attnplan.backends.cost import get_profile

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "link_model.py"


def _module():
    spec = importlib.util.spec_from_file_location("link_model", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


LM = _module()


def test_the_two_models_of_one_device_and_k_peers():
    alpha, bw, nbytes = 10e-6, 1e9, 10_000  # 10 µs each way, 10 µs of bytes
    for k in (1, 2, 5):
        m = LM.models(alpha, bw, k, nbytes)
        assert m["queue"] == pytest.approx(alpha + k * (alpha + nbytes / bw))
        assert m["fair"] == pytest.approx(2 * alpha + k * nbytes / bw)
    assert LM.models(alpha, bw, 1, nbytes)["queue"] == pytest.approx(LM.models(alpha, bw, 1, nbytes)["fair"])


@pytest.mark.parametrize("truth", ["queue", "fair"])
def test_the_nearer_model_is_chosen(truth):
    rows = [dict(k=k, **LM.models(10e-6, 1e9, k, 10_000)) for k in range(1, 8)]
    for r in rows:
        r["measured_s"] = r[truth] * 1.05  # a measurement 5% above the true model
    chosen, err = LM.choose_links(rows, "queue" if truth == "fair" else "fair")
    assert chosen == truth and err[truth] == pytest.approx(0.05 / 1.05) and err[truth] < min(err.values()) + 1e-12


def test_a_tie_keeps_the_base_model():
    rows = [dict(k=1, measured_s=25e-6, **LM.models(10e-6, 1e9, 1, 5_000))]  # one peer: both models agree
    assert LM.choose_links(rows, "queue")[0] == "queue" and LM.choose_links(rows, "fair")[0] == "fair"


@pytest.mark.parametrize("procs, per_node", [(3, 3), (4, 2)])
def test_it_measures_and_writes_a_profile(tmp_path, procs, per_node):
    out = tmp_path / "link.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--procs", str(procs), "--per-node", str(per_node), "--quick",
                        "--repeats", "2", "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    prof = get_profile(str(out))  # a profile every command takes (--profile FILE.json)
    data = json.loads(out.read_text())
    fit = data["fit"]
    assert prof.name == "h100-links" and prof.links in ("queue", "fair")
    assert prof.intra_alpha == pytest.approx(fit["links"]["intra"]["alpha_s"])
    assert sorted((row["bytes"], row["k"]) for row in fit["fan_in"]) == \
        [(n, k) for n in (65536, 8 << 20) for k in range(1, per_node)]  # both answer sizes, 1 .. node - 1 peers
    assert all(row["measured_s"] > 0 for row in fit["fan_in"])
    assert fit["inter_measured"] == (procs > per_node)
    if procs == per_node:  # one node: nothing crosses nodes, the inter-node link is the intra-node one
        assert (prof.inter_alpha, prof.inter_bw) == (prof.intra_alpha, prof.intra_bw)
    else:
        assert prof.inter_alpha == pytest.approx(fit["links"]["inter"]["alpha_s"])
    assert "intra" in r.stdout and "wrote" in r.stdout
    base = get_profile("h100")
    assert (prof.peak_flops, prof.launch_s, prof.tile_q) == (base.peak_flops, base.launch_s, base.tile_q)
