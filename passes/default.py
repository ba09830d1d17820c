"""The default attention pipeline: one named step a line."""

from __future__ import annotations

from . import REGISTRY
from .base import DEFAULT_RUN, strategy_name
from .comm import default_comm


def default_pipeline(strategy: str, block_size: int, comm: str | None = None) -> str:
    """The default pipeline, one named step a line; ``comm`` replaces the
    options of its comm step (e.g. ``"mode=allgather"``). ``strategy`` is a
    name or ``name{options}`` (``span{grain=2}``)."""
    run = REGISTRY[strategy_name(strategy)].default_run
    return ",".join([
        f"tile{{block={block_size}}}",                         # token blocks per sample, the block graph
        strategy,                                             # placement: token homes, compute devices
        f"comm{{{comm or default_comm(REGISTRY[strategy_name(strategy)].default_comm)}}}",  # p2p + node relays, or ring
        "overlap" if run == DEFAULT_RUN else f"overlap{{run={run:g}}}",  # next stage's transfers fly during compute
        "emit",                                               # per-device instruction streams, fwd + bwd
    ])
