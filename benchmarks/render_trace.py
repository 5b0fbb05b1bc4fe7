"""Draw a rannc_fx trace as a PNG: one row per rank (measured), one per stage (predicted).

    python benchmarks/render_trace.py TRACE.json OUT.png [--step N]

Needs matplotlib (``pip install matplotlib``; only this script uses it). Forward, recompute
and backward are coloured by kind and labelled with their micro-batch; waits, message
posting, collectives and the optimizer step have their own colours. The summary
(``python -m rannc_fx trace summary TRACE.json``) is printed under the picture's title.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from rannc_fx.runtime.tracefile import format_summary, summarize  # noqa: E402

COLOURS = {
    "F": "#4c72b0", "R": "#8172b2", "B": "#55a868", "wait": "#e8a0a0", "post": "#b0b0b0",
    "collective": "#dd8452", "optimizer": "#937860",
}  # fmt: skip


def _colour(e: dict[str, Any]) -> str:
    kind = e["args"].get("kind")
    return COLOURS.get(kind, COLOURS.get(e["cat"], "#cccccc")) if e["cat"] == "compute" \
        else COLOURS.get(e["cat"], "#cccccc")


def render(trace: dict[str, Any], out: Path, step: int | None = None) -> None:
    meta = trace["otherData"]["rannc_fx"]
    ranks = {int(r): v for r, v in meta["ranks"].items()}
    stages = sorted({v["stage"] for v in ranks.values()})
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"
              and (step is None or e["args"].get("step") == step)]
    rows = [(0, r, f"rank {r}: stage {ranks[r]['stage']}") for r in sorted(ranks)]
    rows += [(1, s, f"predicted stage {s}") for s in stages]
    y_of = {(pid, tid): len(rows) - 1 - k for k, (pid, tid, _) in enumerate(rows)}
    t0 = min((e["ts"] for e in events), default=0.0)
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.55 * len(rows)))
    for e in events:
        y = y_of.get((e["pid"], e["tid"]))
        if y is None:
            continue
        x, w = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
        ax.barh(y, w, left=x, height=0.7, color=_colour(e), edgecolor="none")
        if e["cat"] == "compute" and e["args"].get("microbatch") is not None:
            ax.text(x + w / 2, y, str(e["args"]["microbatch"]), ha="center", va="center",
                    fontsize=6, color="white", clip_on=True)
    ax.set_yticks([y_of[(p, t)] for p, t, _ in rows], [label for _, _, label in rows])
    ax.axhline(len(stages) - 0.5, color="black", linewidth=0.6)
    ax.set_xlabel("ms from the first traced call (rank 0's clock)")
    summary = format_summary(summarize(trace))
    ax.set_title(summary, fontsize=7, family="monospace", loc="left")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], ncol=7,
              loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.02 * len(rows)), fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=130)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--step", type=int, default=None, help="draw one step only")
    args = p.parse_args(argv)
    render(json.loads(args.trace.read_text()), args.out, args.step)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
