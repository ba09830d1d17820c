"""The visualizer (issue 5): the data behind every panel agrees with
``plan.stats()``; aggregation (mask bins, timeline spans) keeps totals and
stays within its bounds; the HTML is self-contained and carries the same
numbers; PNGs are written; ``plan explain`` names the right device, documents
and numbers; the CLI commands and their errors.

Every registered strategy is tried (``ATTNPLAN_TEST_STRATEGIES=a,b`` restricts them).
"""

from __future__ import annotations

import json
import os
import re

import attnplan
import numpy as np
import pytest
from attnplan import cli
from attnplan.backends import viz
from attnplan.backends.explain import explain
from attnplan.ir.groups import ungroup
from attnplan.errors import PlanError
from hypothesis import given, settings
from hypothesis import strategies as st

STRATEGIES = [s for s in attnplan.strategies()
              if s in os.environ.get("ATTNPLAN_TEST_STRATEGIES", s).split(",")]

# one long document (it dominates the work), several short ones, two nodes, GQA
# (kv heads = devices: every strategy, ulysses' head split too, accepts the shape)
LENS = [2400, 700, 300, 180, 90, 33, 17]
SHAPE = {"heads": 8, "kv_heads": 4, "head_dim": 32, "block_size": 128}


def compile_plan(strategy="zigzag", lens=LENS, devices=4, nodes=2, **kw):
    args = {**SHAPE, **kw}
    return attnplan.compile(seqlens=lens, mask="causal", devices=devices, nodes=nodes, strategy=strategy, **args)


@pytest.fixture(scope="module", params=STRATEGIES)
def case(request):
    plan = compile_plan(request.param)
    return plan, plan.stats(), viz.panel_data(plan)


# -- mask -------------------------------------------------------------------------------------------

def check_mask(plan, stats, m, max_bins):
    g = plan.ir.graph
    if g.grouped:  # varlen groups (per_doc, dacp) are drawn span by span
        g = ungroup(g)[0]
    n = plan.devices
    assert m["bins"] <= max_bins and len(m["q"]) <= max_bins ** 2
    assert m["aggregated"] == (g.n_tb > max_bins)
    E = m["edges"]
    assert E[0] == 0 and E[-1] == plan.problem.tokens and (np.diff(E) > 0).all()
    assert m["bin_tb0"][0] == 0 and m["bin_tb0"][-1] == g.n_tb and (np.diff(m["bin_tb0"]) > 0).all()
    # bins are unions of whole token blocks, about tokens / max_bins wide (one block more at most)
    assert set(E[:-1].tolist()) <= set(g.tb_start.tolist())
    if m["aggregated"]:
        assert (np.diff(E) <= plan.problem.tokens / max_bins + g.tb_len.max()).all()
    # totals: pairs, blocks, per-device pairs (= FLOPs / 4d)
    assert int(m["pairs"].sum()) == stats["pairs"]
    assert (m["n_tb"], m["n_cb"], m["spans"]) == (plan.ir.graph.n_tb, plan.ir.graph.n_cb, plan.ir.graph.grouped)
    if plan.ir.graph.grouped:  # a group counts once per cell it draws in
        assert plan.ir.graph.n_cb <= int(m["blocks"].sum()) <= g.n_cb
    else:
        assert int(m["blocks"].sum()) == g.n_cb
    per_dev = np.bincount(m["cd_device"], weights=m["cd_pairs"], minlength=n)
    assert per_dev.astype(np.int64).tolist() == stats["per_device"]["pairs"]
    assert (per_dev * 4 * plan.problem.head_dim).astype(np.int64).tolist() == stats["per_device"]["flops"]
    # each cell's per-device rows sum to the cell, and the dominant device is the largest
    cell_id = m["q"] * m["bins"] + m["k"]
    assert len(np.unique(cell_id)) == len(cell_id)
    sums = {c: 0 for c in cell_id.tolist()}
    best = {c: 0 for c in cell_id.tolist()}
    for c, p in zip(m["cd_cell"].tolist(), m["cd_pairs"].tolist()):
        sums[c] += p
        best[c] = max(best[c], p)
    for i, c in enumerate(cell_id.tolist()):
        assert sums[c] == m["pairs"][i]
        assert np.isclose(m["share"][i] * m["pairs"][i], best[c])
        assert m["share"][i] >= 1 / m["devices"][i] - 1e-12
    assert ((m["density"] > 0) & (m["density"] <= 1)).all()
    # every compute block lies inside its cell
    qb = np.searchsorted(E, g.tb_start[g.cb_q], "right") - 1
    kb = np.searchsorted(E, g.tb_start[g.cb_k], "right") - 1
    assert (g.tb_end[g.cb_q] <= E[qb + 1]).all() and (g.tb_end[g.cb_k] <= E[kb + 1]).all()
    assert set((qb * m["bins"] + kb).tolist()) == set(cell_id.tolist())


