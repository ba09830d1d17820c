"""Properties of the per_doc, minheap and tile_pool placement strategies
(issue 3): per-document chunking, MagiAttention's min-heap dispatch, Libra's
tile pool. Correctness of execution is covered by test_execute (every
registered strategy is drawn there); these tests check what makes each
strategy what it is."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnplan
from attnplan.backends.cost import rounded_pairs
from attnplan.frontend import load_mask, lower_batch
from attnplan.ir.module import PlanIR
from attnplan.ir.problem import Problem
from attnplan.ir.program import B_KV, B_O, B_Q, FWD, buffer_bytes
from attnplan.ir.verify import needed_transfers
from attnplan.passes import parse_pipeline, run_pipeline
from attnplan.passes.minheap import MinHeap, chunk_bounds, interval_pairs, minheap_assign, split_by_work, token_cap
from attnplan.passes.per_doc import per_doc_chunks
from attnplan.passes.tile_pool import pool_assign

LONG_TAIL = [65536, 16384, 8192, 8192] + [2048] * 8 + [1024] * 16  # the plan-time batch of issue 3


def problem(seqlens, mask="causal", heads=8, kv_heads=2, head_dim=128):
    lens = np.asarray(seqlens, np.int64)
    return Problem(seqlens=lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   pieces=lower_batch(load_mask(mask), lens.tolist(), None))


def place(seqlens, spec, devices, nodes=1, block=2048, mask="causal", heads=8, kv_heads=2):
    """Tile and place (verified), without comm and emit."""
    p = problem(seqlens, mask, heads, kv_heads)
    return run_pipeline(PlanIR(p, devices, nodes), parse_pipeline(f"tile{{block={block}}},{spec}"))


def per_device(ir, values_per_cb):
    return np.bincount(ir.placement.cb_device, weights=values_per_cb, minlength=ir.devices)


def tokens_per_device(ir):
    return np.bincount(ir.placement.home, weights=ir.graph.tb_len, minlength=ir.devices).astype(np.int64)


def fwd_bytes(ir) -> int:
    """Forward bytes the placement's transfers move (what the comm pass derives)."""
    g = ir.graph
    need = needed_transfers(g, ir.placement)
    return int(sum(buffer_bytes(g, FWD, kind, need[x][:, 0], need[x][:, 1]).sum()
                   for x, kind in ((0, B_Q), (1, B_KV), (2, B_O))))


lens_lists = st.lists(st.integers(1, 300), min_size=1, max_size=8)


# per_doc --------------------------------------------------------------------------------------------

