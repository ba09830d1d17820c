"""divide{stages=K,slack=0.1}: DCP's division scheduling, without its tail.

Stage 0 runs every compute block whose inputs are all local; each later
stage's transfers are posted during the previous stage's compute (see the
``overlap`` pass), so stage s's communication hides behind stage s−1's work.

DCP's reference scheduler fills stages 1..K−2 by repeatedly picking the
least-loaded device and stops filling a stage for *every* device as soon as
that device is blocked by the per-link cap, which leaves most work (82% on
the survey's causal example) to the uncapped last stage. Here each device is
filled on its own, since the cap is per (source, destination) link and a
device's incoming links are its own:

* the device's remote compute is split into K−1 equal targets;
* its remote blocks are taken in an order that keeps blocks sharing an input
  together (by kv block, then q block) and interleaves the source links (by
  position within the link's own list), and each goes to the current stage
  unless that stage already reached its compute target or a transfer it
  would add exceeds the link's cap (total bytes on that link / (K−1), times
  1 + ``slack``) — then to the next stage; the last stage takes the rest;
* a transfer's stage is the stage of the first block on its destination that
  reads it.

``stats()["last_stage_share"]`` reports the share of compute in the last
stage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from ..ir.limits import MAX_STAGES
from ..ir.module import PlanIR
from ..ir.program import B_KV, B_Q, FWD, buffer_bytes
from ..ir.schedule import X_KV, X_O, X_Q, XDST, XHG, XK, XSRC, XSTAGE, XTB
from .base import Pass, register


@register
@dataclass(frozen=True, slots=True)
class Divide(Pass):
    name = "divide"
    needs = ("graph", "placement", "schedule")
    stages: int = 4
    slack: float = 0.1

    def __post_init__(self):
        if not 1 <= self.stages <= MAX_STAGES:
            raise PlanError(f"divide: stages must be in 1..{MAX_STAGES}, got {self.stages}")
        if self.slack < 0:
            raise PlanError(f"divide: slack must be non-negative, got {self.slack}")

    def apply(self, ir: PlanIR) -> PlanIR:
        g, pl, s = ir.need_graph(), ir.need_placement(), ir.need_schedule()
        x = s.xfer
        forwarded = len(x) and (x[:, XSRC] != np.where(x[:, XK] == X_O, x[:, XSRC], pl.home[x[:, XTB]])).any()
        if s.stages != 1 or forwarded or s.collective:
            raise PlanError("divide needs a single-stage point-to-point schedule: run comm{mode=p2p} before it "
                            "(not a2a: an all-to-all has one stage)")
        K = self.stages
        n = pl.devices
        home, dev = pl.home, pl.cb_device
        cq, ck, chg = g.cb_q, g.cb_k, g.cb_hg
        flops = g.cb_flops().astype(float)
        qbytes = buffer_bytes(g, FWD, B_Q, cq, chg)
        kbytes = buffer_bytes(g, FWD, B_KV, ck, chg)
        stage = np.zeros(g.n_cb, np.int64)
        arrive: dict[tuple, int] = {}  # (kind, tb, hg, dst) -> stage
        if K > 1:
            remote = (home[cq] != dev) | (home[ck] != dev)
            for d in range(n):
                idx = np.flatnonzero(remote & (dev == d))
                if not len(idx):
                    continue
                # blocks sharing an input stay together; links are interleaved so
                # that every link's traffic spreads evenly over the stages
                idx = idx[np.lexsort((chg[idx], cq[idx], ck[idx]))]
                src = np.where(home[ck[idx]] != d, home[ck[idx]], home[cq[idx]])
                order = np.argsort(src, kind="stable")
                rank = np.empty(len(idx))
                cnt = np.bincount(src, minlength=n)
                start = np.concatenate([[0], np.cumsum(cnt)[:-1]])
                rank[order] = (np.arange(len(idx)) - np.repeat(start, cnt)) / np.repeat(cnt, cnt)
                idx = idx[np.lexsort((src, rank))]
                target = flops[idx].sum() / (K - 1)
                # link caps: bytes from each source to d, spread over K-1 stages
                link_total = np.zeros(n)
                seen = set()
                for c in idx.tolist():
                    for kind, tb, nb in ((X_Q, cq[c], qbytes[c]), (X_KV, ck[c], kbytes[c])):
                        if home[tb] != d and (kind, tb, chg[c]) not in seen:
                            seen.add((kind, tb, chg[c]))
                            link_total[home[tb]] += nb
                cap = link_total / (K - 1) * (1 + self.slack)
                cur, load, used = 1, 0.0, np.zeros(n)
                for c in idx.tolist():
                    h = chg[c]
                    new = [(kind, tb, nb) for kind, tb, nb in ((X_Q, cq[c], qbytes[c]), (X_KV, ck[c], kbytes[c]))
                           if home[tb] != d and (kind, tb, h, d) not in arrive]
                    while cur < K - 1:
                        add = np.zeros(n)
                        for _, tb, nb in new:
                            add[home[tb]] += nb
                        # a link already carrying traffic this stage may not exceed its cap
                        over_link = ((add > 0) & (used > 0) & (used + add > cap + 1e-9)).any()
                        if load > 0 and (load + flops[c] > target * (1 + 1e-9) or over_link):
                            cur, load, used = cur + 1, 0.0, np.zeros(n)
                            continue
                        break
                    stage[c] = cur
                    load += flops[c]
                    for kind, tb, nb in new:
                        arrive[(kind, tb, h, d)] = cur
                        used[home[tb]] += nb
        xfer = x.copy()
        for i, (k, tb, hg, _, dst) in enumerate(x[:, [XK, XTB, XHG, XSRC, XDST]].tolist()):
            xfer[i, XSTAGE] = K - 1 if k == X_O else arrive.get((k, tb, hg, dst), 0)
        return ir.with_levels(schedule=dataclasses.replace(s, stages=K, cb_stage=stage, xfer=xfer))
