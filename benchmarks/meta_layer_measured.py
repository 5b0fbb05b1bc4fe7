"""One Llama layer built on the meta device, measured on the device op by op, against the
preset's prediction for it and against the same layer built there and run.

The model is transformers' ``LlamaForCausalLM`` with one decoder layer (Llama-3-8B's shape by
default: hidden 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256, ``sdpa`` attention),
one sample of ``--seq`` tokens, under ``--autocast`` (bfloat16 on a GPU). Three columns:

    measured   ``analyze`` on the meta model for the torch device: each distinct op made real
               there, timed and freed (``profile/materialize``)
    preset     ``analyze`` on the meta model for the device's preset (the analytic model)
    run        the same model built on the device and run: forward and backward timed with
               CUDA events (wall clock on the CPU), and the bytes the forward leaves allocated
               for the backward (``torch.cuda.memory_allocated`` after the forward, less before
               it, the logits included: the profile's saved bytes count them as the loss's)

    python benchmarks/meta_layer_measured.py                      # CUDA: Llama-3-8B's layer
    python benchmarks/meta_layer_measured.py --device cpu --small # the mechanism on a CPU
    python benchmarks/meta_layer_measured.py --seq 1024 --seq 8192 --out results/x.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import torch

GiB = 1024**3
LAYER_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, vocab_size=128256)
SMALL = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=704, vocab_size=4096)


def _model(shape: dict[str, int], seq: int) -> torch.nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(**shape, num_hidden_layers=1, max_position_embeddings=seq,
                                   attn_implementation="sdpa", use_cache=False)
    return transformers.LlamaForCausalLM(cfg)


def _profiled(model: torch.nn.Module, ids: torch.Tensor, device: Any, autocast: str | None
              ) -> dict[str, float]:
    from rannc_fx.plan.config import Config
    from rannc_fx.planner.analyze import analyze

    cfg = Config(autocast_dtype=autocast, profile_cache_dir=None, tracer="export")
    t0 = time.perf_counter()
    a = analyze(model, (ids,), {"labels": ids}, world_size=1, device=device, config=cfg)
    i = a.profile.batch_sizes.index(1) if 1 in a.profile.batch_sizes else 0
    nodes = a.profile.nodes.values()
    return dict(fwd_ms=1e3 * sum(c.fwd_s[i] for c in nodes),
                bwd_ms=1e3 * sum(c.bwd_s[i] for c in nodes),
                saved_gib=sum(c.saved_bytes[i] for c in nodes) / GiB,
                seconds=time.perf_counter() - t0, measured=a.profile.measured,
                samples=a.profile.batch_sizes[i])


def _run(shape: dict[str, int], seq: int, device: torch.device, autocast: str | None
         ) -> dict[str, float]:
    """The layer built on the device: forward and backward times, bytes held between them."""
    torch.manual_seed(0)
    with torch.device(device):
        model = _model(shape, seq)
    ids = torch.randint(0, shape["vocab_size"], (1, seq), device=device)
    amp = (torch.autocast(device.type, getattr(torch, autocast)) if autocast
           else torch.autocast(device.type, enabled=False))
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    fwd, bwd, held = [], [], []
    for _ in range(4):  # the first is a warm-up
        model.zero_grad(set_to_none=True)
        sync()
        before = torch.cuda.memory_allocated(device) if cuda else 0
        t0 = time.perf_counter()
        with amp:
            loss = model(input_ids=ids, labels=ids).loss
        sync()
        t1 = time.perf_counter()
        after = torch.cuda.memory_allocated(device) if cuda else 0
        loss.backward()
        sync()
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
        held.append(after - before)
        del loss
    return dict(fwd_ms=1e3 * statistics.median(fwd[1:]), bwd_ms=1e3 * statistics.median(bwd[1:]),
                saved_gib=statistics.median(held[1:]) / GiB if cuda else float("nan"))


def row(seq: int, device: torch.device, preset: str, shape: dict[str, int],
        autocast: str | None) -> dict[str, Any]:
    with torch.device("meta"):
        meta = _model(shape, seq)
    ids = torch.zeros(2, seq, dtype=torch.long, device="meta")  # export keeps 2 dynamic
    return dict(seq=seq, measured=_profiled(meta, ids, device, autocast),
                preset=_profiled(meta, ids, preset, autocast),
                run=_run(shape, seq, device, autocast))


def table(rows: list[dict[str, Any]], device: torch.device, preset: str) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    out = [f"device: {device} ({name}); preset {preset}; torch {torch.__version__}", "",
           "| seq | what | forward ms | backward ms | saved GiB | planned in s (ops timed) |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        for what in ("measured", "preset", "run"):
            c = r[what]
            plan = f"{c['seconds']:.1f} ({c['measured']})" if "seconds" in c else "-"
            out.append(f"| {r['seq']} | {what} | {c['fwd_ms']:.2f} | {c['bwd_ms']:.2f} | "
                       f"{c['saved_gib']:.3f} | {plan} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default=None, help="default: the device's own (DeviceSpec.of)")
    ap.add_argument("--seq", type=int, action="append", help="default: 1024 and 8192")
    ap.add_argument("--small", action="store_true", help="a small layer (a CPU's check)")
    ap.add_argument("--autocast", default=None, help="default: bfloat16 on CUDA, none on CPU")
    ap.add_argument("--out")
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    from rannc_fx.plan.device import DeviceSpec

    preset = a.preset or DeviceSpec.of(device).name
    autocast = a.autocast or ("bfloat16" if device.type == "cuda" else None)
    shape = SMALL if a.small else LAYER_8B
    rows = [row(s, device, preset, shape, autocast) for s in (a.seq or [1024, 8192])]
    text = table(rows, device, preset)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
