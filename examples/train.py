"""Train the built-in Transformer LM on synthetic data: a single-device script plus one line.

    python examples/train.py                         # one process
    torchrun --nproc-per-node 2 examples/train.py    # rannc_fx splits it over 2 ranks

By default each device is taken to hold only 24 MiB (``--device-memory-mib``), less than this
model needs on one rank with Adam even with one micro-batch in flight, and less than two
replicas need even with the Adam state sharded between them, so that on 2 ranks the plan
must pipeline it; pass ``--device-memory-mib 0`` for the
device's real size.

The line marked below is the only change a single-device script needs: ``rannc_fx.compile``
plans the model (stages, replicas, micro-batches) from one example batch, then each rank
runs its stage. Every rank feeds its own local batch, as with a DistributedSampler, and gets
the loss of the whole global batch back.

The loop is a whole training loop: the gradient clipped to a norm of ``--clip`` (with
``model.clip_grad_norm_``: the whole model's norm, which torch's function over
``model.parameters()`` cannot see from one rank), a warm-up then decaying learning rate, a
smaller last batch in every epoch (``drop_last=False``), an evaluation on held-out data
every ``--eval-every`` steps (``model.eval()`` under ``torch.no_grad()``), and with ``--bf16``
training under ``torch.autocast(bfloat16)`` while evaluating in float32.

Checkpoints and resuming (any world size: keys are the plain model's state-dict names):

    torchrun --nproc-per-node 2 examples/train.py --ckpt-dir ckpt --ckpt-every 10
    torchrun --nproc-per-node 2 examples/train.py --ckpt-dir ckpt --resume

``--meta`` builds the model on the meta device: no weights exist until each rank
materializes (and initializes) only its own stage, so no rank ever holds the whole model.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import resource
import sys
import time
from collections.abc import Callable
from itertools import islice
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import rannc_fx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the built-in models beside this script
from models import TransformerLM  # noqa: E402


def synthetic_lm_data(samples: int, seq: int, vocab: int, seed: int = 0) -> TensorDataset:
    """Sequences that count up from a random start by a random stride (mod vocab): the next
    token follows from the last two, so an LM can learn it and the loss falls."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (samples, 1), generator=g)
    stride = torch.randint(1, 8, (samples, 1), generator=g)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8, help="samples per rank per step (local batch)")
    p.add_argument("--layers", type=int, default=4, help="transformer layers")
    p.add_argument("--d-model", type=int, default=128, help="hidden size")
    p.add_argument("--seq", type=int, default=64, help="tokens per sample")
    p.add_argument("--vocab", type=int, default=2048, help="vocabulary size")
    p.add_argument("--device-memory-mib", type=int, default=24,
                   help="memory per device the plan must fit (0: the device's real size)")
    p.add_argument("--lr", type=float, default=1e-2, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=5,
                   help="linear learning-rate warm-up, then inverse-square-root decay")
    p.add_argument("--clip", type=float, default=1.0,
                   help="clip the whole model's gradient norm to this (0: no clipping)")
    p.add_argument("--bf16", action="store_true",
                   help="train under torch.autocast(bfloat16), evaluate without it")
    p.add_argument("--eval-every", type=int, default=10,
                   help="evaluate on held-out data every N steps (0: never)")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                   help="Adam (two state tensors per parameter) or plain SGD (none)")
    p.add_argument("--stages", type=int, default=None, help="force the stage count (default: searched)")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="force the micro-batch count (default: searched)")
    p.add_argument("--log-every", type=int, default=5, help="print the loss every N steps")
    p.add_argument("--ckpt-dir", type=Path, default=None,
                   help="save a torch.distributed.checkpoint to DIR/step_<steps done>")
    p.add_argument("--ckpt-every", type=int, default=10,
                   help="save every N steps, and after the last (with --ckpt-dir)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --ckpt-dir")
    p.add_argument("--meta", action="store_true",
                   help="build the model on the meta device: each rank allocates only its stage")
    p.add_argument("--report-memory", action="store_true",
                   help="print each rank's peak resident memory and its stage's bytes after "
                   "compile and at the end")
    p.add_argument("--verbose", action="store_true", help="log every compiler pass")
    args = p.parse_args()
    if args.resume and args.ckpt_dir is None:
        p.error("--resume needs --ckpt-dir")
    return args


def config(args: argparse.Namespace) -> rannc_fx.Config:
    """The options this script exposes; everything else keeps its default (docs/options.md)."""
    memory = args.device_memory_mib * 2**20 or None
    state = 2.0 if args.optimizer == "adam" else 0.0  # optimizer state bytes per parameter byte
    return rannc_fx.Config(stages=args.stages, micro_batches=args.micro_batches,
                           device_memory=memory, optimizer_state_factor=state,
                           autocast_dtype="bfloat16" if args.bf16 else None)


def gpt2_init(lm: TransformerLM) -> Callable[[nn.Module], None]:
    """``compile(init=...)``: how a module of this rank's stage is initialized when ``--meta``
    built it without weights: GPT-2's N(0, 0.02) for the tied embedding (under either of its
    modules), each other module's own reset."""

    def init(module: nn.Module) -> None:
        if module is lm.embed or module is lm.head:
            nn.init.normal_(module.weight, std=0.02)
        else:  # nn.MultiheadAttention names its reset _reset_parameters
            (getattr(module, "reset_parameters", None) or module._reset_parameters)()

    return init


# -- checkpoints: every rank saves and loads its own stage's part ----------------------------


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    step: int, epoch: int) -> None:
    """Every rank writes its stage's part; (step, epoch) are all the data position and random
    state a resume needs here: the sampler's order is a function of its seed and the epoch,
    and the model has no dropout (with dropout, each rank's RNG state would matter too, and
    it does not carry over to another world size)."""
    msd, osd = rannc_fx.get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd, "step": step, "epoch": epoch}, checkpoint_id=path)


