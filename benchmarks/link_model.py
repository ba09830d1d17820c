"""The link model, measured: what decides the plans of small batches across nodes.

At 128K tokens on 32 devices the plans' predicted time is set by message
latency and by how a device's messages share its links (docs/results.md: no
latency and no launches 1.53 of the bound, fair-shared links 1.80, the
default queue model 1.95). This script measures both on the machines the
plans are for, with the runtime's own point-to-point calls
(``torch.distributed`` ``isend``/``irecv``: NCCL on CUDA, gloo on the CPU),
and writes a cost profile for ``plan bench --profile`` / ``plan compare
--profile`` / ``benchmarks/gap.py --profile``:

1. **one link**: one-way seconds per message size between rank 0 and a rank
   of its node, and a rank of another node where the world spans nodes (the
   smallest rank there, ``--per-node`` ranks a node), each half the fastest
   sample of back-to-back round trips (a sample's clock stops on rank 0
   once its device is idle, before the barrier that ends it); fitted ``alpha + bytes / bandwidth``
   (:func:`attnplan.runtime.calibrate.fit_affine`): the profile's
   ``intra_alpha``/``intra_bw`` and ``inter_alpha``/``inter_bw``;
2. **one device, several peers** (which link model): rank 0 sends a 1-byte
   message to each of k peers of its node at once, each answers with S bytes
   as soon as it has it, rank 0 waits for all k (every send and receive
   posted together, as the runtime posts a stage's transfers); k = 1 ..
   node size - 1, S of ``--fan-bytes`` (64 KiB: latency-bound; 8 MiB:
   bandwidth-bound). The simulator's two models predict,
   with the link's fitted ``alpha`` and bandwidth: ``queue`` (a device's
   sends, and its receives, one message at a time) ``alpha + k * (alpha +
   S / bw)``; ``fair`` (latencies overlap, the bytes share the port) ``2 *
   alpha + k * S / bw``. The profile takes the model with the smaller mean
   relative error (``links``);
3. the profile: ``--base`` (default h100) with those six values; its ``fit``
   holds every measurement and both models' predictions.

    torchrun --nnodes 4 --nproc-per-node 8 ... benchmarks/link_model.py --device cuda --out link.json
    .venv/bin/python benchmarks/link_model.py --procs 4 --per-node 2 --quick --out /tmp/link.json   # CPU, gloo

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) every process is one rank and
``LOCAL_WORLD_SIZE`` gives the ranks a node; without it, ``--procs N``
starts N local processes (gloo on 127.0.0.1; ``--per-node`` splits them
into pretend nodes, so the script's every path runs on one machine — the CPU
test does that). Rank 0 prints the tables and writes ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, replace

SIZES = (4096, 65536, 1 << 20, 4 << 20, 16 << 20)
QUICK_SIZES = (4096, 65536, 1 << 20)


def _p2p(ops) -> None:
    """``ops`` (``(isend or irecv, tensor, peer)``) as one group, waited for: on NCCL every rank's point-to-point
    calls then share the group's communicator (plain isend/irecv open a two-rank one per pair, which a batch on
    the other side never matches), as the runtime posts them."""
    import torch.distributed as dist
    for w in dist.batch_isend_irecv([dist.P2POp(op, t, peer) for op, t, peer in ops]):
        w.wait()


def _timed(rank: int, active: bool, body, repeats: int, inner: int, sync, local_sync) -> float | None:
    """The fastest of ``repeats`` samples of ``inner`` back-to-back ``body()`` calls, per call, on rank 0's
    clock: read after its own device is idle and before the barrier that ends the sample (a barrier's
    latency is not the links'); the first sample is a warm-up (communicator and connection set-up).
    Every rank joins every barrier; those not ``active`` only do that. None off rank 0."""
    best = math.inf
    for i in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        if active:
            for _ in range(inner):
                body()
            local_sync()
        t = (time.perf_counter() - t0) / inner
        sync()
        if i:
            best = min(best, t)
    return best if rank == 0 else None


def one_way(rank: int, peer: int, nbytes: int, repeats: int, sync, local_sync) -> float | None:
    """Rank 0 and ``peer``: one-way seconds of ``nbytes`` (half the fastest round trip; module docstring)."""
    import torch
    from torch.distributed import irecv, isend
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=_device())
    inner = 20 if nbytes <= 1 << 20 else 4

    def body():
        if rank == 0:
            _p2p([(isend, buf, peer)])
            _p2p([(irecv, buf, peer)])
        else:
            _p2p([(irecv, buf, 0)])
            _p2p([(isend, buf, 0)])
    t = _timed(rank, rank in (0, peer), body, repeats, inner, sync, local_sync)
    return None if t is None else t / 2


def fan_in(rank: int, peers: list[int], nbytes: int, repeats: int, sync, local_sync) -> float | None:
    """Rank 0 sends one byte to every rank of ``peers`` at once, each answers ``nbytes`` once it has it;
    seconds from rank 0's first send to its last receive."""
    import torch
    from torch.distributed import irecv, isend
    dev = _device()
    go = torch.zeros(1, dtype=torch.uint8, device=dev)
    bufs = [torch.zeros(nbytes, dtype=torch.uint8, device=dev) for _ in peers] if rank == 0 else \
        [torch.zeros(nbytes, dtype=torch.uint8, device=dev)]

    def body():
        if rank == 0:  # one group of sends and receives, as a stage posts them
            _p2p([(isend, go, p) for p in peers] + [(irecv, b, p) for b, p in zip(bufs, peers)])
        else:
            _p2p([(irecv, go, 0)])
            _p2p([(isend, bufs[0], 0)])
    return _timed(rank, rank == 0 or rank in peers, body, repeats, 4, sync, local_sync)


def models(alpha: float, bw: float, k: int, nbytes: int) -> dict:
    """The simulator's prediction of :func:`fan_in` under each link model (module docstring)."""
    return {"queue": alpha + k * (alpha + nbytes / bw), "fair": 2 * alpha + k * nbytes / bw}


def choose_links(rows: list[dict], default: str) -> tuple[str, dict]:
    """The model whose predictions of the fan-in rows are nearer (mean relative error; ``default`` where
    they are equally near: with one peer both models are one message), and both errors."""
    err = {m: statistics.fmean(abs(r[m] / r["measured_s"] - 1) for r in rows) for m in ("queue", "fair")}
    return (default if math.isclose(err["queue"], err["fair"], abs_tol=1e-9) else min(err, key=err.__getitem__)), err


def _device():
    import torch
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and \
        os.environ.get("LINK_DEVICE") == "cuda" else torch.device("cpu")


def run_rank(rank: int, world: int, per_node: int, a) -> None:
    """Every rank: the measurements (every rank checks the arguments first, so that none waits in a barrier
    for a rank that stopped); then rank 0 alone fits, prints and writes the profile."""
    import torch
    import torch.distributed as dist

    from attnplan.backends.cost import get_profile
    base = get_profile(a.base)  # a bad --base fails on every rank, before any communication
    if not 1 <= per_node <= world:
        raise SystemExit(f"link_model: {per_node} ranks a node does not fit {world} ranks")
    cuda = a.device == "cuda"
    local = int(os.environ.get("LOCAL_RANK", rank % per_node))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)

    def local_sync():
        if cuda:
            torch.cuda.synchronize()

    def sync():
        local_sync()
        dist.barrier(device_ids=[local]) if cuda else dist.barrier()

    sizes = QUICK_SIZES if a.quick else SIZES
    links = {"intra": 1} if per_node >= 2 else {}
    if world > per_node:
        links["inter"] = per_node  # rank 0's rail peer on the next node (torchrun numbers a node's ranks together)
    points = {kind: [one_way(rank, peer, n, a.repeats, sync, local_sync) for n in sizes] for kind, peer in links.items()}
    ks = range(1, per_node if a.fan_max is None else min(per_node, a.fan_max + 1))
    fan_t = {(n, k): fan_in(rank, list(range(1, k + 1)), n, a.repeats, sync, local_sync)
             for n in a.fan_bytes for k in ks}
    dist.destroy_process_group()
    if rank == 0:  # after the last collective: nothing below can leave another rank waiting
        report(a, world, per_node, sizes, points, fan_t, base)


