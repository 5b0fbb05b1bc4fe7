"""Which input casts capture trusts (``capture/input_casts.py``): a cast that is the input's one
use. Calls with other dtypes on ranks: ``distributed/test_input_dtypes.py``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rannc_fx.capture.capture import capture_pass
from rannc_fx.capture.input_casts import input_casts


class Casts(nn.Module):
    """Casts its features and labels itself (no-ops on the planned dtypes); reads its token
    ids as they are."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.a = nn.Linear(10, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x.float()
        h = torch.cat([x, self.emb(ids).mean(1)], -1)
        h = self.b(self.a(h).tanh()).tanh()
        return F.cross_entropy(self.c(h), y.long())


def _batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 6, generator=g), torch.randint(0, 10, (n, 3), generator=g),
            torch.randint(0, 5, (n,), generator=g))


def test_only_a_cast_that_is_the_inputs_one_use_converts():
    x, ids, y = _batch(4, 0)
    fx_graph = capture_pass(Casts(), (x, ids, y), tracer="fx")
    assert input_casts(fx_graph.gm) == {0: torch.float32, 2: torch.int64}

    class Twice(nn.Module):  # reads x itself too: converting it would change that read
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.float() + x

    assert input_casts(capture_pass(Twice(), (x,), tracer="fx").gm) == {}
    # torch.export reads `x.float()`'s result for `x` too: none of its casts is trusted
    assert input_casts(capture_pass(Casts(), (x, ids, y), tracer="export").gm) == {}
