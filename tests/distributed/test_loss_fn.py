"""Losses no tracer captures (a range check on the labels, ``masked_select``, ``F.ctc_loss``,
``.tolist()``) train like one process: passed as ``compile(..., loss_fn=...)``, or left in the
model as a criterion module that capture keeps whole and runs eagerly, or written in the
model's own forward, whose statements from the failing one on run eagerly after the body."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from tests.harness import Run, optimizer, train_against_reference
from tests.unit.test_loss_fn import Inline, Mlp, WithCriterion, masked_nll

LOCAL = 6  # samples per rank
STEPS = 3
ADAM = optimizer(torch.optim.Adam, lr=0.01)


def ctc(logits: torch.Tensor, targets: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """CTC over the whole time axis; a mean over samples (each divided by its length)."""
    if targets.max() >= logits.shape[-1]:
        raise ValueError("a target is not a class of the logits")
    log_probs = logits.log_softmax(-1).transpose(0, 1)  # (time, batch, classes)
    frames = torch.full((logits.shape[0],), logits.shape[1], dtype=torch.long)
    return F.ctc_loss(log_probs, targets, frames, lengths, zero_infinity=True)


def dice_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy plus a Dice loss over the batch's pixels of each class present in it."""
    probs = logits.softmax(1)
    dice = []
    for c in torch.unique(target).tolist():
        p, t = probs[:, c], (target == c).to(probs.dtype)
        dice.append(1 - 2 * (p * t).sum() / (p.sum() + t.sum()))
    return F.cross_entropy(logits, target) + torch.stack(dice).mean()


class Speech(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 16, 3, padding=1)
        self.rnn_free = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU())
        self.head = nn.Linear(16, 6)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:  # (batch, time, 4)
        h = self.conv(feats.transpose(1, 2)).transpose(1, 2)
        return self.head(self.rnn_free(h))


