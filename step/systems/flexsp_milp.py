"""FlexSP's MILP formulations over bucketed sequences and the local search
that polishes an assignment (the solver half of :mod:`.flexsp`, whose
docstring states the model and every choice made)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .common import greedy_fill

POLISH_ROUNDS = 200     # moves of the local search that polishes every candidate assignment


@dataclass(frozen=True, slots=True)
class Solved:
    groups: list                 # [(size, [docs])]
    makespan: float              # exact cost of the slowest group (seconds)
    how: str                     # "milp" or "homogeneous d=N"
    stop: str                    # optimal | time_limit | heuristic
    gap: float                   # HiGHS's relative gap (nan without a MILP answer)


def homogeneous(docs: np.ndarray, lens: np.ndarray, t: np.ndarray, d: int, groups: int, cap: int) -> Solved | None:
    """Every group of ``d`` devices: documents longest first into the group of least time whose tokens
    still fit (:func:`common.greedy_fill`); None if one fits nowhere."""
    if groups < 1:
        return None
    order = np.argsort(-lens[docs], kind="stable")
    where = greedy_fill(order, lens[docs], t[docs], groups, cap * d)
    if (where < 0).any():
        return None
    members = [docs[where == g].tolist() for g in range(groups)]
    load = np.bincount(where, weights=t[docs], minlength=groups)
    return Solved([(d, m) for m in members if m], float(load.max()), f"homogeneous d={d}", "heuristic",
                   float("nan"))


# ---------------------------------------------------------------------------------------- MILP building

class _LP:
    """A MILP ``min c·x`` under bounds and rows ``lo ≤ A·x ≤ hi``, built a row at a time."""

    def __init__(self, nv: int):
        self.c = np.zeros(nv)
        self.lb = np.zeros(nv)
        self.ub = np.zeros(nv)
        self.integrality = np.ones(nv)
        self.rows: list[np.ndarray] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def row(self, lo: float, hi: float) -> np.ndarray:
        r = np.zeros(len(self.c))
        self.rows.append(r)
        self.lo.append(lo)
        self.hi.append(hi)
        return r

    def bounds(self):
        from scipy.optimize import Bounds
        return Bounds(self.lb, self.ub)

    def constraints(self):
        from scipy.optimize import LinearConstraint
        return LinearConstraint(np.array(self.rows), np.array(self.lo), np.array(self.hi))


class Buckets:
    """A micro-batch's documents (longest first) in buckets, priced by each bucket's longest document on
    every column's group size: ``t[k, j]`` seconds, ``head_len[k]`` tokens, ``count[k]`` documents,
    ``fits[k, j]`` whether bucket ``k``'s documents may go to column ``j``."""

    def __init__(self, docs: np.ndarray, starts: np.ndarray, lens: np.ndarray, need: np.ndarray, times: dict,
                 cols: list[int]):
        self.docs, self.cols, self.times, self.lens = docs, cols, times, lens
        self.bounds = np.concatenate([starts, [len(docs)]]).astype(np.int64)
        self.head = docs[starts]
        self.count = np.diff(self.bounds).astype(float)
        self.head_len = lens[self.head].astype(float)
        self.t = np.array([[float(times[d][h]) for d in cols] for h in self.head])
        self.fits = np.array([[need[h] <= d for d in cols] for h in self.head])

    @property
    def K(self) -> int:
        return len(self.head)

    def members(self, k: int) -> np.ndarray:
        return self.docs[self.bounds[k]:self.bounds[k + 1]]


