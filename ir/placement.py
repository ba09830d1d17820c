"""Placement: where each token block lives and where each compute block runs
(the value; :mod:`attnplan.ir.place` computes it from segments)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

@dataclass(frozen=True, slots=True, eq=False)
class Placement:
    """``home[tb]``: the device that holds token block ``tb`` (its Q, K, V and
    final O, for every head group) outside attention. ``cb_device[cb]``: the
    device that computes compute block ``cb``. ``devices_per_node`` groups
    devices into nodes (device ``d`` is on node ``d // devices_per_node``)."""

    devices: int
    nodes: int
    home: np.ndarray
    cb_device: np.ndarray

    def __post_init__(self):
        self.home.setflags(write=False)
        self.cb_device.setflags(write=False)

    @property
    def devices_per_node(self) -> int:
        return self.devices // self.nodes

    def to_text(self, limit: int = 40) -> str:
        lines = [f"placement devices={self.devices} nodes={self.nodes}"]
        homes = ", ".join(f"tb{t}->d{d}" for t, d in enumerate(self.home[:limit].tolist()))
        lines.append(f"  home {homes}{' ...' if len(self.home) > limit else ''}")
        cbs = ", ".join(f"c{c}->d{d}" for c, d in enumerate(self.cb_device[:limit].tolist()))
        lines.append(f"  compute {cbs}{' ...' if len(self.cb_device) > limit else ''}")
        return "\n".join(lines)