def reference_per_doc(lens, n):
    """Per-document zigzag written the slow, obvious way: 2N chunks of L // 2N, the
    remainder one token at a time round-robin over the slots (device 0 front, ...,
    device N-1 front, device 0 back, ...), the cursor carried across documents."""
    m, cursor, out = 2 * n, 0, []
    for L in lens:
        sizes = [L // m] * m
        for e in range(L % m):
            slot = (cursor + e) % m
            sizes[slot if slot < n else m - 1 - (slot - n)] += 1
        cursor = (cursor + L % m) % m
        out.append(sizes)
    return np.array(out)


@given(lens_lists, st.integers(1, 12))
def test_per_doc_chunks_round_robin_no_padding(lens, n):
    sizes, dev = per_doc_chunks(np.array(lens), n)
    assert np.array_equal(sizes, reference_per_doc(lens, n))
    assert np.array_equal(sizes.sum(1), lens)                      # nothing padded, nothing lost
    assert (sizes.max(1) - sizes.min(1) <= 1).all()                # chunks of a document differ by <= 1 token
    assert np.array_equal(dev, [c if c < n else 2 * n - 1 - c for c in range(2 * n)])
    per = np.bincount(np.broadcast_to(dev, sizes.shape).ravel(), weights=sizes.ravel(), minlength=n)
    assert per.max() - per.min() <= 1                              # the round-robin bound


@settings(max_examples=40)
@given(lens_lists, st.integers(1, 8), st.sampled_from([1, 5, 16, 2048]))
def test_per_doc_device_i_holds_chunks_i_and_mirror(lens, n, block):
    ir = place(lens, "per_doc", n, block=block, heads=2, kv_heads=1)
    g, pl = ir.graph, ir.placement
    sizes, _ = per_doc_chunks(np.array(lens), n)
    # expected device of every token: chunk c of its document -> c or 2N-1-c
    want = np.concatenate([np.repeat([c if c < n else 2 * n - 1 - c for c in range(2 * n)], row) for row in sizes])
    got = np.empty(len(want), np.int64)
    got[g.block_rows(np.arange(g.n_tb))] = np.repeat(pl.home, g.tb_len)  # varlen groups: rows by span
    assert np.array_equal(got, want)
    assert np.array_equal(pl.cb_device, pl.home[g.cb_q])           # compute where Q lives
    t = tokens_per_device(ir)
    assert t.sum() == sum(lens) and t.max() - t.min() <= 1


@pytest.mark.parametrize("n", [2, 4, 8])
def test_per_doc_balances_pairs_exactly_when_chunks_are_equal(n):
    lens = [2 * n * x for x in (3, 50, 7, 400)]
    ir = place(lens, "per_doc", n, block=64)
    pairs = per_device(ir, ir.graph.cb_pairs)
    assert pairs.max() == pairs.min()
    # whole-sequence zigzag on the same batch is not balanced
    zz = place(lens, "zigzag", n, block=64)
    zz_pairs = per_device(zz, zz.graph.cb_pairs)
    assert zz_pairs.max() > zz_pairs.min()


def test_per_doc_short_documents_waste_kernel_tiles():
    short = place([96] * 8, "per_doc", 8)     # 6-token chunks: every one rounds up to a 128-row tile
    long = place([65536], "per_doc", 8)        # 4096-token chunks, 2048-token blocks: no rounding
    ratio = [float((rounded_pairs(ir.graph, 128)[ir.graph.cb_tile] * ir.graph.hg_heads[ir.graph.cb_hg]).sum()
                   / ir.graph.cb_pairs.sum()) for ir in (short, long)]
    assert ratio[0] > 10 and ratio[1] == 1.0


# minheap --------------------------------------------------------------------------------------------

@settings(max_examples=40)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=12), st.integers(1, 16), st.sampled_from([0, 64, 1000]))
def test_minheap_equal_chunk_counts_and_q_stays(lens, n, chunk):
    ir = place(lens, f"minheap{{chunk={chunk}}}", n, block=512, heads=2, kv_heads=1)
    k, bounds, dev = MinHeap(chunk=chunk).chunks_per_device(ir)
    T = sum(lens)
    equal = len(bounds) == k * n + 1
    if chunk:
        assert equal and np.diff(bounds).max() <= chunk
    if equal:                                                       # stage 1: k equal chunks a device
        assert np.array_equal(bounds, chunk_bounds(T, k * n))
        assert np.array_equal(np.bincount(dev, minlength=n), np.full(n, k))
    else:                                                           # stage 2 only ever adds cuts
        assert np.isin(chunk_bounds(T, k * n), bounds).all() and (np.diff(bounds) > 0).all()
    g, pl = ir.graph, ir.placement
    # each token block lies in one chunk and lives on that chunk's device; Q stays where it lives
    c = np.searchsorted(bounds, g.tb_start, "right") - 1
    assert (g.tb_end <= bounds[c + 1]).all() and np.array_equal(pl.home, dev[c])
    assert np.array_equal(pl.cb_device, pl.home[g.cb_q])
    # chunk areas in closed form equal the block graph's exact pairs
    areas = interval_pairs(ir.problem.pieces.a, bounds)
    by_chunk = np.bincount(c[g.cb_q], weights=g.cb_pairs, minlength=len(areas))
    assert np.array_equal(areas * ir.problem.heads, by_chunk)
    t = tokens_per_device(ir)
    if equal:
        assert t.max() - t.min() <= k                               # k chunks each, sizes within one token


