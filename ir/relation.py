"""Relation tiles: the tiles of varlen groups without enumerating their pieces (issue 9).

Per-document sharding over N devices cuts every document into 2N chunks and
packs chunk ``c`` of many documents into one varlen group (a token block of
many spans, :mod:`attnplan.ir.groups`). Enumerated, a tile of two groups
holds one mask piece per shared document — Θ(documents · N²) pieces for the
plan, 225M rows for 2,597 documents on 256 devices.

When every document's mask is its causal triangle or its full square (one
mask piece per document, nothing across documents, one mask class), a tile
``(q group, kv group)`` is exactly "the mask inside those rows": for every
document with rows in both, the q rows times the kv rows, full when the
document's kv rows come first, its causal triangle when they are the same
rows. That needs no pieces, only the *entry table* — the rows each document
has in each block (a block meets a document in at most one interval) — and
an order of the blocks in which every document's entries increase (the
longest-path levels of the graph "entry i of a document, then entry i + 1").
With the table as a dense matrix ``S[document, block]`` of row counts:

* tiles: the block pairs sharing a document, kv level below q level (or the
  same block); every pair of a full document;
* allowed pairs of tile ``(a, b)``: ``(S^T S)[a, b]`` off the diagonal and
  ``Σ S(S+1)/2`` on it (causal), ``(S^T S)[a, b]`` everywhere (full);
* pairs with each piece's query rows rounded up to the kernel's ``tile_q``
  (backends/cost.py): the same products with ``R = ceil(S / tile_q) · tile_q``
  on the query side, ``Σ R (S+1)/2`` on the causal diagonal.

Everything is an integer below 2**53 in float64, so the sums are exact and
the same on every machine. A tile's pieces are made when something needs
them (:func:`tile_pieces`: the runtime, a device's own tiles only). The
verifier rebuilds the table from the blocks and compares
(:func:`attnplan.ir.verify`), and checks the tiles' pairs add up to the mask's.

Pure functions over arrays: :mod:`attnplan.ir.groups` builds the graph."""

from __future__ import annotations

import numpy as np

from .mask import HI, K0, K1, LO, Q0, Q1, tighten

CAUSAL, FULL = 0, 1
MAX_TABLE = 1 << 24  # documents x blocks of the dense table (128 MB of float64); larger graphs enumerate pieces
MAX_BLOCKS = 2048    # blocks of a relation graph (its block x block products: 32 MB each)
MAX_PRODUCT = 1 << 31  # documents x blocks² of one table product (~1 s here); per_doc on 4M tokens at 256
#                        devices: 2,597 x 512² = 0.68G, dacp 2,597 x 768² = 1.5G


def doc_kinds(problem) -> tuple[np.ndarray, np.ndarray] | None:
    """(kind, mask piece) of every document — CAUSAL or FULL, and the index
    of its one mask piece (-1 and kind -1: the document has no pairs) — when
    every mask piece is one document's causal triangle or full square, no
    two pieces share a document, and the problem has one mask class and no
    cross-attention; else None."""
    if problem.class_ptr is not None or problem.q_lens is not None:
        return None
    P, off = problem.pieces.a, problem.offsets
    docs = len(off) - 1
    d = np.searchsorted(off, P[:, Q0], "right") - 1
    if len(P) and ((d < 0) | (d >= docs)).any():
        return None
    s, e = off[d], off[d + 1]
    square = (P[:, Q0] == s) & (P[:, Q1] == e) & (P[:, K0] == s) & (P[:, K1] == e) & (P[:, LO] == s - (e - 1))
    causal, full = P[:, HI] == 0, P[:, HI] == e - s - 1
    if not (square & (causal | full)).all() or len(np.unique(d)) != len(d):
        return None
    kind = np.full(docs, -1, np.int64)
    src = np.full(docs, -1, np.int64)
    kind[d] = np.where(causal, CAUSAL, FULL)
    src[d] = np.arange(len(P))
    return kind, src


def entries(offsets: np.ndarray, ss: np.ndarray, se: np.ndarray, owner: np.ndarray):
    """(document, block, start, end) of every non-empty intersection of a span
    with a document, sorted by position."""
    order = np.argsort(ss, kind="stable")
    ss, se, owner = ss[order], se[order], owner[order]
    first = np.searchsorted(offsets, ss, "right") - 1
    last = np.searchsorted(offsets, se - 1, "right") - 1
    n = last - first + 1
    row = np.repeat(np.arange(len(ss)), n)
    doc = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n) + first[row]
    return doc, owner[row], np.maximum(ss[row], offsets[doc]), np.minimum(se[row], offsets[doc + 1])


def levels(doc: np.ndarray, block: np.ndarray, n_blocks: int) -> np.ndarray | None:
    """Longest-path level of every block in the graph whose edges join each
    document's consecutive entries (``doc``/``block`` sorted by position):
    every document's entries then have increasing levels. None when a
    document meets a block twice or the edges make a cycle."""
    same = doc[1:] == doc[:-1]
    src, dst = block[:-1][same], block[1:][same]
    if (src == dst).any():
        return None
    edges = np.unique(src * n_blocks + dst)  # sorted by source: a CSR index of the out-edges
    src, dst = edges // n_blocks, edges % n_blocks
    ptr = np.searchsorted(src, np.arange(n_blocks + 1))
    indeg = np.bincount(dst, minlength=n_blocks)
    lev = np.zeros(n_blocks, np.int64)
    frontier, level, done = np.flatnonzero(indeg == 0), 0, 0
    while len(frontier):  # Kahn's algorithm, a level at a time: a block's level is when its last edge goes
        lev[frontier] = level
        done += len(frontier)
        n = ptr[frontier + 1] - ptr[frontier]
        out = dst[np.repeat(ptr[frontier], n) + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)]
        indeg -= np.bincount(out, minlength=n_blocks)
        hit = np.unique(out)
        frontier, level = hit[indeg[hit] == 0], level + 1
    return lev if done == n_blocks else None


