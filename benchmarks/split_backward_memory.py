"""What a micro-batch holds between a split backward's B and its W, per layer kind.

    python benchmarks/split_backward_memory.py

One process. A stack of ``--layers`` layers of one kind -- ``runtime_common.Block`` (GPT,
``scaled_dot_product_attention``), ``nn.TransformerEncoderLayer`` (pre-norm, causal), and,
with transformers installed, ``BertLayer`` and ``GPT2Block`` (eager attention) -- runs its
forward under ``backward_split.keeping_for_split`` and then ``backward_inputs`` (``B``), as the
runtime does for a micro-batch whose backward is split. Per kind: the bytes the forward saved
(unique storages, parameters excluded), what is left after ``B`` for ``W`` to read, and the
gradients ``B`` kept for ``W``, each as a share of the saved bytes. Before ``B`` dropped what
``W`` does not read, a micro-batch held all it saved and the kept gradients until its ``W``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_common import Block, environment  # noqa: E402

from rannc_fx.runtime.backward_split import (  # noqa: E402
    SavedBoxes,
    backward_inputs,
    backward_weights,
    keeping_for_split,
)

MiB = 2**20


def layer(kind: str, d: int) -> Callable[[], nn.Module]:
    heads = max(1, d // 64)
    if kind == "gpt":
        return lambda: Block(d, heads)
    if kind == "encoder":
        return lambda: nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0,
                                                  batch_first=True, norm_first=True)
    import transformers
    from transformers.models.bert.modeling_bert import BertLayer
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    if kind == "bert":
        cfg = transformers.BertConfig(hidden_size=d, num_attention_heads=heads,
                                      intermediate_size=4 * d, attn_implementation="eager")
        return lambda: BertLayer(cfg)
    cfg = transformers.GPT2Config(n_embd=d, n_head=heads, attn_implementation="eager")
    return lambda: GPT2Block(cfg)


class Stack(nn.Module):
    def __init__(self, make: Callable[[], nn.Module], layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(make() for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.layers:
            out = blk(x)
            x = out[0] if isinstance(out, tuple) else out
        return x


def _bytes(tensors: list[torch.Tensor], skip: set[int]) -> int:
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(n for k, n in storages.items() if k not in skip)


def measure(kind: str, d: int, layers: int, batch: int, seq: int) -> str:
    torch.manual_seed(0)
    stack = Stack(layer(kind, d), layers).train()
    params = list(stack.parameters())
    weights = {p.untyped_storage()._cdata for p in params}
    x = torch.randn(batch, seq, d, requires_grad=True)
    boxes = SavedBoxes()
    with keeping_for_split(boxes):
        y = stack(x)
    saved = _bytes([b.tensor for b in boxes if b.tensor is not None], weights | {
        x.untyped_storage()._cdata})
    work = backward_inputs([y], [torch.ones_like(y)], [x], params, boxes)
    read = _bytes([b.tensor for b in boxes if b.tensor is not None], weights | {
        x.untyped_storage()._cdata})
    grads = _bytes([g for gs in work.kept.values() for g in gs if g is not None]
                   + [g for group in work.groups for _, _, g in group.seeded], set())
    backward_weights(work)
    return (f"| {kind} | {d} | {layers} | {batch} x {seq} | {saved / MiB:.2f} | "
            f"{read / MiB:.2f} ({read / saved:.2f}) | {grads / MiB:.2f} ({grads / saved:.2f}) | "
            f"{(read + grads) / saved:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", default=["gpt", "encoder", "bert", "gpt2"],
                   choices=("gpt", "encoder", "bert", "gpt2"))
    p.add_argument("--shapes", nargs="+", default=["256x128", "1024x512"],
                   help="width x sequence, one layer stack each (default: 256x128 1024x512)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    print("| layer kind | d | layers | samples x tokens | saved MiB | W reads MiB (share) | "
          "kept gradients MiB (share) | held between B and W / saved |\n"
          "|---|---:|---:|---|---:|---:|---:|---:|")
    for shape in args.shapes:
        d, seq = (int(v) for v in shape.split("x"))
        for kind in args.kinds:
            print(measure(kind, d, args.layers, args.batch, seq), flush=True)
    print("\n" + "\n".join(environment()))


if __name__ == "__main__":
    main()
