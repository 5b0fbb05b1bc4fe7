"""Capture time of a meta-device BERT with and without repeated layers traced once.

For each layer count the same model is captured twice in one process by
``trace_export(..., repeated=False)`` (plain non-strict torch.export) and
``trace_export(..., repeated=True)`` (each kind of repeated layer traced once, its nodes copied,
``capture/repeat.py``), in alternating order, and the two graphs are compared node by
node (ops, arguments by position, get_attr targets, output shapes). A warm-up capture of a
2-layer model runs first, so neither side pays torch's first-call imports.

    python benchmarks/capture_time.py --layers 32 64 128 256 --hidden 1024 --heads 16 --seq 512
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from rannc_fx.capture.graph import CapturedGraph
from rannc_fx.capture.trace import trace_export

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_time import bert  # noqa: E402


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[32, 64, 128, 256],
                   help="BERT encoder layer counts, one row each")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (intermediate = 4x)")
    p.add_argument("--heads", type=int, default=16, help="attention heads")
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    p.add_argument("--out", default=None, help="append a markdown section to this file")
    a = p.parse_args(argv)

    def capture(layers: int, repeated: bool) -> tuple[float, CapturedGraph]:
        model, args, kwargs, _ = bert(layers, a.hidden, heads=a.heads, seq=a.seq)
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
        t0 = time.perf_counter()
        captured = trace_export(model, args, kwargs, 0, repeated=repeated)
        return time.perf_counter() - t0, captured

    capture(2, False)
    capture(2, True)
    rows = []
    for i, layers in enumerate(a.layers):
        order = (False, True) if i % 2 == 0 else (True, False)
        runs = {rep: capture(layers, rep) for rep in order}
        (plain_s, plain), (fast_s, fast) = runs[False], runs[True]
        same = plain.fingerprint() == fast.fingerprint()  # ops, arguments by position, tensors
        rows.append(f"| {layers} | {plain.num_nodes} | {plain_s:.2f} | {fast_s:.2f} "
                    f"| {plain_s / fast_s:.1f}x | {fast.copied_calls} | {'yes' if same else '**no**'} |")
        print(rows[-1], flush=True)
    head = ("| layers | nodes | plain export s | layers traced once s | speed-up | calls copied "
            "| same graph |\n|---:|---:|---:|---:|---:|---:|---|")
    table = "\n".join([head, *rows])
    print(table)
    if a.out:
        cmd = "python benchmarks/capture_time.py " + " ".join(sys.argv[1:] if argv is None else argv)
        with open(a.out, "a") as f:
            f.write(f"Command:\n\n    {cmd}\n\ntorch {torch.__version__}, Python "
                    f"{platform.python_version()}, {torch.get_num_threads()} torch threads; "
                    f"hidden {a.hidden}, {a.heads} heads, seq {a.seq}, meta device.\n\n"
                    f"{table}\n\n")


if __name__ == "__main__":
    main()