class Table:
    """The entry table of a grouped graph under a per-document mask (see the module doc)."""

    def __init__(self, kind: np.ndarray, src: np.ndarray, doc, block, start, end, lev: np.ndarray):
        self.kind, self.src, self.lev = kind, src, lev
        keep = kind[doc] >= 0
        self.doc, self.block, self.start, self.end = doc[keep], block[keep], start[keep], end[keep]
        self.by_block = np.lexsort((self.doc, self.block))  # entries block by block (documents in order) ...
        self.block_ptr = np.searchsorted(self.block[self.by_block], np.arange(len(lev) + 1))  # ... and its CSR index
        used, self.row = np.unique(self.doc, return_inverse=True)
        self.causal = kind[used] == CAUSAL
        self.S = np.zeros((len(used), len(lev)))
        self.S[self.row, self.block] = self.end - self.start
        self._cache: dict = {}

    def _side(self, causal: bool, tile_q: int | None) -> tuple[np.ndarray, np.ndarray]:
        S = self.S[self.causal == causal]
        return (S if tile_q is None else np.ceil(S / tile_q) * tile_q), S

    def tiles(self) -> tuple[np.ndarray, np.ndarray]:
        """(q block, kv block) of every tile, by q block then kv block: the pairs with a shared
        document (``S^T S > 0``, as ``S >= 0``), kv level below q level or the same block when causal."""
        (causal, full), _ = self._products(None)
        hit = (causal > 0) & (self.lev[None, :] < self.lev[:, None])
        np.fill_diagonal(hit, np.diagonal(causal) > 0)
        q, k = np.nonzero(hit | (full > 0))
        return q.astype(np.int64), k.astype(np.int64)

    def sums(self, tq: np.ndarray, tk: np.ndarray, tile_q: int | None = None) -> np.ndarray:
        """Allowed pairs of every tile ``(tq, tk)`` — with each piece's query
        rows rounded up to ``tile_q`` when given (exact integers)."""
        full, tri = self._products(tile_q)
        causal = np.where(tq == tk, tri[tq], np.where(self.lev[tk] < self.lev[tq], full[0][tq, tk], 0.0))
        return causal + full[1][tq, tk]

    def _products(self, tile_q: int | None) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
        """((R^T S of the causal documents, of the full ones), the causal diagonal sums), made once per
        ``tile_q`` (the cost model asks for its kernel tile on every simulation)."""
        if tile_q not in self._cache:
            (R, S), (Rf, Sf) = self._side(True, tile_q), self._side(False, tile_q)
            self._cache[tile_q] = (R.T @ S, Rf.T @ Sf), (R * (S + 1) / 2).sum(0)  # a causal triangle: S(S+1)/2
        return self._cache[tile_q]


def table(problem, ss: np.ndarray, se: np.ndarray, owner: np.ndarray, n_blocks: int) -> Table | None:
    """The entry table of the blocks whose spans are ``(ss, se, owner)``, or
    None when the mask is not per-document causal/full, a document meets a
    block in two intervals, the blocks have no consistent order, or the dense
    table would be over MAX_TABLE entries or its products over MAX_PRODUCT
    multiply-adds (the pieces are then enumerated, under MAX_TILE_PIECES)."""
    dk = doc_kinds(problem)
    if dk is None or not len(ss) or n_blocks > MAX_BLOCKS:
        return None
    doc, block, start, end = entries(problem.offsets, ss, se, owner)
    docs = len(np.unique(doc))
    if docs * n_blocks > MAX_TABLE or docs * n_blocks * n_blocks > MAX_PRODUCT:
        return None
    lev = levels(doc, block, n_blocks)
    return None if lev is None else Table(dk[0], dk[1], doc, block, start, end, lev)


def tile_pieces(problem, t: Table, qb: int, kb: int) -> tuple[np.ndarray, np.ndarray]:
    """(pieces, mask piece of each) of tile ``(qb, kb)``: every shared
    document's mask piece clipped to its rows in the two blocks, tightened,
    ordered by mask piece."""
    iq, ik = (t.by_block[t.block_ptr[b]:t.block_ptr[b + 1]] for b in (qb, kb))
    dq, dk = t.doc[iq], t.doc[ik]
    common, a, b = np.intersect1d(dq, dk, assume_unique=True, return_indices=True)
    src = t.src[common]
    rows = problem.pieces.a[src].copy()
    rows[:, Q0] = t.start[iq[a]]
    rows[:, Q1] = t.end[iq[a]]
    rows[:, K0] = t.start[ik[b]]
    rows[:, K1] = t.end[ik[b]]
    keep = tighten(rows)
    order = np.argsort(src[keep], kind="stable")
    return np.ascontiguousarray(rows[keep][order]), src[keep][order]