class Seg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1, stride=2), nn.ReLU())
        self.up = nn.Sequential(nn.ConvTranspose2d(8, 8, 2, stride=2), nn.ReLU(),
                                nn.Conv2d(8, 4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


def _data(name: str, n: int, seed: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    if name == "masked":
        return torch.randn(n, 6, generator=g), (torch.randint(0, 5, (n,), generator=g),)
    if name == "ctc":
        lengths = torch.randint(1, 4, (n,), generator=g)
        return torch.randn(n, 10, 4, generator=g), (
            torch.randint(1, 6, (n, 3), generator=g), lengths)
    return torch.randn(n, 3, 8, 8, generator=g), (torch.randint(0, 4, (n, 8, 8), generator=g),)


BODIES: dict[str, tuple[type[nn.Module], Callable[..., torch.Tensor]]] = {
    "masked": (Mlp, masked_nll), "ctc": (Speech, ctc), "dice": (Seg, dice_ce),
}


TOL = dict(rtol=1e-5, atol=1e-6)


def _model(name: str, way: str) -> nn.Module:
    body_cls, loss = BODIES[name]
    body = body_cls()
    return {"loss_fn": body, "criterion": WithCriterion(body, loss),
            "inline": Inline(body, loss)}[way]


def _steps(name: str, way: str, run: Run) -> tuple[list[tuple[float, float]], set[str]]:
    """``STEPS`` Adam steps, the loss given to compile as ``loss_fn`` (the targets passed as
    ``target=``) or kept in the model; each step's (loss, one process's), the modules held."""
    loss = BODIES[name][1]
    cm, ref, mine = run.cm, run.ref, slice(run.rank * LOCAL, (run.rank + 1) * LOCAL)
    out = []
    for step in range(STEPS):
        x, targets = _data(name, LOCAL * run.world, step)
        local = tuple(t[mine] for t in targets)
        if way == "loss_fn":
            got = cm(x[mine], target=local if len(local) > 1 else local[0])
            want = loss(ref(x), *targets)
        else:
            got, want = cm(x[mine], *local), ref(x, *targets)
        run.compare(got, want)
        run.backward(got, want)
        run.step()
        out.append((float(got), float(want)))
    assert cm.plan.tracer == run.spec.config["tracer"]
    return out, {n for gm in cm.stages for n, _ in gm.named_modules()}


@pytest.mark.parametrize("name,way,tracer", [
    ("masked", "loss_fn", "fx"), ("masked", "criterion", "export"),
    ("ctc", "loss_fn", "export"), ("ctc", "criterion", "fx"),
    ("dice", "loss_fn", "fx"), ("dice", "criterion", "export"),
    ("masked", "inline", "fx"), ("ctc", "inline", "export"),
])
def test_a_loss_capture_cannot_trace_trains_like_one_process(name, way, tracer):
    held: set[str] = set()
    got = train_against_reference(
        functools.partial(_model, name, way), dict(tracer=tracer, replicas=(1, 2),
                                                   micro_batches=2), 3,
        optimizer=ADAM, tol=TOL, params=False, example=False,
        compile_kw=dict(loss_fn=BODIES[name][1] if way == "loss_fn" else None),
        loop=functools.partial(_steps, name, way), wall_s=240.0)
    for losses, modules in (t.extra for t in got):
        held |= modules
        for got, want in losses:
            assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the data-dependent code runs eagerly as one node: the criterion, or the forward's pieces
    eager = {"loss_fn": {"loss_fn"}, "criterion": {"criterion"},
             "inline": {"forward_pre", "forward_post"}}[way]
    assert eager <= {name.rpartition(".")[2] for name in held}, held  # a stage's or the tail's


class Tagger(nn.Module):
    """A token tagger on a transformers encoder, its loss written in its own forward: a mean
    over the tokens whose label is not -100, after a range check of the labels."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            vocab_size=100, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.encoder = transformers.BertModel(config, add_pooling_layer=False)
        self.head = nn.Linear(32, 5)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.encoder(input_ids).last_hidden_state
        logits = self.head(h)
        keep = labels != -100
        if labels[keep].max() >= logits.shape[-1]:
            raise ValueError("a label is not a class of the head")
        return F.cross_entropy(logits[keep], labels[keep])


def _tagger_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids, labels = torch.randint(0, 100, (n, 8), generator=g), torch.randint(0, 5, (n, 8), generator=g)
    labels[torch.rand(n, 8, generator=g) < 0.3] = -100
    return ids, labels


def _tagger_steps(run: Run) -> tuple[list[tuple[float, float]], str]:
    """``STEPS`` Adam steps and an evaluation; each (loss, one process's), the tracer."""
    cm, ref, mine = run.cm, run.ref, slice(run.rank * 4, (run.rank + 1) * 4)
    out = []
    for step in range(STEPS):
        ids, labels = _tagger_batch(4 * run.world, step)
        got, want = cm(ids[mine], labels[mine]), ref(ids, labels)
        run.compare(got, want)
        run.backward(got, want)
        run.step()
        out.append((float(got), float(want)))
    cm.eval()
    ref.eval()
    ids, labels = _tagger_batch(4 * run.world, 99)
    with torch.no_grad():
        out.append((float(cm(ids[mine], labels[mine])), float(ref(ids, labels))))
    return out, cm.plan.tracer


def test_a_loss_in_the_forward_itself_runs_eagerly_after_the_pipelined_body():
    """An unmodified model: capture fails at the labels' range check in its forward, and the
    forward's statements from there on run eagerly, once a step, after the traced encoder."""
    got = train_against_reference(Tagger, dict(replicas=(1, 2), micro_batches=2), 3,
                                  optimizer=ADAM, tol=TOL, params=False, example=False,
                                  loop=_tagger_steps, wall_s=240.0)
    for losses, tracer in (t.extra for t in got):
        assert tracer == "export"  # transformers' encoder: the one a new user gets ("auto")
        for got, want in losses:
            assert_close(got, want, rtol=1e-5, atol=1e-6)
