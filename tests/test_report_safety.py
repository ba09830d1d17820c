"""The report, the explainer and the cost model against hostile input (issue 8):

* names and texts that reach the HTML page (strategy and plan names, meta
  strings, mask text, profile names) cannot end, comment out or break the
  page's elements: the JSON payload escapes ``<``, ``>``, ``&``, U+2028/2029;
  a real browser renders every panel of such a page (slow tier);
* ``$`` in plan metadata is text in the PNGs, never mathtext;
* a plan's ``meta.profile`` is only ever a builtin name: the tool never opens
  a file a plan names; a profile file is read only when the user gives it;
* a cost profile JSON with a string, zero, negative, nan or inf value, a
  missing or unknown key, non-object JSON, or too many bytes is one
  ``PlanError`` naming the key (exit 2 on the CLI), checked when the profile
  is built;
* the page's script and style are package data; the report's functions stay small.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
import re
from importlib import resources
from pathlib import Path

import attnplan
import numpy as np
import pytest
from attnplan import cli
from attnplan.backends import viz
from attnplan.backends.cost import PROFILES, Profile, builtin_profile, get_profile, load_profile_file, resolve_profile
from attnplan.backends.explain import explain
from attnplan.errors import PlanError
from attnplan.ir.limits import MAX_PROFILE_FILE

HOSTILE = ["<!--<script>", "</script><script>window.pwned=1</script>", "a\u2028b\u2029c & d > e", "<!--",
           "]]></p>&amp;<b>", r"$\frac{$"]

BACKENDS = Path(attnplan.__file__).resolve().parent / "backends"


def small_plan(**kw):
    args = dict(seqlens=[700, 300, 90], mask="causal", devices=4, heads=4, kv_heads=2, head_dim=32, block_size=128)
    return attnplan.compile(**{**args, **kw})


@pytest.fixture(scope="module")
def plan():
    return small_plan()


def renamed(plan, **meta):
    """The same IR with other metadata (what a crafted plan file carries)."""
    return attnplan.Plan(plan.ir, {**plan.meta, **meta})


def payload_text(page: str) -> str:
    m = re.search(r'<script type="application/json" id="attnplan-data">(.*?)</script>', page, re.DOTALL)
    assert m, "no data script"
    return m.group(1)


# -- HTML: JSON embedded in the page -----------------------------------------------------------------

@pytest.mark.parametrize("s", HOSTILE + ["\u2028", "&lt;", "\\u003c", "<\\/script>", "é→µ"])
def test_json_for_html_escapes_and_round_trips(s):
    text = viz.json_for_html({"name": s, s: [s, 1, 2.5]})
    assert not set(text) & set("<>&\u2028\u2029"), text
    assert text.isascii()
    assert json.loads(text) == {"name": s, s: [s, 1, 2.5]}


def test_json_for_html_refuses_non_finite_numbers():
    with pytest.raises(PlanError, match="not finite"):
        viz.json_for_html({"x": float("nan")})


def check_page_structure(page: str) -> dict:
    """The page has exactly its own elements: two scripts, one style, no comment; the payload parses."""
    assert page.isascii()
    low = page.lower()
    assert low.count("<script") == 2 and low.count("</script") == 2, "a name added or ended a script element"
    assert low.count("<style") == 1 and low.count("</style") == 1
    assert "<!--" not in page
    data = json.loads(payload_text(page))
    assert not set(payload_text(page)) & set("<>&")
    return data


def test_hostile_names_in_a_comparison_stay_data(plan):
    named = [(n, renamed(plan, strategy=n, pipeline=n)) for n in HOSTILE]
    page = viz.render_compare_html(named, title="<!--<script> & title")
    data = check_page_structure(page)
    assert [p["name"] for p in data["plans"]] == HOSTILE
    assert [p["strategy"] for p in data["plans"]] == HOSTILE
    for n in HOSTILE:  # headings and the summary table show the escaped text
        assert f"<h3>{_ref(n)}</h3>" in page


def _ref(s: str) -> str:
    """``s`` as the page writes it in markup: HTML-escaped, non-ASCII as character references."""
    import html
    return html.escape(s).encode("ascii", "xmlcharrefreplace").decode("ascii")


def test_hostile_mask_text_and_meta_in_a_single_report():
    mask = "causal  # <!--<script> </script> \u2028 & >"
    plan = renamed(small_plan(mask=mask), strategy="<!--<script>", pipeline="</script>")
    page = viz.render_html(plan)
    check_page_structure(page)
    assert "# &lt;!--&lt;script&gt; &lt;/script&gt;" in page  # the subtitle shows the mask text, escaped
    assert "<title>attnplan report \u2014 &lt;!--&lt;script&gt;".encode("ascii", "xmlcharrefreplace").decode() in page


def test_hostile_profile_name_in_the_report(plan, tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(dataclasses.asdict(PROFILES["h100"]) | {"name": "<!--<script> $\\frac{$"}))
    page = viz.render_html(plan, profile=str(path))
    check_page_structure(page)
    assert "&lt;!--&lt;script&gt; $\\frac{$" in page


def test_page_script_and_style_are_package_data():
    report = resources.files("attnplan.backends").joinpath("report")
    js, css = (report.joinpath(n).read_text(encoding="utf-8") for n in ("report.js", "report.css"))
    # inlined as they are, so neither may end its element or open a comment
    assert "</script" not in js.lower() and "<!--" not in js
    assert "</style" not in css.lower() and "<!--" not in css
    page = viz.render_html(small_plan())
    assert css in page
    assert js.encode("ascii", "backslashreplace").decode("ascii") in page
    # pyproject ships them: the globs of its package data match these files
    pyproject = (BACKENDS.parent / "pyproject.toml").read_text()
    assert '"attnplan.backends" = ["report/*.js", "report/*.css"]' in pyproject


# -- the browser: a page of hostile names renders every panel (slow) -------------------------------

def _browser_harness():
    spec = importlib.util.spec_from_file_location("attnplan_browser_harness",
                                                  Path(__file__).with_name("test_browser.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_hostile_names_render_in_chromium(plan, tmp_path):
    B = _browser_harness()
    if not os.access(B.CHROMIUM, os.X_OK):
        pytest.skip(f"headless Chromium not found at {B.CHROMIUM}")
    names = HOSTILE[:3]
    named = [(n, renamed(plan, strategy=n, pipeline=n)) for n in names]
    good = viz.render_compare_html(named)
    # the same page with the old escaping (only "</" escaped): the harness must see it break
    data = json.loads(payload_text(good))
    old = good.replace(payload_text(good), json.dumps(data, separators=(",", ":")).replace("</", "<\\/"))
    (tmp_path / "good.html").write_text(good, encoding="utf-8")
    (tmp_path / "old.html").write_text(old, encoding="utf-8")
    with B.Browser() as browser:
        r = B.inspect_report(browser, (tmp_path / "good.html").as_uri(), mask_point=(500, 100))
        bad = B.inspect_report(browser, (tmp_path / "old.html").as_uri())
    B._check_page(r, len(names))
    assert "compute block c" in r["tips"]["mask"], r["tips"]
    assert bad["rendered"] == 0  # with "<!--<script>" in the payload no panel is drawn


# -- PNG: no mathtext from metadata ------------------------------------------------------------------

# an even number of "$" each: matplotlib would parse every pair as mathtext and fail on \frac{, x^ and the rest
DOLLARS = r"$\frac{$ and $x^$ and $$ and $\undefinedcommand$"


def test_pngs_draw_dollar_names_as_text(plan, tmp_path):
    paths = viz.write_pngs(renamed(plan, strategy=DOLLARS), tmp_path / "png", dpi=50)
    assert [p.name for p in paths] == ["mask.png", "bars.png", "comm.png", "timeline.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 2000 for p in paths)


def test_png_titles_are_not_parsed_as_math(plan):
    """The figures' texts, titles included, are made with math parsing off."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from attnplan.backends import png
    d = viz.panel_data(plan)
    with plt.rc_context({"text.parse_math": False}):
        fig = png._mask_figure(plt, d, viz.device_palette(plan.devices), r"$\frac{$")
    try:
        assert fig.axes[0].title.get_parse_math() is False
        assert r"$\frac{$" in fig.axes[0].get_title()
    finally:
        plt.close(fig)
    fig = png._bars_figure(plt, d, viz.device_palette(plan.devices), r"$\frac{$")  # outside the context too
    try:
        assert fig._suptitle.get_parse_math() is False
    finally:
        plt.close(fig)


