"""What per-document sharding costs to describe (issue 9, item 1): the
(document, q chunk, kv chunk) items today's IR enumerates, against the
(q chunk column, kv chunk column) items of a document-uniform description
(docs/DESIGN.md, "Planning at scale"). Nothing here is used by a compile:
this script measures the representation the design proposes, and checks
its arithmetic against the compiled per_doc plan on small cases.

per_doc cuts every document of length L into 2N chunks (``per_doc_chunks``:
the chunk table ``S[doc, column]``). Under a causal mask, chunk column a
sees column c fully when c < a and causally when c == a, in every document:
one relation per column pair, whatever the lengths. So the allowed pairs of
every column pair are ``(S^T S)[a, c]`` (c < a) and ``sum_d S(S+1)/2`` (a == c),
and the cost model's tile rounding (each piece's query rows rounded up to
the kernel's 128-row tile, ``backends.cost.rounded_pairs``) is the same
product with ``S^T`` rounded — ``O(docs · 4N²)`` flops in two matrix products, against the
``O(docs · N²)`` rows enumerated (and tiled, verified, emitted) today.

    .venv/bin/python benchmarks/doc_template.py [--check 3]

``--check K``: for the first K (batch, devices) cases small enough to
compile (per_doc, causal, verifier on), the per (q device, kv device)
pairs of the formula equal those of the compiled plan's compute blocks, and
the enumerated count equals its (piece, tile) rows.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from attnplan.passes.per_doc import per_doc_chunks

ROOT = Path(__file__).resolve().parent.parent
BIG_FROM = ("lmsys-512k-0", "llama3sft-512k-0", "libra-512k-0", "longalign-512k-0", "github-512k-0",
            "commoncrawl-512k-0", "pretrain-512k-0", "lmsys-512k-1")  # benchmarks/scale.py's 4M batch
TILE = 128  # the kernel's query/key tile (the h100 profile's)


def column_pairs(lens, n: int, tile: int = TILE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per (q column a, kv column c) of the per_doc chunk table under a causal
    mask: allowed pairs, and pairs with each document piece's query rows
    rounded up to ``tile`` (``backends.cost.rounded_pairs``); and each
    column's device."""
    s, dev = per_doc_chunks(np.asarray(lens, np.int64), n)
    s = s.astype(np.float64)
    below = np.tril(np.ones((2 * n, 2 * n)), -1)  # c < a: full rectangles
    r = np.ceil(s / tile) * tile  # query rows rounded up
    pairs = (s.T @ s) * below + np.diag((s * (s + 1) / 2).sum(0))
    rounded = (r.T @ s) * below + np.diag((r * (s + 1) / 2).sum(0))
    return pairs, rounded, dev


def enumerated(lens, n: int) -> int:
    """(document, q chunk, kv chunk) items with allowed pairs: per document,
    its non-empty chunks m, m(m+1)/2 (what per_doc's tiling makes)."""
    s, _ = per_doc_chunks(np.asarray(lens, np.int64), n)
    m = (s > 0).sum(1)
    return int((m * (m + 1) // 2).sum())


def device_pairs(pairs: np.ndarray, dev: np.ndarray, n: int) -> np.ndarray:
    """``pairs`` summed per (q device, kv device)."""
    out = np.zeros((n, n))
    np.add.at(out, (np.repeat(dev, len(dev)), np.tile(dev, len(dev))), pairs.ravel())
    return out


def check(lens, n: int) -> None:
    """The formula against the compiled per_doc plan (asserts)."""
    import attnplan
    from attnplan.backends.cost import rounded_pairs
    plan = attnplan.compile(seqlens=list(lens), mask="causal", devices=n, heads=2, kv_heads=2, head_dim=8,
                            block_size=1 << 20, strategy="per_doc")
    g, pl = plan.ir.need_graph(), plan.ir.need_placement()
    assert len(g.pieces) == enumerated(lens, n), (len(g.pieces), enumerated(lens, n))
    at = (pl.cb_device, pl.home[g.cb_k])
    got, got_rounded = np.zeros((n, n)), np.zeros((n, n))
    np.add.at(got, at, g.cb_pairs / g.hg_heads[g.cb_hg])  # cb_pairs counts every head
    np.add.at(got_rounded, at, rounded_pairs(g, TILE)[g.cb_tile] / g.n_hg)
    pairs, rounded, dev = column_pairs(lens, n)
    assert np.array_equal(got, device_pairs(pairs, dev, n)), "per (q device, kv device) pairs differ"
    assert np.allclose(got_rounded, device_pairs(rounded, dev, n), rtol=1e-12), "rounded pairs differ"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches-file", default=str(ROOT.parent / "shared" / "workloads" / "batches.jsonl"))
    ap.add_argument("--check", type=int, default=3)
    ap.add_argument("--json", default="out/doc_template.json")
    args = ap.parse_args()
    suite = {r["name"]: r["seqlens"] for r in map(json.loads, Path(args.batches_file).read_text().splitlines())}
    short = np.random.default_rng(0).integers(1, 65, 100_000).tolist()  # issue 9's 100,000 short documents
    cases = [(b, n) for b in ("libra-512k-0", "github-512k-0", "4m") for n in (32, 64, 128, 256)]
    cases.append(("100k-short", 8))
    rows, checked = [], 0
    for batch, n in cases:
        lens = short if batch == "100k-short" else (sum((suite[b] for b in BIG_FROM), []) if batch == "4m"
                                                   else suite[batch])
        t0 = time.perf_counter()
        pairs, rounded, _ = column_pairs(lens, n)
        sec = time.perf_counter() - t0
        exact = float(sum(x * (x + 1) // 2 for x in lens))
        assert pairs.sum() == exact, (batch, n)  # every document's causal triangle, once
        rows.append(dict(batch=batch, devices=n, docs=len(lens), enumerated=enumerated(lens, n),
                         template=int((pairs > 0).sum()), seconds=sec, rounded_pairs=float(rounded.sum())))
        r = rows[-1]
        print(f"{batch:14s} {n:4d} dev {r['docs']:6,} docs  enumerated {r['enumerated']:>12,}  "
              f"template {r['template']:>8,}  ({r['enumerated'] / r['template']:7.1f}x fewer)  {sec * 1e3:6.1f} ms")
    for batch, n in [("lmsys-128k-0", 4), ("libra-128k-1", 8), ("github-128k-0", 8)][:args.check]:
        check(suite[batch], n)
        checked += 1
    print(f"checked against the compiled per_doc plan: {checked} cases")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(dict(rows=rows, checked=checked), indent=1))


if __name__ == "__main__":
    main()
