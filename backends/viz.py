"""Plan visualizer: the data behind each picture, a self-contained HTML report, PNG figures.

One module per concern; this one gathers their public names:

* :mod:`.panels` — the static panels from the plan alone (columnar numpy, no
  HTML), so tests can check them against ``plan.stats()``: :func:`mask_cells`,
  :func:`device_bars`, :func:`comm_matrix`; and :func:`panel_data`, everything
  one report draws.
* :mod:`.timeline` — the simulated timeline (:func:`timeline`) and the
  exposed communication of each stage (:func:`exposed_by_stage`).
* :mod:`.html_report` — :func:`render_html` and :func:`render_compare_html`:
  one HTML file with inline CSS, JS (package data in ``backends/report/``) and
  canvas drawing, no network.
* :mod:`.png` — :func:`write_pngs`: the same pictures with matplotlib (Agg).
* :mod:`.palette` — the colours all of them share.
"""

from __future__ import annotations

from .html_report import json_for_html, render_compare_html, render_html, summary_rows
from .palette import MERGE_COLOUR, RECV_COLOUR, SEND_COLOUR, STAGE_COLOURS, WAIT_COLOUR, device_palette
from .panels import BAR_LABELS, comm_matrix, device_bars, mask_cells, panel_data, plan_profile, token_bins
from .png import write_pngs
from .timeline import L_COMPUTE, L_RECV, L_SEND, L_WAIT, LANES, exposed_by_stage, timeline

__all__ = [
    "BAR_LABELS", "LANES", "L_COMPUTE", "L_RECV", "L_SEND", "L_WAIT", "MERGE_COLOUR", "RECV_COLOUR", "SEND_COLOUR",
    "STAGE_COLOURS", "WAIT_COLOUR", "comm_matrix", "device_bars", "device_palette", "exposed_by_stage",
    "json_for_html", "mask_cells", "panel_data", "plan_profile", "render_compare_html", "render_html",
    "summary_rows", "timeline", "token_bins", "write_pngs",
]