def test_mask_cells_match_stats(case):
    plan, stats, d = case
    check_mask(plan, stats, d["mask"], 160)


def test_mask_cells_one_per_tile_when_few_blocks():
    plan = compile_plan(pipeline="tile{block=256,head_groups=2},zigzag,comm,emit")
    g = plan.ir.graph
    m = viz.mask_cells(plan, max_bins=10_000)
    assert not m["aggregated"] and m["bins"] == g.n_tb
    assert len(m["q"]) == g.n_tile  # one cell per tile ...
    assert (m["blocks"] == 2).all()  # ... holding its two head groups


@pytest.mark.parametrize("bins", [1, 2, 7, "half"])
def test_mask_aggregation_keeps_totals(case, bins):
    plan, stats, _ = case
    n_tb = plan.ir.graph.n_tb
    max_bins = max(1, n_tb // 2) if bins == "half" else bins
    m = viz.mask_cells(plan, max_bins)
    assert m["aggregated"] == (n_tb > max_bins) and (n_tb > max_bins or n_tb == 1)
    check_mask(plan, stats, m, max_bins)


@settings(max_examples=20)
@given(lens=st.lists(st.integers(1, 400), min_size=1, max_size=12), devices=st.integers(1, 6),
       block=st.sampled_from([16, 64, 100]), max_bins=st.integers(1, 40),
       strategy=st.sampled_from(STRATEGIES or ["zigzag"]))
def test_mask_aggregation_property(lens, devices, block, max_bins, strategy):
    plan = attnplan.compile(seqlens=lens, mask="causal", devices=devices, heads=2 * devices, kv_heads=devices,
                            head_dim=8, block_size=block, strategy=strategy)
    check_mask(plan, plan.stats(), viz.mask_cells(plan, max_bins), max_bins)


# -- bars and heatmap -------------------------------------------------------------------------------

def test_device_bars_match_stats(case):
    _, stats, d = case
    b, pd = d["bars"], stats["per_device"]
    assert b["flops"].tolist() == pd["flops"]
    assert b["tokens"].tolist() == pd["tokens"]
    assert b["comm_in"].tolist() == pd["comm_in_bytes"]
    assert b["comm_out"].tolist() == pd["comm_out_bytes"]
    assert b["memory_fwd"].tolist() == pd["memory_fwd_bytes"]
    assert b["memory_bwd"].tolist() == pd["memory_bwd_bytes"]
    assert int(b["flops"].sum()) == stats["flops_fwd"]
    assert np.isclose(b["flops"].max() / b["means"]["flops"], stats["compute_imbalance"])
    assert np.isclose(b["tokens"].max() / b["means"]["tokens"], stats["token_imbalance"])


def test_comm_matrix_matches_stats(case):
    _, stats, d = case
    c = d["comm"]
    assert int(c["fwd"].sum() + c["bwd"].sum()) == stats["comm_bytes_total"]
    assert int(c["fwd"].sum()) == stats["comm_bytes_fwd"] and int(c["bwd"].sum()) == stats["comm_bytes_bwd"]
    assert int(c["count"].sum()) == stats["messages"]
    assert not np.diagonal(c["fwd"] + c["bwd"] + c["count"]).any()  # nothing is sent to itself
    tot = c["fwd"] + c["bwd"]
    assert int((tot.sum(0) + tot.sum(1)).max()) == stats["comm_bytes_max"]
    assert ((c["count"] > 0) == (tot > 0)).all()


# -- timeline ---------------------------------------------------------------------------------------

def check_timeline(plan, stats, t, max_spans):
    pd = stats["per_device"]
    cb_stage = plan.ir.schedule.cb_stage
    for ph in ("fwd", "bwd"):
        L = t[ph]
        sp = L["spans"]
        assert np.isclose(L["makespan_s"], stats[f"predicted_{ph}_s"], rtol=1e-12, atol=0)
        assert np.allclose(L["finish_s"], pd[f"predicted_{ph}_s"], rtol=1e-12, atol=0)
        ends = sp["t1"][sp["lane"] <= viz.L_WAIT]
        assert np.isclose(ends.max() if len(ends) else 0.0, L["makespan_s"], rtol=1e-12, atol=0)
        # merging keeps counts and busy seconds
        for lane in range(4):
            sel = sp["lane"] == lane
            assert int(sp["n"][sel].sum()) == {viz.L_COMPUTE: L["events"]["compute"], viz.L_WAIT: L["events"]["wait"],
                                               viz.L_SEND: L["events"]["transfer"],
                                               viz.L_RECV: L["events"]["transfer"]}[lane]
        for d in range(plan.devices):
            c = (sp["lane"] == viz.L_COMPUTE) & (sp["dev"] == d)
            w = (sp["lane"] == viz.L_WAIT) & (sp["dev"] == d)
            assert np.isclose(sp["busy"][c].sum(), L["compute_s"][d], rtol=1e-9, atol=1e-15)
            assert np.isclose(sp["busy"][w].sum(), L["wait_s"][d], rtol=1e-9, atol=1e-15)
            # spans of one device and lane are in time order and do not overlap
            for lane in range(4):
                s = (sp["lane"] == lane) & (sp["dev"] == d)
                t0, t1 = sp["t0"][s], sp["t1"][s]
                assert (t0[1:] >= t1[:-1] - 1e-15).all() or lane == viz.L_RECV
            # a compute device's busy time never exceeds its finish time
            assert L["compute_s"][d] + L["wait_s"][d] <= L["finish_s"][d] * (1 + 1e-9) + 1e-15
        # compute spans carry the stage of their blocks (merges: -1)
        c = (sp["lane"] == viz.L_COMPUTE) & (sp["key"] >= 0)
        assert (cb_stage[sp["a"][c]] == sp["key"][c]).all() and (cb_stage[sp["b"][c]] == sp["key"][c]).all()
        assert len(sp["dev"]) <= max_spans or L["eps_s"] > 2 * L["makespan_s"]
        # exposed communication: every wait charged to exactly one stage
        ex = L["exposed"]
        assert np.isclose(sum(v["total_s"] for v in ex.values()), L["wait_s"].sum(), rtol=1e-9, atol=1e-15)
        per = sum((v["per_device"] for v in ex.values()), np.zeros(plan.devices))
        assert np.allclose(per, L["wait_s"], rtol=1e-9, atol=1e-15)
        assert all(s == -1 or 0 <= s < plan.ir.schedule.stages for s in ex)
    assert np.isclose(t["predicted_s"], stats["predicted_s"], rtol=1e-12, atol=0)


def test_timeline_matches_stats(case):
    plan, stats, d = case
    check_timeline(plan, stats, d["timeline"], 20000)


@pytest.mark.parametrize("max_spans", [1, 30, 200])
def test_timeline_aggregation_keeps_totals(case, max_spans):
    plan, stats, d = case
    t = viz.timeline(plan, max_spans=max_spans)
    check_timeline(plan, stats, t, max_spans)
    full = d["timeline"]
    for ph in ("fwd", "bwd"):
        assert len(t[ph]["spans"]["dev"]) <= len(full[ph]["spans"]["dev"])
        assert t[ph]["eps_s"] >= full[ph]["eps_s"]


def test_bad_options_are_plan_errors():
    plan = compile_plan()
    with pytest.raises(PlanError):
        viz.mask_cells(plan, 0)
    with pytest.raises(PlanError):
        viz.timeline(plan, max_spans=0)


# -- HTML -------------------------------------------------------------------------------------------

def page_payload(text: str) -> dict:
    m = re.search(r'<script type="application/json" id="attnplan-data">(.*?)</script>', text, re.DOTALL)
    assert m, "no data script"
    return json.loads(m.group(1))


def test_html_is_self_contained_and_carries_the_stats(case):
    plan, stats, _ = case
    text = viz.render_html(plan)
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    text.encode("ascii")  # pure ASCII: safe in any file encoding
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)
    assert "@import" not in text and "url(" not in text
    data = page_payload(text)
    (p,) = data["plans"]
    bars = {b["key"]: b["values"] for b in p["bars"]}
    assert bars["flops"] == stats["per_device"]["flops"]
    assert bars["comm_in"] == stats["per_device"]["comm_in_bytes"]
    assert sum(p["comm"]["fwd"]) + sum(p["comm"]["bwd"]) == stats["comm_bytes_total"]
    assert sum(p["mask"]["cells"]["pairs"]) == stats["pairs"]
    assert np.isclose(p["timeline"]["fwd"]["makespan"], stats["predicted_fwd_s"] * 1e6)
    for label, value in viz.summary_rows(stats):
        assert f"{label}</th><td>{value}</td>".encode("ascii", "xmlcharrefreplace").decode() in text
    for panel in ("summary", "mask", "bars", "heatmap", "timeline", "explain"):
        assert f'data-panel="{panel}"' in text