def report(a, world: int, per_node: int, sizes, points: dict, fan_t: dict, base) -> None:
    """Rank 0: the fits, the tables, and the profile written to ``a.out``."""
    from attnplan.runtime.calibrate import fit_affine
    fits = {}
    for kind, t in points.items():
        f = fit_affine(sizes, t, f"{kind}-node transfers")
        fits[kind] = {"alpha_s": f.intercept, "bw": 1 / f.slope, "residuals": list(f.residuals)}
    points = {kind: dict(zip(sizes, t)) for kind, t in points.items()}
    fan = [{"bytes": n, "k": k, "measured_s": t, **models(fits["intra"]["alpha_s"], fits["intra"]["bw"], k, n)}
           for (n, k), t in fan_t.items()] if "intra" in fits else []
    print(f"{world} ranks, {per_node} a node, {a.device}; one-way seconds, fastest of {a.repeats}")
    print("| link | " + " | ".join(f"{n:,} B" for n in sizes) + " | alpha | bandwidth |")
    print("|---|" + "---|" * (len(sizes) + 2))
    for kind, f in fits.items():
        print(f"| {kind} | " + " | ".join(f"{points[kind][n] * 1e6:.1f} µs" for n in sizes)
              + f" | {f['alpha_s'] * 1e6:.1f} µs | {f['bw'] / 1e9:.2f} GB/s |")
    chosen, err = choose_links(fan, base.links) if fan else (base.links, {})
    if fan:
        print("\nrank 0 and k peers of its node at once (1 B out to each, then each one's answer in):")
        print("| answer | k | measured | queue model | fair model |\n|---|---|---|---|---|")
        for r in fan:
            print(f"| {r['bytes']:,} B | {r['k']} | {r['measured_s'] * 1e6:.1f} µs | {r['queue'] * 1e6:.1f} µs | "
                  f"{r['fair'] * 1e6:.1f} µs |")
        print(f"mean relative error: queue {err['queue']:.2f}, fair {err['fair']:.2f} -> links={chosen!r} (measured "
              "inside a node; the profile applies it across nodes too. Where one pair of devices does not fill a "
              "port, both models over-predict the large answers: the simulator has one bandwidth a link)")
    intra = fits.get("intra", {"alpha_s": base.intra_alpha, "bw": base.intra_bw})
    inter = fits.get("inter", intra)  # one node: nothing crosses nodes; the inter-node link is the intra one
    prof = replace(base, name=f"{base.name}-links", intra_alpha=intra["alpha_s"], intra_bw=intra["bw"],
                   inter_alpha=inter["alpha_s"], inter_bw=inter["bw"], links=chosen)
    data = dict(asdict(prof), fit={"base": base.name, "device": a.device, "ranks": world, "per_node": per_node,
                                   "sizes": list(sizes), "one_way_s": {k: [points[k][n] for n in sizes]
                                                                       for k in points},
                                   "links": fits, "fan_in": fan, "fan_bytes": list(a.fan_bytes), "model_error": err,
                                   "inter_measured": "inter" in fits})
    with open(a.out, "w") as fh:
        json.dump(data, fh, indent=1)
    print(f"wrote {a.out}: profile {prof.name!r} (re-price plans with --profile {a.out})")