def load_checkpoint(path: Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Fill this rank's stage and optimizer from ``path``; the (step, epoch) it was saved at."""
    msd, osd = rannc_fx.get_state_dict(model, optimizer)  # what this rank holds: what it loads
    state = {"model": msd, "optim": osd, "step": 0, "epoch": 0}
    dcp.load(state, checkpoint_id=path)
    rannc_fx.set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    return int(state["step"]), int(state["epoch"])


def newest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The complete checkpoint with the most steps, chosen by rank 0 for every rank. DCP
    writes ``.metadata`` last: a directory without it is a save that did not finish."""
    found = [None]
    if dist.get_rank() == 0:
        done = {int(p.name[5:]): p for p in ckpt_dir.glob("step_*")
                if p.name[5:].isdigit() and (p / ".metadata").is_file()}
        found = [done[max(done)] if done else None]
    dist.broadcast_object_list(found, src=0)
    return found[0]


def report_memory(model: rannc_fx.CompiledModel, when: str) -> None:
    """Rank 0 prints every rank's peak resident memory so far and its stage's own tensors."""
    rank = dist.get_rank()
    stages = model.plan.stages_of_rank(rank)  # one, or a lane's (interleaved, ZBV)
    tensors = {id(t): t for gm in model.stages for t in (*gm.parameters(), *gm.buffers())}
    held = sum(t.nbytes for t in tensors.values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    mine = (rank, "+".join(str(st.index) for st in stages), peak, held,
            sum(st.memory.params for st in stages), sum(st.memory.total for st in stages))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        for r, s, rss, nbytes, params, total in everyone:
            print(f"memory {when} rank {r} stage {s}: peak RSS {rss / 2**20:.1f} MiB, stage "
                  f"tensors {nbytes / 2**20:.1f} MiB (plan: params {params / 2**20:.1f} MiB, "
                  f"total {total / 2**20:.1f} MiB)", flush=True)


def evaluate(model: nn.Module, loader: DataLoader) -> float:
    """Mean loss over held-out batches: eval mode, no gradients, nothing kept for backward."""
    model.eval()
    with torch.no_grad():
        losses = [model(ids, labels=labels)["loss"].item() for ids, labels in loader]
    model.train()
    return sum(losses) / len(losses)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.manual_seed(0)  # the same initial weights on every rank

    # the same global batches for any world size that keeps batch * world: 64 full ones per
    # epoch, then a last one of 3 samples per rank (drop_last=False: every sample is seen)
    data = synthetic_lm_data((64 * args.batch + 3) * world, args.seq, args.vocab)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=False)
    held_out = synthetic_lm_data(4 * args.batch * world, args.seq, args.vocab, seed=1)
    eval_loader = DataLoader(held_out, batch_size=args.batch,
                             sampler=DistributedSampler(held_out, world, rank, shuffle=False))

    with torch.device("meta") if args.meta else contextlib.nullcontext():
        model = TransformerLM(args.vocab, args.d_model, layers=args.layers, seq=args.seq)
    if not args.meta:
        nn.init.normal_(model.embed.weight, std=0.02)  # GPT-2's init for the tied embedding
    optimizer: torch.optim.Optimizer = (
        torch.optim.Adam(model.parameters(), lr=args.lr) if args.optimizer == "adam"
        else torch.optim.SGD(model.parameters(), lr=args.lr)
    )
    warmup = max(1, args.warmup_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, (warmup / (s + 1)) ** 0.5)
    )
    input_ids, labels = next(iter(loader))  # an example batch: plan and place the stage now
    model = rannc_fx.compile(  # <- the one added line
        model, optimizer, config(args), example_args=(input_ids,),
        example_kwargs={"labels": labels}, init=gpt2_init(model),
    )
    if rank == 0:
        print(model.plan.summary(), flush=True)
    if args.report_memory:
        report_memory(model, "after compile")

    step, epoch = 0, 0
    if args.resume:
        path = newest_checkpoint(args.ckpt_dir)
        if path is not None:
            step, epoch = load_checkpoint(path, model, optimizer)
            for _ in range(step):  # the schedule is a function of the step
                schedule.step()
            if rank == 0:
                print(f"resumed from {path} at step {step}", flush=True)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    while step < args.steps:
        sampler.set_epoch(epoch)  # the epoch's order: the same after a resume
        done = step - epoch * len(loader)  # batches of this epoch before the checkpoint
        for input_ids, labels in islice(loader, done, None):
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=args.bf16):
                loss = model(input_ids, labels=labels)["loss"]
            loss.backward()
            if args.clip > 0:  # the whole model's norm, the same on every rank (not torch's)
                model.clip_grad_norm_(args.clip)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
                print(f"step {step:3d}  loss {loss.item():.4f}  "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)
            step += 1
            if args.eval_every and step % args.eval_every == 0:
                held_out_loss = evaluate(model, eval_loader)
                if rank == 0:
                    print(f"eval after step {step}: loss {held_out_loss:.4f}", flush=True)
            if args.ckpt_dir is not None and (step % args.ckpt_every == 0 or step == args.steps):
                save_checkpoint(args.ckpt_dir / f"step_{step}", model, optimizer, step, epoch)
            if step == args.steps:
                break
        epoch += 1
    if args.report_memory:
        report_memory(model, "at the end")
    dist.destroy_process_group()  # as torch.distributed recommends: no abort at exit


if __name__ == "__main__":
    main()
