"""Built-in models with synthetic batches: the main job's default model and the test zoo.

Each ``*_example`` factory returns ``(model, args, kwargs)``, the form the ``plan`` CLI
takes (``python -m rannc_fx plan examples.models:gpt_example``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MLP",
    "ResCNN",
    "TransformerLM",
    "cnn_example",
    "gpt_example",
    "mlp_example",
]

Example = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]


class MLP(nn.Module):
    """Linear-ReLU layers and a cross-entropy head: ``model(x, y) -> loss``."""

    def __init__(self, d_in: int = 32, hidden: int = 64, depth: int = 4, classes: int = 10):
        super().__init__()
        dims = [d_in] + [hidden] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:], strict=False))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.relu(layer(x))
        return F.cross_entropy(self.head(x), y)


class _ResBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.short = (
            nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
            if stride != 1 or c_in != c_out
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.short(x))


class ResCNN(nn.Module):
    """A small ResNet: conv stem, residual blocks with BatchNorm, pooled linear head."""

    def __init__(self, channels: tuple[int, ...] = (8, 16, 32), classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels[0], 3, 1, 1, bias=False), nn.BatchNorm2d(channels[0]), nn.ReLU()
        )
        blocks = []
        c = channels[0]
        for i, c_out in enumerate(channels):
            blocks.append(_ResBlock(c, c_out, 1 if i == 0 else 2))
            c = c_out
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(x))
        logits = self.head(h.mean(dim=(2, 3)))
        return F.cross_entropy(logits, y)


class TransformerLM(nn.Module):
    """A GPT-style LM on ``nn.TransformerEncoder`` with the embedding tied to the head.

    ``model(input_ids, labels=labels)`` returns ``{"loss": ..., "logits": ...}``; without
    labels it returns the logits alone.
    """

    def __init__(
        self,
        vocab: int = 256,
        d_model: int = 64,
        heads: int = 4,
        layers: int = 2,
        seq: int = 32,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq, d_model))
        layer = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=dropout, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """This module's own tensors (the layers have theirs): also what a model built on the
        meta device is materialized with, stage by stage."""
        nn.init.normal_(self.pos, std=0.02)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        s = input_ids.shape[1]
        h = self.embed(input_ids) + self.pos[:s]
        # made for this length (slicing a (seq, seq) buffer in two dimensions would pin the
        # length for torch.export); is_causal spares the encoder a data-dependent mask check
        mask = nn.Transformer.generate_square_subsequent_mask(s, device=h.device, dtype=h.dtype)
        h = self.encoder(h, mask=mask, is_causal=True)
        logits = self.head(self.norm(h))
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def mlp_example(batch: int = 16, **kw: Any) -> Example:
    model = MLP(**kw)
    first: nn.Linear = model.layers[0]  # type: ignore[assignment]
    d_in = first.in_features
    classes = model.head.out_features
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, d_in, generator=g)
    y = torch.randint(0, classes, (batch,), generator=g)
    return model, (x, y), {}


def cnn_example(batch: int = 8, image: int = 16, **kw: Any) -> Example:
    model = ResCNN(**kw)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, image, image, generator=g)
    y = torch.randint(0, model.head.out_features, (batch,), generator=g)
    return model, (x, y), {}


def gpt_example(batch: int = 8, **kw: Any) -> Example:
    """The default model of the main job: a tied-embedding Transformer LM."""
    model = TransformerLM(**kw)
    seq = int(model.pos.shape[0])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.embed.num_embeddings, (batch, seq), generator=g)
    return model, (ids,), {"labels": torch.roll(ids, -1, dims=1)}
