"""The default attention pipeline: one named step a line."""

from __future__ import annotations

from . import REGISTRY
from .base import strategy_name
from .comm import Overlap, default_comm, parse_entry


def default_pipeline(strategy: str, block_size: int, comm: str | None = None, local: str = "kept") -> str:
    """The default pipeline, one named step a line; ``comm`` replaces the
    options of its comm step (e.g. ``"mode=allgather"``), ``local`` the
    overlap step's (``first``, ``last`` or ``kept``). ``strategy`` is a
    name or ``name{options}`` (``span{grain=2}``)."""
    run = REGISTRY[strategy_name(strategy)].default_run
    return ",".join([
        f"tile{{block={block_size}}}",                         # token blocks per sample, the block graph
        strategy,                                             # placement: token homes, compute devices
        f"comm{{{comm or default_comm(REGISTRY[strategy_name(strategy)].default_comm)}}}",  # p2p + node relays, or ring
        Overlap(run=run, local=local).spec(),                  # next stage's transfers fly during compute
        "emit",                                               # per-device instruction streams, fwd + bwd
    ])


def entry_pipeline(entry: str, block_size: int) -> str:
    """The pipeline a strategy entry names (:func:`attnplan.passes.comm.parse_entry`: ``span{grain=2}:tree
    overlap{local=last}``): its strategy's default pipeline under its variant's comm step and its order."""
    e = parse_entry(entry)
    return default_pipeline(e.strategy, block_size, e.comm, e.local)