def row_pairs(pieces, T):
    """Allowed pairs of every query row, one closed-form count a row (small T only)."""
    return interval_pairs(pieces, np.arange(T + 1))


@settings(max_examples=60)
@given(st.lists(st.integers(1, 400), min_size=1, max_size=6), st.integers(1, 12),
       st.sampled_from(["causal", "full", "causal_blockwise(16, 2)", "prefix_lm(40)", "streaming(4, 16)"]),
       st.floats(0.001, 2.0))
def test_split_by_work_cuts_heavy_chunks_into_equal_work(lens, parts, mask, share):
    P = problem(lens, mask).pieces.a
    T = sum(lens)
    bounds = chunk_bounds(T, parts)
    areas = interval_pairs(P, bounds)
    cap = share * max(1, areas.max())
    cut = split_by_work(P, bounds, areas, cap)
    assert np.isin(bounds, cut).all() and (np.diff(cut) > 0).all() and cut[0] == 0 and cut[-1] == T
    rows = row_pairs(P, T)
    owner = np.searchsorted(bounds, cut[:-1], "right") - 1         # the stage-1 chunk each piece came from
    work = interval_pairs(P, cut)
    m = np.minimum(np.ceil(areas / cap), np.diff(bounds)).astype(np.int64)
    for i in range(parts):
        mine = np.flatnonzero(owner == i)
        assert len(mine) <= max(1, m[i])                            # the fewest pieces: at most ceil(area / cap)
        if m[i] > 1:                                                # each at most its share plus one row
            heaviest_row = rows[bounds[i]:bounds[i + 1]].max()
            assert work[mine].max() <= areas[i] / m[i] + heaviest_row


@given(st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(0, 50)), min_size=1, max_size=64), st.integers(1, 8),
       st.sampled_from([0.0, 0.25, math.inf]))
def test_minheap_token_capped_greedy_order(items, n, slack):
    areas = np.array([a for a, _ in items], np.int64)
    sizes = np.array([z for _, z in items], np.int64)
    cap = token_cap(int(sizes.sum()), n, slack)
    dev = minheap_assign(areas, n, cap, sizes)
    # replay: largest area first (ties: lower index), each onto the least-loaded device holding fewer than
    # cap tokens (only items of size 0 can be left when every device is full: they go to device 0)
    load, held = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for i in sorted(range(len(areas)), key=lambda i: (-areas[i], i)):
        room = np.flatnonzero(held < cap)
        best = room[np.argmin(load[room])] if len(room) else 0
        assert dev[i] == best
        load[best] += areas[i]
        held[best] += sizes[i]
    assert held.max() < cap + max(1, sizes.max())                   # over the cap by less than one item
    if math.isinf(slack):                                           # Graham: LPT is within one item of the mean
        assert load.max() <= areas.sum() / n + areas.max()