def groups_milp(bk: Buckets, n: int, cap: int):
    """The paper's formulation: a column per virtual group (``A[k, p]`` documents of bucket ``k`` on group
    ``p``, ``m[p]`` group used), min C; copies of one size ordered (used first, then by time)."""
    K, P, vs, t = bk.K, len(bk.cols), bk.cols, bk.t
    lp = _LP(K * P + P + 1)
    A = np.arange(K * P).reshape(K, P)
    m = K * P + np.arange(P)
    C = K * P + P
    lp.c[C] = 1.0
    lp.ub[A] = np.where(bk.fits, bk.count[:, None], 0.0)
    lp.ub[m] = 1.0
    lp.ub[C] = np.inf
    lp.integrality[C] = 0
    for k in range(K):                                     # every document in one group
        lp.row(bk.count[k], bk.count[k])[A[k]] = 1.0
    for p in range(P):
        r = lp.row(-np.inf, 0.0)                           # time
        r[A[:, p]] = t[:, p]
        r[C] = -1.0
        r = lp.row(-np.inf, 0.0)                           # memory, and nothing on an unused group
        r[A[:, p]] = bk.head_len
        r[m[p]] = -float(cap * vs[p])
        r = lp.row(0.0, np.inf)                            # a used group holds a document
        r[A[:, p]] = 1.0
        r[m[p]] = -1.0
        if p + 1 < P and vs[p + 1] == vs[p]:               # symmetry: copies used first, then by time
            r = lp.row(0.0, np.inf)
            r[m[p]], r[m[p + 1]] = 1.0, -1.0
            r = lp.row(0.0, np.inf)
            r[A[:, p]] = t[:, p]
            r[A[:, p + 1]] = -t[:, p + 1]
    lp.row(0.0, float(n))[m] = vs                          # devices
    r = lp.row(-np.inf, 0.0)                               # Σ_p d_p·time_p ≤ n·C (valid: a used group's time
    r[A] = t * np.asarray(vs, float)[None, :]              # is at most C, an unused one's 0)
    r[C] = -float(n)
    lp.lb[C] = max(float(t[k, bk.fits[k]].min()) for k in range(K))

    def decode(x: np.ndarray, cap: int):
        used = [p for p in range(P) if x[m[p]] == 1]
        got: dict[int, list[int]] = {p: [] for p in used}
        load = dict.fromkeys(used, 0.0)
        held = dict.fromkeys(used, 0)
        for k in range(K):   # the bucket's documents, longest first, to the group of least exact time with quota
            quota = {p: int(x[A[k, p]]) for p in used if x[A[k, p]] > 0}
            for d in bk.members(k).tolist():
                open_ = [p for p in quota if quota[p] > 0]
                if not open_:
                    return None
                p = min(open_, key=lambda q: (load[q], q))
                got[p].append(d)
                load[p] += float(bk.times[vs[p]][d])
                held[p] += int(bk.lens[d])
                quota[p] -= 1
        if any(held[p] > cap * vs[p] for p in used):
            return None
        return [(vs[p], np.asarray(got[p], np.int64)) for p in used if got[p]]
    return lp, decode