@pytest.mark.slow
def test_cli_png_of_a_plan_with_a_dollar_strategy(plan, tmp_path, capsys):
    path = tmp_path / "dollar.plan"
    renamed(plan, strategy=DOLLARS).save(path)
    assert cli.main(["viz", str(path), "--png", str(tmp_path / "png"), "-o", str(tmp_path / "r.html")]) == 0
    assert (tmp_path / "png" / "timeline.png").stat().st_size > 5000
    check_page_structure((tmp_path / "r.html").read_text())


# -- profiles: a plan never names a file -------------------------------------------------------------

def good_profile(tmp_path, **changes) -> Path:
    path = tmp_path / "good.json"
    path.write_text(json.dumps(dataclasses.asdict(PROFILES["a100"]) | changes))
    return path


def test_meta_profile_is_only_a_builtin_name(plan, tmp_path):
    """A plan whose metadata names a readable, valid profile file: the file is not opened."""
    path = good_profile(tmp_path, name="from-file")
    crafted = attnplan.Plan(plan.ir, {**plan.meta, "profile": str(path)})
    calls = [lambda: crafted.stats(), lambda: viz.panel_data(crafted), lambda: viz.render_html(crafted),
             lambda: explain(crafted), lambda: viz.timeline(crafted)]
    for call in calls:
        with pytest.raises(PlanError, match="not a builtin one"):
            call()
    # the same file given explicitly is the user's choice: read
    assert crafted.stats(str(path))["profile"] == "from-file"
    assert "cost model (from-file)" in explain(crafted, profile=str(path))
    # a builtin name recorded in the plan is used
    assert attnplan.Plan(plan.ir, {**plan.meta, "profile": "a100"}).stats()["profile"] == "a100"


