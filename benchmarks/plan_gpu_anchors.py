"""Plans for the GPU clusters users train on, held against published runs.

Each workload is a meta-device model planned with the analytic cost model (``plan_model``,
what ``partition()`` and ``compile()`` run) for a cluster of presets; the table gives the plan,
its predicted step, throughput per device, model FLOPs utilization (MFU) and the planning
time. MFU counts the model's FLOPs by the usual formula, not the planner's count: for the
decoder LMs 6 x parameters (the token embedding excluded) + 12 x layers x hidden x sequence per
token (torchtitan's and the Llama 3 paper's convention), for BERT 6 x parameters + 12 x layers
x hidden x sequence per token; against the preset's dense bfloat16 peak.

Published yardsticks: torchtitan's docs/performance.md (Llama-3.1-8B, seq 8192, local batch 2,
global 16, FSDP, bfloat16, selective recomputation, 8 H100s with 96 GB HBM2e at 2.4 TB/s):
5,762 tokens/s/GPU. The ``-fsdp`` rows hold the same search to plain FSDP (one stage on every
device, fully sharded: ``Config(stages=1, zero=3)``), the plan the searched one must not be
slower than.

    python benchmarks/plan_gpu_anchors.py                     # every workload, one table
    python benchmarks/plan_gpu_anchors.py --workload llama3-8b-8k-8
    python benchmarks/plan_gpu_anchors.py --out benchmarks/results/plan_gpu_anchors_cpu.md

Each workload runs in its own process (``--suite``, the default): nothing cached between them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from typing import Any

import torch

GiB = 1024**3

LLAMA3_8B = dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)
LLAMA3_70B = dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256)
LLAMA3_405B = dict(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256)
# the H100s torchtitan's published runs used: 96 GB of HBM2e at 2.4 TB/s
H100_96GB = dict(base="h100-80gb", name="h100-96gb-hbm2e", memory_bytes=96 * 10**9,
                 memory_bandwidth=2.4e12)

WORKLOADS: dict[str, dict[str, Any]] = {
    "llama3-8b-8k-8": dict(model="llama", **LLAMA3_8B, seq=8192, global_batch=16, world=8,
                           device=H100_96GB, published=5762.0),
    "llama3-8b-8k-64": dict(model="llama", **LLAMA3_8B, seq=8192, global_batch=128, world=64,
                            device=dict(base="h100-80gb")),
    "llama3-8b-2k-64b": dict(model="llama", **LLAMA3_8B, seq=2048, global_batch=64, world=8,
                             device=dict(base="h100-80gb")),
    "llama3-8b-2k-256b": dict(model="llama", **LLAMA3_8B, seq=2048, global_batch=256, world=8,
                              device=dict(base="h100-80gb")),
    # the same search held to plain FSDP: one stage on every device, fully sharded (ZeRO-3)
    "llama3-8b-8k-8-fsdp": dict(model="llama", **LLAMA3_8B, seq=8192, global_batch=16, world=8,
                                device=H100_96GB, published=5762.0,
                                config=dict(stages=1, zero=3)),
    "llama3-8b-2k-256b-fsdp": dict(model="llama", **LLAMA3_8B, seq=2048, global_batch=256,
                                   world=8, device=dict(base="h100-80gb"),
                                   config=dict(stages=1, zero=3)),
    "llama3-70b-8k-64": dict(model="llama", **LLAMA3_70B, seq=8192, global_batch=64, world=64,
                             device=dict(base="h100-80gb")),
    "bert-100b-1024": dict(model="bert", layers=128, hidden=8192, heads=64, seq=512,
                           global_batch=1024, world=1024, device=dict(base="a100-80gb")),
    "bert-large-256-32": dict(model="bert", layers=256, hidden=1024, heads=16, seq=512,
                              global_batch=256, world=32, device=dict(base="v100-32gb")),
    # planning at cluster scale: a GPT-2-style 18 B on 256 A100s, the Llama 3 405B shape on
    # 256 to 8,192 H100s (the Llama 3 paper's global batch of 2,048 sequences of 8,192)
    "gpt-18b-2k-256": dict(model="gpt2", layers=40, hidden=6144, heads=48, seq=2048,
                           global_batch=1024, world=256, device=dict(base="a100-80gb")),
    **{f"llama3-405b-8k-{w}": dict(model="llama", **LLAMA3_405B, seq=8192, global_batch=2048,
                                   world=w, device=dict(base="h100-80gb"))
       for w in (256, 1024, 2048, 4096, 8192)},
}


def _spec(device: dict[str, Any]) -> Any:
    from rannc_fx import DeviceSpec

    spec = DeviceSpec.preset(device["base"])
    return spec.model_copy(update={k: v for k, v in device.items() if k != "base"})


def _model(w: dict[str, Any]) -> tuple[torch.nn.Module, int]:
    """The model on the meta device, and its parameters counted for MFU."""
    import transformers

    with torch.device("meta"):
        if w["model"] == "llama":
            cfg = transformers.LlamaConfig(
                hidden_size=w["hidden"], num_hidden_layers=w["layers"],
                num_attention_heads=w["heads"], num_key_value_heads=w["kv_heads"],
                intermediate_size=w["ffn"], vocab_size=w["vocab"],
                max_position_embeddings=w["seq"], attn_implementation="sdpa", use_cache=False)
            model = transformers.LlamaForCausalLM(cfg)
            embedding = model.model.embed_tokens.weight.numel()
        elif w["model"] == "gpt2":
            cfg = transformers.GPT2Config(
                n_embd=w["hidden"], n_layer=w["layers"], n_head=w["heads"],
                n_positions=w["seq"], attn_implementation="sdpa", use_cache=False)
            model = transformers.GPT2LMHeadModel(cfg)
            embedding = model.transformer.wte.weight.numel() + model.transformer.wpe.weight.numel()
        else:
            cfg = transformers.BertConfig(
                hidden_size=w["hidden"], num_hidden_layers=w["layers"],
                num_attention_heads=w["heads"], intermediate_size=4 * w["hidden"],
                max_position_embeddings=w["seq"], attn_implementation="sdpa")
            model = transformers.BertForPreTraining(cfg)
            embedding = 0
    return model, sum(p.numel() for p in model.parameters()) - embedding


def run(name: str) -> dict[str, Any]:
    from rannc_fx import Config
    from rannc_fx.planner.driver import plan_model
    from rannc_fx.search import NoFeasiblePlan

    w = WORKLOADS[name]
    model, params = _model(w)
    ids = torch.zeros(2, w["seq"], dtype=torch.long, device="meta")
    kwargs: dict[str, Any] = {"labels": ids}
    if w["model"] == "bert":
        kwargs["next_sentence_label"] = torch.zeros(2, dtype=torch.long, device="meta")
    spec = _spec(w["device"])
    t0 = time.perf_counter()
    row: dict[str, Any] = dict(name=name, world=w["world"], device=spec.name)
    try:
        planned = plan_model(model, (ids,), kwargs, world_size=w["world"], device=spec,
                             config=Config(autocast_dtype="bfloat16", profile_cache_dir=None,
                                           **w.get("config", {})),
                             global_batch=w["global_batch"])
    except NoFeasiblePlan as e:
        row.update(plan=f"none: {str(e).splitlines()[0][:120]}", seconds=time.perf_counter() - t0)
        return row
    plan = planned.plan
    step_s = plan.predicted_step_ms / 1e3
    tokens = w["global_batch"] * w["seq"]
    per_token = 6 * params + 12 * w["layers"] * w["hidden"] * w["seq"]
    per_device = tokens / step_s / w["world"]
    row.update(
        plan=_describe(plan), step_s=step_s, per_device=per_device,
        mfu=per_device * per_token / spec.flops_for("bfloat16"),
        seconds=time.perf_counter() - t0, published=w.get("published"),
    )
    return row


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _describe(plan: Any) -> str:
    """``4 stage(s) x 2, 1f1b, m=32`` and what the stages do beyond plain training."""
    st = plan.stages
    reps = sorted({s.replicas for s in st})
    how = {"recompute": any(s.recompute and not s.checkpoints for s in st),
           "layer recompute": any(s.checkpoints for s in st),
           "selective": any(s.selective for s in st),
           f"zero-{max(s.zero for s in st)}": any(s.zero for s in st),
           "offload": any(s.offload for s in st),
           "host params": any(s.host_params for s in st)}
    extras = [k for k, on in how.items() if on]
    what = f"{len(st)} stage(s) x {'/'.join(map(str, reps))}, {plan.schedule}, m={plan.micro_batches}"
    return what + (f", {', '.join(extras)}" if extras else "")


def _table(rows: list[dict[str, Any]]) -> str:
    out = ["| workload | devices | plan | predicted step | per device /s | MFU | published | "
           "plan time | peak memory |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "step_s" not in r:
            out.append(f"| {r['name']} | {r['world']} x {r['device']} | {r['plan']} | - | - | - "
                       f"| - | {r['seconds']:.1f} s | {r.get('peak_gib', 0):.1f} GiB |")
            continue
        pub = (f"{r['published']:,.0f} ({r['per_device'] / r['published']:.2f}x)"
               if r.get("published") else "-")
        out.append(f"| {r['name']} | {r['world']} x {r['device']} | {r['plan']} | "
                   f"{r['step_s']:.2f} s | {r['per_device']:,.0f} | {100 * r['mfu']:.1f} % | "
                   f"{pub} | {r['seconds']:.1f} s | {r.get('peak_gib', 0):.1f} GiB |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS))
    ap.add_argument("--json", action="store_true", help="print the row as JSON (one workload)")
    ap.add_argument("--out", help="write the table there too")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a workload may plan")
    a = ap.parse_args()
    if a.workload:
        row = run(a.workload)
        row["peak_gib"] = _peak_gib()
        print(json.dumps(row) if a.json else _table([row]))
        return
    rows = []
    for name in WORKLOADS:
        try:
            got = subprocess.run([sys.executable, __file__, "--workload", name, "--json"],
                                 capture_output=True, text=True, env=os.environ, timeout=a.timeout)
        except subprocess.TimeoutExpired:
            rows.append(dict(name=name, world=WORKLOADS[name]["world"], device="-",
                             plan=f"not planned within {a.timeout} s", seconds=a.timeout))
            print(_table(rows[-1:]).splitlines()[-1], flush=True)
            continue
        lines = [ln for ln in got.stdout.splitlines() if ln.startswith("{")]
        rows.append(json.loads(lines[-1]) if lines else dict(
            name=name, world=WORKLOADS[name]["world"], device="-",
            plan=f"failed: {got.stderr.strip().splitlines()[-1][:160] if got.stderr else got.returncode}",
            seconds=0.0))
        print(_table(rows[-1:]).splitlines()[-1], flush=True)
    text = (f"{_table(rows)}\n\ntorch {torch.__version__}, {platform.machine()}, "
            f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}\n")
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