def launch(a) -> int:
    """``--procs N`` without torchrun: N local processes, gloo on 127.0.0.1."""
    import torch.multiprocessing as mp

    from attnplan.runtime.rendezvous import free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    mp.start_processes(_spawned, args=(a,), nprocs=a.procs, start_method="spawn")
    return 0


def _spawned(rank: int, a) -> None:
    run_rank(rank, a.procs, a.per_node or a.procs, a)


def _sizes(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated byte counts, got {text!r}") from None
    if not out or any(not 1 <= n <= 1 << 30 for n in out):
        raise argparse.ArgumentTypeError(f"byte counts in 1..2^30, got {text!r}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the profile JSON to write (rank 0)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU a rank")
    ap.add_argument("--procs", type=int, default=2, help="local processes when not under torchrun (>= 2)")
    ap.add_argument("--per-node", type=int, default=None,
                    help="ranks a node (default: LOCAL_WORLD_SIZE under torchrun, else every process)")
    ap.add_argument("--base", default="h100", help="the profile whose other fields the result keeps")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--fan-bytes", type=_sizes, default=(65536, 8 << 20),
                    help="comma-separated bytes each peer answers in the fan-in test (default 65536,8388608: "
                         "latency-bound, then bandwidth-bound)")
    ap.add_argument("--fan-max", type=int, default=None, help="most peers in the fan-in test (default node - 1)")
    ap.add_argument("--quick", action="store_true", help="fewer message sizes (the CPU test)")
    a = ap.parse_args(argv)
    os.environ["LINK_DEVICE"] = a.device
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        run_rank(int(os.environ["RANK"]), world, a.per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world)), a)
        return 0
    if a.device == "cuda":
        ap.error("--device cuda runs under torchrun (one process a GPU)")
    if a.procs < 2 or (a.per_node is not None and not 1 <= a.per_node <= a.procs):
        ap.error("--procs must be >= 2 and --per-node in 1..procs")
    return launch(a)


if __name__ == "__main__":
    sys.exit(main())