def test_profile_lookups_are_split():
    assert builtin_profile("h100") is PROFILES["h100"]
    with pytest.raises(PlanError, match="unknown cost profile"):
        builtin_profile("x.json")
    with pytest.raises(PlanError, match="unknown cost profile"):
        builtin_profile(None)
    assert resolve_profile(None, None) is PROFILES["h100"]
    assert resolve_profile("a100", "h100") is PROFILES["a100"]
    assert get_profile(PROFILES["a100"]) is PROFILES["a100"]


def test_a_profile_file_is_read_only_when_given(plan, tmp_path):
    path = good_profile(tmp_path, name="calibrated", threads=1, host="box")  # what plan calibrate writes
    prof = load_profile_file(path)
    assert dataclasses.replace(prof, name="a100") == PROFILES["a100"]
    assert plan.stats(str(path))["predicted_s"] == plan.stats("a100")["predicted_s"]
    compiled = small_plan(profile=str(path))  # compile's profile stays with the plan in memory ...
    assert compiled.stats()["profile"] == "calibrated"
    assert "profile" not in attnplan.Plan.from_bytes(compiled.to_bytes()).meta  # ... never in its file


# -- profiles: every bad value is one PlanError naming its key ---------------------------------------

BAD_VALUES = [
    ("peak_flops", "fast"), ("peak_flops", 0), ("peak_flops", -1e12), ("peak_flops", True), ("peak_flops", None),
    ("efficiency", 0), ("efficiency", 1.5), ("launch_s", -5e-6), ("tile_q", 0), ("tile_q", 1.5), ("tile_q", -128),
    ("tile_q", "128"), ("tile_q", 2 ** 70), ("intra_bw", 0), ("inter_bw", -45e9), ("intra_alpha", -1e-5),
    ("inter_alpha", [1]), ("mem_bw", {"x": 1}), ("bwd_factor", 0), ("bwd_factor", -2.5), ("name", ""),
    ("name", 7), ("fused", 1), ("fused", "true"), ("fused", None),
]


@pytest.mark.parametrize("key,value", BAD_VALUES)
def test_bad_profile_values_name_the_key(plan, tmp_path, key, value):
    path = good_profile(tmp_path, **{key: value})
    with pytest.raises(PlanError, match=re.escape(key)):
        plan.stats(str(path))


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
@pytest.mark.parametrize("key", ["peak_flops", "inter_bw", "launch_s", "mem_bw"])
def test_non_finite_profile_values(tmp_path, key, literal):
    text = json.dumps(dataclasses.asdict(PROFILES["h100"]) | {key: "@@"}).replace('"@@"', literal)
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(PlanError, match=f"{key}.*finite"):
        load_profile_file(path)


def test_negative_values_no_longer_predict_negative_times(plan, tmp_path):
    """The issue's case: negative numbers were accepted and predicted -2000 ms."""
    path = good_profile(tmp_path, peak_flops=-312e12, intra_bw=-240e9)
    with pytest.raises(PlanError, match="peak_flops must be a finite number >= 1"):
        plan.stats(str(path))


@pytest.mark.parametrize("key,value", [("peak_flops", 1e-300), ("intra_bw", 1e-300), ("inter_alpha", 1e300)])
def test_extreme_values_that_would_predict_inf_or_nan_are_refused(plan, tmp_path, key, value):
    path = good_profile(tmp_path, **{key: value})
    with pytest.raises(PlanError, match=f"{key} must be a finite number"):
        plan.stats(str(path))