def test_html_escapes_names():
    plan = compile_plan()
    text = viz.render_compare_html([("a</script><b>", plan), ("b&c", plan)])
    assert "</script><b>" not in text
    assert page_payload(text)["plans"][0]["name"] == "a</script><b>"
    assert "<h3>b&amp;c</h3>" in text


def test_compare_html_side_by_side():
    a = compile_plan(block_size=128)
    b = compile_plan(block_size=256)
    text = viz.render_compare_html([("small blocks", a), ("large blocks", b)])
    data = page_payload(text)
    assert [p["name"] for p in data["plans"]] == ["small blocks", "large blocks"]
    assert "--cols:2" in text
    assert text.count("class='mask'") == 2 and text.count("class='timeline'") == 4
    # the better value of each lower-is-better row is highlighted
    assert "class=best" in text
    with pytest.raises(PlanError, match="one batch"):
        viz.render_compare_html([("a", a), ("other", compile_plan(lens=[100, 50]))])
    with pytest.raises(PlanError, match="distinct"):
        viz.render_compare_html([("a", a), ("a", b)])
    with pytest.raises(PlanError):
        viz.render_compare_html([])


def test_html_size_stays_bounded_with_many_blocks():
    """A plan with many more token blocks than bins and many events: drawn cells and spans stay within
    their bounds, so the page stays small (the 1M-token, 64-device case: benchmarks/viz_size.py)."""
    rng = np.random.default_rng(0)
    lens = rng.integers(20, 400, size=300).tolist() + [6000]
    plan = attnplan.compile(seqlens=lens, mask="causal", devices=16, nodes=2, heads=2, kv_heads=1, head_dim=16,
                            block_size=64, strategy="zigzag")
    assert plan.ir.graph.n_tb > 160
    d = viz.panel_data(plan, max_bins=40, max_spans=500)
    assert d["mask"]["bins"] <= 40 and len(d["mask"]["q"]) <= 1600
    assert all(len(d["timeline"][ph]["spans"]["dev"]) <= 500 or d["timeline"][ph]["eps_s"] > 2 *
               d["timeline"][ph]["makespan_s"] for ph in ("fwd", "bwd"))
    text = viz.render_html(plan)
    assert len(text) < 1_500_000
    assert len(page_payload(text)["plans"][0]["mask"]["cells"]["q"]) <= 160 ** 2