@given(st.lists(st.integers(0, 10 ** 6), min_size=1, max_size=64), st.integers(1, 8))
def test_minheap_greedy_order(areas, n):
    areas = np.array(areas, np.int64)
    k = -(-len(areas) // n)
    dev = minheap_assign(areas, n, k)
    # replay: largest area first (ties: lower index), each onto the least-loaded device with room
    load, count = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for i in sorted(range(len(areas)), key=lambda i: (-areas[i], i)):
        room = np.flatnonzero(count < k)
        best = room[np.argmin(load[room])]
        assert dev[i] == best, f"item {i} went to {dev[i]}, the least-loaded device with room is {best}"
        load[best] += areas[i]
        count[best] += 1


@pytest.mark.parametrize("n,nodes", [(8, 1), (32, 4)])
def test_minheap_balances_long_tailed_batch(n, nodes):
    plan = attnplan.compile(seqlens=LONG_TAIL, mask="causal", devices=n, nodes=nodes, heads=8, kv_heads=2,
                            head_dim=128, block_size=2048, strategy="minheap")
    s = plan.stats()
    assert s["compute_imbalance"] <= 1.05 and s["token_imbalance"] <= 1.001
    zz = attnplan.compile(seqlens=LONG_TAIL, mask="causal", devices=n, nodes=nodes, heads=8, kv_heads=2,
                          head_dim=128, block_size=2048, strategy="zigzag").stats()
    assert zz["compute_imbalance"] > 1.5


def test_minheap_auto_picks_the_coarsest_balanced_chunking():
    ir = place(LONG_TAIL, "minheap", 32, nodes=4)
    k, bounds, dev = MinHeap().chunks_per_device(ir)
    T, P = ir.problem.tokens, ir.problem.pieces.a

    def imb(k):
        b = chunk_bounds(T, k * 32)
        a = interval_pairs(P, b)
        load = np.bincount(minheap_assign(a, 32, k), weights=a, minlength=32)
        return load.max() / load.mean()

    assert imb(k) <= 1.05 and k > 1 and imb(k // 2) > 1.05


BUILTIN_FAMILIES = ["causal", "full", "sliding_window(4096)", "streaming(64, 4096)", "shared_question(4, 0.2)",
                    "causal_blockwise(256, 2)", "block_causal(1024)", "prefix_lm(1024)", "chunked_causal(8192)",
                    "dilated_sliding_window(64, 16)", "natten2d(128, 128, 13, 13)",
                    "sliding_tile2d(128, 128, 8, 8, 3, 3)"]


def long_tail_batch(seed, tokens=131072):
    """A seeded long-tailed batch (log-normal lengths, median ~1100, up to 40K) of exactly ``tokens``."""
    lens = np.clip(np.random.default_rng(seed).lognormal(7.0, 1.3, 4096), 16, 40000).astype(np.int64)
    lens = lens[:np.searchsorted(np.cumsum(lens), tokens) + 1]
    lens[-1] -= lens.sum() - tokens
    return lens.tolist()


@pytest.mark.parametrize("mask", BUILTIN_FAMILIES)
def test_minheap_balances_every_builtin_mask_family(mask):
    """Issue 9: compute imbalance <= 1.05 on every builtin family, on realistic long-tailed batches at
    8 devices and 4 x 8 (causal_blockwise's heavy last blocks were 2.40 with equal 128-row chunks).
    Not yet global_tokens(64): compute 1.046, but tokens 1.5 > 1.25 (its first rows see whole samples)."""
    from attnplan.frontend.stdlib import BUILTINS
    assert {m.split("(")[0] for m in BUILTIN_FAMILIES} >= set(BUILTINS) - {"true", "false", "same_segment",
                                                                          "earlier_segment", "document",
                                                                          "global_tokens"}  # issue 12: see below
    for lens in (LONG_TAIL, [39525, 57537, 34010], long_tail_batch(9)):
        for n, nodes in ((8, 1), (32, 4)):
            ir = place(lens, "minheap", n, nodes=nodes, mask=mask)
            g = ir.graph
            flops = per_device(ir, g.cb_pairs)
            assert flops.max() / flops.mean() <= 1.05, (mask, len(lens), n)
            assert np.array_equal(ir.placement.cb_device, ir.placement.home[g.cb_q])   # Q stays
            t = tokens_per_device(ir)
            assert t.max() / t.mean() <= 1.25 + 1e-9                # token slack stage 2 may give up


def test_minheap_cuts_heavy_rows_only_when_equal_chunks_fail():
    """causal_blockwise(256, 2) on the plan-time batch at 4 x 8: a sample's last 256 rows see all of it, so
    equal chunks cannot balance (stage 1 ends at 2.40); stage 2 cuts those rows by work, and the pieces are
    as coarse as reach the target (fewer compute blocks than stage 1's finest split)."""
    ir = place(LONG_TAIL, "minheap", 32, nodes=4, mask="causal_blockwise(256, 2)")
    k, bounds, dev = MinHeap().chunks_per_device(ir)
    P, T = ir.problem.pieces.a, sum(LONG_TAIL)
    assert len(bounds) != k * 32 + 1 and np.isin(chunk_bounds(T, k * 32), bounds).all()
    finest = chunk_bounds(T, 32 * 32)                                # stage 1's last try: 128-token chunks
    a = interval_pairs(P, finest)
    load = np.bincount(minheap_assign(a, 32, 32), weights=a, minlength=32)
    assert load.max() / load.mean() > 2.3
    areas = interval_pairs(P, bounds)
    load = np.bincount(dev, weights=areas, minlength=32)
    assert load.max() / load.mean() <= 1.05
    eq = place(LONG_TAIL, "minheap{chunk=128}", 32, nodes=4, mask="causal_blockwise(256, 2)")
    assert ir.graph.n_cb < eq.graph.n_cb
    # on causal, stage 1 already balances: equal chunks, equal tokens
    c = place(LONG_TAIL, "minheap", 32, nodes=4)
    k, bounds, _ = MinHeap().chunks_per_device(c)
    assert len(bounds) == k * 32 + 1 and tokens_per_device(c).max() - tokens_per_device(c).min() <= k


# tile_pool ------------------------------------------------------------------------------------------

@settings(max_examples=30)
@given(st.lists(st.integers(1, 4000), min_size=1, max_size=10), st.integers(1, 12), st.sampled_from([0.02, 0.05, 0.2]))
def test_tile_pool_under_soft_cap_when_blocks_are_small(lens, n, eps):
    ir = place(lens, f"tile_pool{{eps={eps},block=128}}", n, block=128, heads=4, kv_heads=2)
    g = ir.graph
    load = per_device(ir, g.cb_pairs)
    mean = load.sum() / n
    if g.cb_pairs.max(initial=0) <= eps * mean:                   # then no block can find every device full
        assert load.max() <= (1 + eps) * mean
    assert g.n_hg == 2                                              # one head group per kv head
    t = tokens_per_device(ir)
    assert t.max() - t.min() <= 1                                   # equal contiguous homes
    assert (np.diff(ir.placement.home) >= 0).all()


@pytest.mark.parametrize("n,nodes", [(8, 1), (32, 4)])
def test_tile_pool_balances_long_tailed_batch(n, nodes):
    ir = place(LONG_TAIL, "tile_pool", n, nodes=nodes)
    load = per_device(ir, ir.graph.cb_pairs)
    assert load.max() / load.mean() <= 1.04 + 1e-12
    no_loc = place(LONG_TAIL, "tile_pool{locality=false}", n, nodes=nodes)
    nl = per_device(no_loc, no_loc.graph.cb_pairs)
    assert nl.max() / nl.mean() <= 1.04 + 1e-12
    # preferring devices that hold the data pays: far fewer bytes at the same cap
    assert fwd_bytes(ir) < 0.5 * fwd_bytes(no_loc)


def test_tile_pool_keeps_balanced_work_at_home():
    # one 4096-token document per device: work already balanced, every tile local
    ir = place([4096] * 4, "tile_pool", 4, block=1024)
    assert fwd_bytes(ir) == 0
    assert np.array_equal(ir.placement.cb_device, ir.placement.home[ir.graph.cb_q])
    # without the locality preference the same cap still holds but data moves
    assert fwd_bytes(place([4096] * 4, "tile_pool{locality=false}", 4, block=1024)) > 0


@pytest.mark.parametrize("lens,n", [([6144] + [2048] * 3 + [64] * 96, 3),
                                    ([12288] + [4096] * 3 + [2048] * 6 + [256] * 48 + [64] * 192, 4)])
def test_tile_pool_light_devices_keep_their_own_blocks(lens, n):
    # device 0 holds one long document and must shed most of its work; the others hold
    # shorter documents whose blocks are local (Q and KV at home). The reservation keeps
    # room for those, so spilled work lands beside them instead of pushing them away.
    ir = place(lens, "tile_pool{block=256}", n)
    g, pl = ir.graph, ir.placement
    own = np.where(pl.home[g.cb_q] == pl.home[g.cb_k], pl.home[g.cb_q], -1)
    load = per_device(ir, g.cb_pairs)
    assert load.max() <= 1.04 * load.mean()
    for d in range(1, n):
        assert (pl.cb_device[own == d] == d).all()
    assert (pl.cb_device[own == 0] != 0).any()


def test_tile_pool_spills_to_the_device_holding_kv():
    """Three devices, b = 256-token blocks, causal, documents Z (3b), X (2b), Y (4b), W (2b);
    homes: Z and X's first block on device 0, X's second block and Y on device 1, W on
    device 2. In units of b²/2 pairs: Z 9, Y 16, W 4, X's row 1: (x1, x0) 2 + (x1, x1) 1,
    mean 11, cap (eps 0.5) 16.5. Rows go heaviest first: Y, Z, W stay home (loads 9, 16, 4).
    (x1, x0) cannot stay on device 1 (16 + 2 > 16.5); devices 0 and 2 have room. Device 0
    owns x0's KV, device 2 holds nothing of it: the locality preference picks device 0
    although device 2 is less loaded; then (x1, x1) follows x1's Q to device 0.
    Without the preference the least-loaded device 2 gets it."""
    from attnplan.ir.graph import build_graph
    b = 256
    p = problem([3 * b, 2 * b, 4 * b, 2 * b], heads=1, kv_heads=1)
    g = build_graph(p, np.cumsum([0, 3 * b, b, b, 4 * b, 2 * b]), 1)
    home = np.array([0, 0, 1, 1, 2])
    key = {(int(g.tile_q[t]), int(g.tile_k[t])): t for t in range(g.n_tile)}
    dev = pool_assign(g, home, 3, 1, eps=0.5)
    assert dev[key[(2, 1)]] == 0 and dev[key[(2, 2)]] == 0
    assert dev[key[(1, 1)]] == 0 and dev[key[(3, 3)]] == 1 and dev[key[(4, 4)]] == 2
    blind = pool_assign(g, home, 3, 1, eps=0.5, locality=False)
    assert blind[key[(2, 1)]] == 2


def reference_pool_assign(g, home, n, nodes, eps, inter_cost=8.0, locality=True):
    """The TAP greedy written plainly over whole arrays (what pool_assign was
    before it looked only at the devices that can differ): every block
    scans every device for (fewest added bytes among those with room, least
    load, lowest id)."""
    hg, cost = g.n_hg, g.cb_pairs
    cap = (1.0 + eps) * float(cost.sum()) / n
    node = np.arange(n) // (n // nodes)
    weight = np.where(node[:, None] == node[None, :], 1.0, float(inter_cost))
    keys = np.arange(g.n_tb * hg)
    ktb, khg = keys // hg, keys % hg
    qbytes = (buffer_bytes(g, FWD, B_Q, ktb, khg) + buffer_bytes(g, FWD, B_O, ktb, khg)).astype(float)
    kvbytes = buffer_bytes(g, FWD, B_KV, ktb, khg).astype(float) * locality
    qbytes *= locality
    has_q = np.zeros((len(keys), n), bool)
    has_kv = np.zeros((len(keys), n), bool)
    has_q[keys, home[ktb]] = has_kv[keys, home[ktb]] = True
    qkey, kkey = g.cb_q * hg + g.cb_hg, g.cb_k * hg + g.cb_hg
    local = np.where(home[g.cb_q] == home[g.cb_k], home[g.cb_q], -1)
    reserved = np.bincount(local[local >= 0], weights=cost[local >= 0], minlength=n).astype(float)
    row_cost = np.bincount(qkey, weights=cost, minlength=len(keys))
    load, out = np.zeros(n), np.empty(g.n_cb, np.int64)
    for c in np.lexsort((-cost, qkey, -row_cost[qkey])).tolist():
        w, qk, kk, own = float(cost[c]), int(qkey[c]), int(kkey[c]), int(local[c])
        added = np.where(has_q[qk], 0.0, qbytes[qk] * weight[home[ktb[qk]]]) + \
            np.where(has_kv[kk], 0.0, kvbytes[kk] * weight[home[ktb[kk]]])
        if own >= 0:
            reserved[own] -= w
            alone = (qbytes[qk] > 0 and has_q[qk].sum() == 1) or (kvbytes[kk] > 0 and has_kv[kk].sum() == 1)
            if alone and load[own] + w <= cap:
                out[c] = own
                load[own] += w
                continue
        room = load + reserved + w <= cap
        if own >= 0:
            room[own] = load[own] + w <= cap
        if not room.any():
            room = load + w <= cap
        key = np.where(room, added, np.inf) if room.any() else load
        d = int(np.argmin(np.where(key == key.min(), load, np.inf)))
        out[c], load[d] = d, load[d] + w
        has_q[qk, d] = has_kv[kk, d] = True
    return out


@settings(max_examples=40)
@given(lens=st.lists(st.integers(1, 3000), min_size=1, max_size=12), devices=st.sampled_from([2, 4, 8, 16, 32]),
       block=st.sampled_from([128, 256, 512]), eps=st.sampled_from([0.0, 0.04, 0.3]),
       inter_cost=st.sampled_from([0.0, 0.5, 1.0, 8.0]), locality=st.booleans(), mask=st.sampled_from(
           ["causal", "full", "sliding_window(200)", "causal_blockwise(512, 2)"]), zigzag=st.booleans())
def test_tile_pool_greedy_is_the_plain_greedy(lens, devices, block, eps, inter_cost, locality, mask, zigzag):
    """pool_assign, which scans only the devices whose added bytes can differ
    (holders, the two homes' nodes) and the rest only when they could win,
    places every block where the plain scan over all devices does."""
    from attnplan.ir.graph import build_graph
    from attnplan.passes.tile_pool import split_segments
    p = problem(lens, mask, heads=4, kv_heads=2)
    nodes = devices // 4 if devices >= 8 else 1
    starts, devs = split_segments(p.tokens, devices, zigzag)
    cuts = np.unique(np.concatenate([starts, np.arange(0, p.tokens, block), np.cumsum([0] + lens[:-1])]))
    g = build_graph(p, cuts, 2)
    home = devs[np.searchsorted(starts, g.tb_start, side="right") - 1]
    got = pool_assign(g, home, devices, nodes, eps, inter_cost, locality)
    assert np.array_equal(got, reference_pool_assign(g, home, devices, nodes, eps, inter_cost, locality))


# all three ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["per_doc", "minheap", "tile_pool"])
def test_deterministic(strategy):
    kw = dict(seqlens=[3000, 700, 120, 45, 1], mask="sliding_window(300) | (k < 8 & k <= q)", devices=6, nodes=2,
              heads=4, kv_heads=2, head_dim=16, block_size=256, strategy=strategy)
    assert attnplan.compile(**kw).canonical_bytes() == attnplan.compile(**kw).canonical_bytes()


@pytest.mark.parametrize("strategy", ["per_doc", "minheap", "tile_pool"])
def test_more_devices_than_tokens(strategy):
    plan = attnplan.compile(seqlens=[3, 1], mask="full", devices=8, heads=2, kv_heads=1, head_dim=8, block_size=1,
                            strategy=strategy)
    s = plan.stats()
    assert sum(s["per_device"]["tokens"]) == 4 and s["pairs"] == (9 + 1) * 2