def test_missing_and_unknown_keys(tmp_path):
    full = dataclasses.asdict(PROFILES["h100"])
    for key in ("name", "peak_flops", "tile_q", "mem_bw"):
        path = tmp_path / f"no_{key}.json"
        path.write_text(json.dumps({k: v for k, v in full.items() if k != key}))
        with pytest.raises(PlanError, match=f"missing key.*'{key}'"):
            load_profile_file(path)
    path = tmp_path / "no_bwd.json"  # bwd_factor has a default
    path.write_text(json.dumps({k: v for k, v in full.items() if k != "bwd_factor"}))
    assert load_profile_file(path).bwd_factor == PROFILES["h100"].bwd_factor
    path = tmp_path / "extra.json"
    path.write_text(json.dumps(full | {"peak_flop": 1e12}))
    with pytest.raises(PlanError, match="unknown key.*'peak_flop'"):
        load_profile_file(path)


@pytest.mark.parametrize("content,match", [
    ("[1, 2]", "JSON object"), ('"h100"', "JSON object"), ("null", "JSON object"), ("3", "JSON object"),
    ("{", "not a JSON file"), ("", "not a JSON file"), ("[" * 100_000 + "]" * 100_000, "not a JSON file|JSON object"),
    (b"\xff\xfe{}", "not a JSON file"),
])
def test_non_object_and_broken_json(tmp_path, content, match):
    path = tmp_path / "p.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(PlanError, match=match):
        load_profile_file(path)


def test_huge_and_special_files(tmp_path):
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:  # sparse: the limit is checked before anything is read
        f.truncate(MAX_PROFILE_FILE + 1)
    with pytest.raises(PlanError, match="MAX_PROFILE_FILE"):
        load_profile_file(huge)
    with pytest.raises(PlanError, match="not a regular file"):
        load_profile_file(tmp_path)
    if os.path.exists("/dev/zero"):
        with pytest.raises(PlanError, match="not a regular file"):
            load_profile_file("/dev/zero")
    with pytest.raises(PlanError, match="cannot read"):
        load_profile_file(tmp_path / "missing.json")


def test_profile_is_checked_when_built():
    """Profiles built in code go through the same checks (one place: ``Profile.__post_init__``)."""
    with pytest.raises(PlanError, match="mem_bw"):
        Profile("x", 1e12, 0.5, 0.0, 128, 1e9, 1e9, 0.0, 0.0, 0.0)
    with pytest.raises(PlanError, match="tile_q"):
        dataclasses.replace(PROFILES["h100"], tile_q=np.float64(128))
    p = Profile("x", 10 ** 12, 1, 0, np.int64(64), 10 ** 9, 10 ** 9, 0, 0, 10 ** 9)  # ints are fine: stored as floats
    assert isinstance(p.peak_flops, float) and p.flops == 1e12 and type(p.tile_q) is int


@pytest.mark.parametrize("cmd", ["stats", "explain", "viz"])
def test_cli_bad_profile_is_one_line(plan, tmp_path, capsys, cmd):
    plan_path = tmp_path / "x.plan"
    plan.save(plan_path)
    prof = good_profile(tmp_path, inter_bw="fast")
    extra = ["-o", str(tmp_path / "r.html")] if cmd == "viz" else []
    assert cli.main([cmd, str(plan_path), "--profile", str(prof), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "inter_bw" in err and "Traceback" not in err, err


# -- small functions ---------------------------------------------------------------------------------

@pytest.mark.parametrize("module", ["viz", "html_report", "panels", "timeline", "png", "palette", "explain", "cost",
                                    "stats"])
def test_report_functions_are_small(module):
    tree = ast.parse((BACKENDS / f"{module}.py").read_text())
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60]
    assert not long, long
    asserts = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert)]
    assert not asserts, f"assert statements (gone under python -O) at lines {asserts}"


# -- the timeline's exposed communication: the vectorized search against its definition ----------

def test_next_compute_matches_a_direct_search():
    from attnplan.backends.timeline import _next_compute
    rng = np.random.default_rng(7)
    for _ in range(200):
        n, ncb, nw = (int(x) for x in rng.integers(1, [6, 30, 25]))
        t0 = np.round(rng.random(ncb + 3) * 8, 1)  # rounded: many ties
        C = np.stack([rng.integers(0, n, ncb + 3), t0, t0 + 0.5, np.r_[np.arange(ncb), [-1, -1, -1]]], 1)
        end = np.round(rng.random(nw) * 8, 1)
        W = np.stack([rng.integers(0, n, nw), end - 0.2, end, np.zeros(nw)], 1).reshape(-1, 4)
        got = _next_compute(C, W)
        for w in range(nw):  # the first compute block (in start order, then row order) at or after the wait's end
            rows = [i for i in np.argsort(C[:, 1], kind="stable")
                    if C[i, 3] >= 0 and C[i, 0] == W[w, 0] and C[i, 1] >= W[w, 2] - 1e-15]
            assert got[w] == (rows[0] if rows else -1)