# -- PNG --------------------------------------------------------------------------------------------

def test_write_pngs(tmp_path):
    plan = compile_plan()
    paths = viz.write_pngs(plan, tmp_path / "png")
    assert [p.name for p in paths] == ["mask.png", "bars.png", "comm.png", "timeline.png"]
    for p in paths:
        head = p.read_bytes()[:24]
        assert head[:8] == b"\x89PNG\r\n\x1a\n"
        w, h = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
        assert w > 300 and h > 300 and p.stat().st_size > 5000


# -- explain ----------------------------------------------------------------------------------------

def test_explain_names_the_most_loaded_device_and_its_document(case):
    plan, stats, d = case
    text = explain(plan, data=d)
    flops = np.asarray(stats["per_device"]["flops"])
    top = int(flops.argmax())
    assert f"most loaded device d{top}: {flops[top] / flops.mean():.2f}× mean forward FLOPs" in text
    # the long document is where the work is: it is named first among the top device's documents
    docs = re.search(r"documents it works on \(\d+ of \d+\): #(\d+)", text)
    assert docs and int(docs.group(1)) == 0, text
    t = stats["predicted_s"]
    assert (f"predicted {t * 1e3:.3f} ms" if t >= 1e-3 else f"predicted {t * 1e6:.1f} µs") in text
    assert f"{stats['predicted_over_lower_bound']:.2f}× the bound" in text
    assert len(text.splitlines()) <= 20


