"""On one GPU: what autograd really keeps against what the cost model predicts.

``--part saved``: for HF BERT and GPT-2 blocks at one micro-batch size, the bytes of saved
activations three ways: the analytic cost model (a meta-device model planned for the
``--preset``, as a plan for a large model is made), the measured profile on this GPU, and
autograd's own saved tensors when the captured graph runs on this GPU (saved-tensor hooks,
unique storages, parameters excluded). Attention nodes are listed apart: the analytic model
costs whatever kernel the meta-device capture traced, the GPU runs a fused one.

``--part stage``: a one-stage plan (the whole model, ``--micro-batches`` micro-batches, GPipe)
with and without recomputation, run by the runtime on this GPU for a few Adam steps; the peak
of ``torch.cuda.max_memory_allocated`` during a step against the plan's ``MemoryEstimate``.

    python benchmarks/memory_gpu.py --part saved stage --layers 4 --hidden 1024 --seq 512
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn

import rannc_fx
from rannc_fx import Config
from rannc_fx.planner.analyze import analyze
from rannc_fx.profile.profile import Profile

MiB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", nargs="+", choices=["saved", "stage"], default=["saved", "stage"],
                   help="which measurements to run")
    p.add_argument("--models", nargs="+", choices=["bert", "gpt2"], default=["bert", "gpt2"],
                   help="HF architectures, built from a config with random weights")
    p.add_argument("--layers", type=int, default=4, help="transformer layers")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size")
    p.add_argument("--heads", type=int, default=16, help="attention heads")
    p.add_argument("--seq", type=int, default=512, help="sequence length")
    p.add_argument("--batch", type=int, default=8, help="samples per step (part saved: per run)")
    p.add_argument("--vocab", type=int, default=30522, help="vocabulary size")
    p.add_argument("--micro-batches", type=int, default=4, help="part stage: micro-batches")
    p.add_argument("--steps", type=int, default=3, help="part stage: Adam steps measured")
    p.add_argument("--preset", default="h100-80gb", help="DeviceSpec preset of the analytic model")
    p.add_argument("--device", default="cuda", help="where to measure (cpu: a dry run of --part "
                   "saved)")
    return p.parse_args(argv)


def build(name: str, a: argparse.Namespace, device: str) -> tuple[nn.Module, tuple, dict]:
    import transformers

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
    ctx = torch.device(device)
    if name == "bert":
        cfg = transformers.BertConfig(
            vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
            num_attention_heads=a.heads, intermediate_size=4 * a.hidden,
            max_position_embeddings=max(512, a.seq), attn_implementation="sdpa",
        )
        with ctx:
            model = transformers.BertForPreTraining(cfg)
        kwargs = {"labels": ids.clone(), "next_sentence_label": torch.zeros(a.batch).long()}
    else:
        cfg = transformers.GPT2Config(
            vocab_size=a.vocab, n_positions=max(1024, a.seq), n_embd=a.hidden, n_layer=a.layers,
            n_head=a.heads, use_cache=False, attn_implementation="sdpa",
        )
        with ctx:
            model = transformers.GPT2LMHeadModel(cfg)
        kwargs = {"labels": ids.clone()}
    dev = "cpu" if device == "meta" else device
    return model, (ids.to(dev),), {k: v.to(dev) for k, v in kwargs.items()}


def _saved_by_profile(profile: Profile, q: int) -> tuple[float, dict[str, float]]:
    total, attention = 0.0, {}
    for name in profile.nodes:
        b = profile.at(name, "saved_bytes", q)
        total += b
        if "attention" in name or "sdpa" in name:
            attention[name] = b
    return total, attention


def _autograd_saved(gm: fx.GraphModule, flat: list[Any]) -> tuple[int, dict[str, int]]:
    """Unique storages autograd saves in one forward, by the node whose run saved them first."""
    excluded = {t.untyped_storage().data_ptr() for t in (*gm.parameters(), *gm.buffers())}
    seen: dict[int, int] = {}
    by_node: dict[str, int] = {}
    current = {"node": ""}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in excluded and ptr not in seen:
            seen[ptr] = s.nbytes()
            by_node[current["node"]] = by_node.get(current["node"], 0) + s.nbytes()
        return t

    class Run(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            current["node"] = n.name
            return super().run_node(n)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.enable_grad():
        out = Run(gm).run(*flat)
    del out
    return sum(seen.values()), by_node


def part_saved(a: argparse.Namespace) -> None:
    print(f"\n## Saved activations, {a.layers} layers, hidden {a.hidden}, seq {a.seq}, "
          f"batch {a.batch} (fp32)\n")
    print(f"| model | analytic (meta, {a.preset}) MiB | measured profile (GPU) MiB | "
          "autograd on GPU MiB | analytic / autograd | measured / autograd |")
    print("|---|---:|---:|---:|---:|---:|")
    notes = []
    for name in a.models:
        cfg = Config(profile_cache_dir=None, profile_repeats=1, max_micro_batches=1)
        meta, margs, mkw = build(name, a, "meta")
        an = analyze(meta, margs, mkw, world_size=1, device=a.preset, config=cfg)
        ana_total, ana_attn = _saved_by_profile(an.profile, a.batch)
        del meta, an
        model, args, kwargs = build(name, a, a.device)
        me = analyze(model, args, kwargs, world_size=1, config=cfg.model_copy(
            update={"cost_model": "measured"}))
        mea_total, mea_attn = _saved_by_profile(me.profile, a.batch)
        flat = me.captured.flatten_inputs(args, kwargs)
        real, by_node = _autograd_saved(me.captured.gm, flat)
        print(f"| {name} | {ana_total / MiB:.1f} | {mea_total / MiB:.1f} | {real / MiB:.1f} | "
              f"{ana_total / real:.3f} | {mea_total / real:.3f} |")
        sdpa = {n: b for n, b in by_node.items() if "attention" in n}
        notes.append(f"- {name}: attention nodes, analytic (per node, MiB): "
                     f"{_top(ana_attn)}; measured profile: {_top(mea_attn)}; autograd (saved at "
                     f"the attention op): {_top(sdpa)}")
        targets = sorted({str(n.target) for n in me.captured.gm.graph.nodes
                          if n.op == "call_function" and "attention" in str(n.target)})
        notes.append(f"- {name}: attention ops in the GPU capture: {targets}")
        del model, me, flat
        gc.collect()
        if a.device == "cuda":
            torch.cuda.empty_cache()
    print()
    print("\n".join(notes))


def _top(d: dict[str, float], k: int = 2) -> str:
    items = sorted(d.items())[:k]
    return ", ".join(f"{n} {b / MiB:.1f}" for n, b in items) + (f" (+{len(d) - k} more)"
                                                                 if len(d) > k else "")


@contextlib.contextmanager
def _peak() -> Iterator[dict[str, int]]:
    if not torch.cuda.is_available():  # a dry run on the CPU: nothing to read
        yield {"before": 0, "peak": 1}
        return
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = {"before": torch.cuda.memory_allocated()}
    yield out
    torch.cuda.synchronize()
    out["peak"] = torch.cuda.max_memory_allocated()


def part_stage(a: argparse.Namespace) -> None:
    from rannc_fx.runtime import StageExecutor

    print(f"\n## One stage on the GPU: {a.micro_batches} micro-batches of "
          f"{a.batch // a.micro_batches} samples, GPipe, Adam\n")
    print("| model | recompute | params + Adam state MiB: plan / allocated before the step | "
          "step memory MiB: predicted (grads + activations + cut values + workspace + model "
          "outputs) | measured (peak above the step's start) | error | step ms |")
    print("|---|---|---|---|---:|---:|---:|")
    for name in a.models:
        for recompute in (False, True):
            model, args, kwargs = build(name, a, a.device)
            cfg = Config(profile_cache_dir=None, profile_repeats=1, micro_batches=a.micro_batches,
                         max_micro_batches=a.micro_batches, schedule="gpipe", recompute=recompute,
                         cost_model="measured")
            opt = torch.optim.Adam(model.parameters(), lr=1e-5)
            parted = rannc_fx.partition(model, args, kwargs, world_size=1, config=cfg,
                                        optimizer=opt)
            plan = parted.plan
            ex = StageExecutor(plan, parted.stages[0])
            flat = parted.captured.flatten_inputs(args, kwargs)
            gc.collect()
            if a.device == "cuda":
                torch.cuda.empty_cache()
            peaks, befores, times = [], [], []
            for _ in range(a.steps + 1):
                opt.zero_grad(set_to_none=True)
                with _peak() as p:
                    t0 = time.perf_counter()
                    loss = ex.forward(flat)[0]
                    loss.backward()
                    opt.step()
                    if a.device == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                peaks.append(p["peak"] - p["before"])
                befores.append(p["before"])
            mem = plan.stages[0].memory
            static = mem.params + mem.optimizer_state
            pred = mem.total - static
            meas = max(peaks[1:])
            print(f"| {name} | {'yes' if recompute else 'no'} | {static / MiB:.0f} / "
                  f"{max(befores[1:]) / MiB:.0f} | {pred / MiB:.0f} ({mem.grads / MiB:.0f} + "
                  f"{mem.activations / MiB:.0f} + {mem.comm_buffers / MiB:.0f} + "
                  f"{mem.workspace / MiB:.0f} + {mem.outputs / MiB:.0f}) | {meas / MiB:.0f} | "
                  f"{100 * (pred - meas) / meas:+.1f}% | {1e3 * min(times[1:]):.1f} |")
            del model, opt, parted, ex, flat, loss
            gc.collect()
            if a.device == "cuda":
                torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    where = torch.cuda.get_device_name() if a.device == "cuda" else a.device
    print(f"- {where}, torch {torch.__version__}, "
          f"command: python benchmarks/memory_gpu.py {' '.join(sys.argv[1:])}")
    if "saved" in a.part:
        part_saved(a)
    if "stage" in a.part:
        part_stage(a)


if __name__ == "__main__":
    main()
