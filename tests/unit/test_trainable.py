"""ZeRO owners that stay put when parameters start or stop training, and the parameters that
feed a stage's output (``runtime/trainable.py``). Trainability on ranks:
``distributed/test_trainable.py``."""

from __future__ import annotations

import torch
from torch import fx, nn

from rannc_fx.runtime.trainable import feeders
from rannc_fx.runtime.zero import Owners, owners


def test_owners_keep_their_parameters_and_give_new_ones_to_the_least_loaded() -> None:
    ps = [nn.Parameter(torch.zeros(n)) for n in (10, 3, 7, 7)]
    got = Owners(3)
    first = got.assign(ps)
    assert [first[id(p)] for p in ps] == owners([10, 3, 7, 7], 3)  # the first is owned_by
    before = dict(first)
    later = [nn.Parameter(torch.zeros(n)) for n in (4, 9)]
    after = got.assign([*ps[:2], *later])  # some stopped training, two started
    assert {k: after[k] for k in before} == before  # nobody's state moves
    # loads 10 | 3 + 7 | 7: the 9 goes to replica 2 (7), then the 4 to replica 0 or 1 (10)
    assert after[id(later[1])] == 2 and after[id(later[0])] == 0
    assert got.assign(ps) == after  # the same parameters again: nothing changes


class _Detached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.a(x)
        return self.b(h.detach()), h * self.scale, x + 1


def test_feeders_are_the_parameters_behind_an_output_up_to_a_detach() -> None:
    gm = fx.symbolic_trace(_Detached())
    got = {pos: sorted(n for n, _ in ps) for pos, ps in feeders(gm, [0, 1, 2]).items()}
    assert got == {0: ["b.bias", "b.weight"], 1: ["a.bias", "a.weight", "scale"]}