def test_explain_one_device():
    plan = compile_plan()
    text = explain(plan, device=3)
    assert "device (the " in text and " d3: " in text
    assert "to or from d3" in text or "transfers: none to or from d3" in text
    m = re.findall(r"t\d+ (?:fwd|bwd) \w+\[tb\d+,hg\d+\] d(\d+)→d(\d+)", text)
    assert m and all("3" in pair for pair in m)
    with pytest.raises(PlanError, match="does not exist"):
        explain(plan, device=4)


def test_explain_largest_transfers_are_the_largest():
    plan = compile_plan()
    X = plan.ir.program.transfers
    text = explain(plan)
    first = re.search(r"largest transfers \([\d,]+ in all, (\d+) of the largest size\): t(\d+) ", text)
    assert first, text
    assert X[int(first.group(2)), 7] == X[:, 7].max()
    assert int(first.group(1)) == int((X[:, 7] == X[:, 7].max()).sum())


# -- CLI --------------------------------------------------------------------------------------------

def run(capsys, *argv):
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("viz") / "x.plan"
    compile_plan().save(path)
    return path


def test_cli_viz_and_explain(capsys, plan_file, tmp_path):
    code, out, err = run(capsys, "viz", plan_file, "-o", tmp_path / "r.html", "--png", tmp_path / "png")
    assert code == 0, err
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == ["bars.png", "comm.png", "mask.png", "timeline.png"]
    assert "wrote" in out
    code, out, err = run(capsys, "explain", plan_file)
    assert code == 0 and "most loaded device d" in out and "cost model" in out
    code, out, err = run(capsys, "explain", plan_file, "--device", "1")
    assert code == 0 and " d1: " in out


@pytest.mark.parametrize("argv, needle", [
    (["viz", "{plan}"], "-o REPORT.html and/or --png DIR"),
    (["viz", "{tmp}/missing.plan", "-o", "{tmp}/r.html"], "cannot read plan file"),
    (["viz", "{plan}", "-o", "{tmp}/no/such/dir/r.html"], "cannot write report"),
    (["viz", "{plan}", "-o", "{tmp}/r.html", "--profile", "tpu"], "unknown cost profile"),
    (["explain", "{plan}", "--device", "7"], "device 7 does not exist"),
    (["explain", "{plan}", "--device", "x"], "invalid int value"),
])
def test_cli_errors_are_one_line(capsys, plan_file, tmp_path, argv, needle):
    code, out, err = run(capsys, *[a.format(plan=plan_file, tmp=tmp_path) for a in argv])
    assert code == 2, (code, out, err)
    assert re.match(r"plan( explain| viz)?: error: ", err) and err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err, err