def pooled_milp(bk: Buckets, n: int, cap: int):
    """Copies of one size pooled (see the module doc): a column per size ``d`` with ``g[d]`` groups,
    ``A[k, d]`` documents of bucket ``k`` on them, ``u[k, d]`` whether bucket ``k`` uses size ``d``;
    the pool's time Σ_k A[k,d]·t[k,d] ≤ C·g[d] (C·g[d] linearised over the bits of g[d]), its memory
    Σ_k A[k,d]·s_k ≤ T·d·g[d], and every document used under C: t[k,d]·u[k,d] ≤ C."""
    K, D, ds, t = bk.K, len(bk.cols), bk.cols, bk.t
    bits = [max(1, int(n // d).bit_length()) for d in ds]
    nb = sum(bits)
    A = np.arange(K * D).reshape(K, D)
    u = K * D + np.arange(K * D).reshape(K, D)
    g = 2 * K * D + np.arange(D)
    z0 = 2 * K * D + D                                     # bit variables of g, then y = C·z
    zs = [z0 + sum(bits[:j]) + np.arange(bits[j]) for j in range(D)]
    ys = [z0 + nb + sum(bits[:j]) + np.arange(bits[j]) for j in range(D)]
    C = z0 + 2 * nb
    lp = _LP(C + 1)
    big = float((bk.count[:, None] * np.where(bk.fits, t, 0.0)).sum())   # no pool's time exceeds every document's
    lp.c[C] = 1.0
    lp.ub[A] = np.where(bk.fits, bk.count[:, None], 0.0)
    lp.ub[u] = np.where(bk.fits, 1.0, 0.0)
    lp.ub[g] = [n // d for d in ds]
    for j in range(D):
        lp.ub[zs[j]] = 1.0
        lp.ub[ys[j]] = np.inf
        lp.integrality[ys[j]] = 0
    lp.ub[C] = np.inf
    lp.integrality[C] = 0
    for k in range(K):
        lp.row(bk.count[k], bk.count[k])[A[k]] = 1.0       # every document in one size
        for j in range(D):
            r = lp.row(-np.inf, 0.0)                       # A ≤ count·u
            r[A[k, j]], r[u[k, j]] = 1.0, -bk.count[k]
            r = lp.row(-np.inf, 0.0)                       # a used size prices its longest document under C
            r[u[k, j]], r[C] = t[k, j], -1.0
    for j, d in enumerate(ds):
        r = lp.row(0.0, 0.0)                               # g = Σ 2^b z_b
        r[g[j]] = 1.0
        r[zs[j]] = -(2.0 ** np.arange(bits[j]))
        for zb, yb in zip(zs[j].tolist(), ys[j].tolist()):  # y_b ≤ C, y_b ≤ big·z_b
            r = lp.row(-np.inf, 0.0)
            r[yb], r[C] = 1.0, -1.0
            r = lp.row(-np.inf, 0.0)
            r[yb], r[zb] = 1.0, -big
        r = lp.row(-np.inf, 0.0)                           # time of the pool ≤ C·g = Σ 2^b y_b
        r[A[:, j]] = t[:, j]
        r[ys[j]] = -(2.0 ** np.arange(bits[j]))
        r = lp.row(-np.inf, 0.0)                           # memory of the pool
        r[A[:, j]] = bk.head_len
        r[g[j]] = -float(cap * d)
        r = lp.row(0.0, np.inf)                            # every group of the pool holds a document
        r[A[:, j]] = 1.0
        r[g[j]] = -1.0
    lp.row(0.0, float(n))[g] = ds                          # devices
    r = lp.row(-np.inf, 0.0)                               # Σ_d d·time_d ≤ n·C
    r[A] = t * np.asarray(ds, float)[None, :]
    r[C] = -float(n)
    lp.lb[C] = max(float(t[k, bk.fits[k]].min()) for k in range(K))

    def decode(x: np.ndarray, cap: int):
        take: list[list[int]] = [[] for _ in ds]
        for k in range(K):  # the bucket's longest documents to the largest size
            at = 0
            mem = bk.members(k).tolist()
            for j in sorted(range(D), key=lambda j: -ds[j]):
                take[j] += mem[at:at + int(x[A[k, j]])]
                at += int(x[A[k, j]])
        out = []
        for j, d in enumerate(ds):
            if not take[j]:
                continue
            docs = np.asarray(take[j], np.int64)
            got = homogeneous(docs, bk.lens, bk.times[d], d, int(x[g[j]]), cap)
            if got is None:
                return None
            out += [(d, np.asarray(mm, np.int64)) for _, mm in got.groups]
        return out
    return lp, decode


# ---------------------------------------------------------------------------------------- polishing

def polish(groups: list, times: dict, need: np.ndarray, lens: np.ndarray, cap: int, rounds: int = POLISH_ROUNDS
           ) -> list:
    """Local search on an assignment ``[(size, docs)]``: while it helps, move one document off the slowest
    group, or swap one of its documents with one of another group, whichever lowers the larger of the two
    groups' exact times most (memory and CP size checked); at most ``rounds`` moves."""
    sizes = [int(d) for d, _ in groups]
    docs = [np.asarray(m, np.int64) for _, m in groups]
    t = [times[d][m] for d, m in zip(sizes, docs)]
    load = np.array([float(x.sum()) for x in t])
    held = np.array([int(lens[m].sum()) for m in docs])
    for _ in range(rounds):
        g = int(np.argmax(load))
        top = load[g]
        best: tuple[float, tuple[str, int, int, int] | None] = (float(top), None)
        tg = t[g]
        for h in range(len(docs)):
            if h == g:
                continue
            d = sizes[h]
            th = times[d][docs[g]]                                   # g's documents priced on h
            ok = (need[docs[g]] <= d) & (held[h] + lens[docs[g]] <= cap * d)
            after = np.maximum(load[g] - tg, load[h] + th)          # moves g -> h
            after[~ok] = np.inf
            i = int(np.argmin(after)) if len(after) else -1
            if i >= 0 and after[i] < best[0] - 1e-12:
                best = (float(after[i]), ("move", h, i, -1))
            if not len(docs[h]):
                continue
            ug = times[sizes[g]][docs[h]]                            # h's documents priced on g
            lg = load[g] - tg[:, None] + ug[None, :]                 # [i in g, j in h]
            lh = load[h] - t[h][None, :] + th[:, None]
            mg = held[g] - lens[docs[g]][:, None] + lens[docs[h]][None, :]
            mh = held[h] - lens[docs[h]][None, :] + lens[docs[g]][:, None]
            ok2 = ((need[docs[g]] <= d)[:, None] & (need[docs[h]] <= sizes[g])[None, :]
                   & (mg <= cap * sizes[g]) & (mh <= cap * d))
            after2 = np.where(ok2, np.maximum(lg, lh), np.inf)
            a, b = (int(x) for x in np.unravel_index(int(np.argmin(after2)), after2.shape))
            if after2[a, b] < best[0] - 1e-12:
                best = (float(after2[a, b]), ("swap", h, a, b))
        if best[1] is None:
            break
        kind, h, i, j = best[1]
        x = int(docs[g][i])
        if kind == "move":
            docs[g] = np.delete(docs[g], i)
            docs[h] = np.append(docs[h], x)
        else:
            y = int(docs[h][j])
            docs[g] = np.append(np.delete(docs[g], i), y)
            docs[h] = np.append(np.delete(docs[h], j), x)
        for q in (g, h):
            t[q] = times[sizes[q]][docs[q]]
            load[q] = float(t[q].sum())
            held[q] = int(lens[docs[q]].sum())
    return [(d, m.tolist()) for d, m in zip(sizes, docs) if len(m)]
