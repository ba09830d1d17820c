"""Colours shared by the HTML report and the PNG figures."""

from __future__ import annotations

import colorsys

# stage colours (compute spans); merges/adds, waits and transfers have their own
STAGE_COLOURS = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#eeca3b", "#72b7b2", "#ff9da6", "#9d755d",
                 "#79706e")
MERGE_COLOUR, WAIT_COLOUR, SEND_COLOUR, RECV_COLOUR = "#9e9e9e", "#d62728", "#3f51b5", "#00897b"


def device_palette(n: int) -> list[str]:
    """``n`` distinct colours, neighbours far apart in hue (golden-angle steps),
    alternating lightness; the same in the HTML report and the PNGs."""
    out = []
    for i in range(n):
        h = (i * 0.381966) % 1.0
        light = (0.45, 0.62, 0.36)[i % 3]
        r, g, b = colorsys.hls_to_rgb(h, light, 0.62)
        out.append(f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}")
    return out
