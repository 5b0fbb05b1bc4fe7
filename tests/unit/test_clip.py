"""Which rank counts each parameter in ``CompiledModel.clip_grad_norm_``'s norm
(``runtime/clip.counted_by``): replicas and tied parameters once. On ranks:
``distributed/test_clip.py``."""

from __future__ import annotations

from rannc_fx.runtime.clip import counted_by
from tests.dist_utils import make_plan, scalar, tensor


def test_each_parameter_counted_by_exactly_one_rank():
    """Replicas (2, 1, 3), a parameter tied between stages 0 and 2, one between 1 and 2."""
    v = {"x": tensor("x", (4,)), "h": tensor("h", (4,)), "k": tensor("k", (4,)),
         "loss": scalar("loss")}  # fmt: skip
    plan = make_plan(
        global_batch=12, micro_batches=1, replicas=(2, 1, 3), values=v, inputs=["x"],
        stage_io=[(["x"], ["h"]), (["h"], ["k"]), (["k"], ["loss"])], outputs=["loss"],
        shared=[("embed.weight", (0, 2)), ("norm.weight", (1, 2))],
    )  # fmt: skip
    counts = [counted_by(plan, r) for r in range(plan.world_size)]
    assert [c.own for c in counts] == [True, False, True, True, False, False]
    assert [sorted(c.shared) for c in counts] == [[0], [], [1], [], [], []]
    # ZBV, lanes (0, 3) and (1, 2) with replicas 2 and 1: the weight tied between stages 0 and
    # 3 is counted once, by rank 0
    v4 = {**v, "j": tensor("j", (4,))}
    zbv = make_plan(
        global_batch=12, micro_batches=1, replicas=(2, 1, 1, 2), values=v4, inputs=["x"],
        stage_io=[(["x"], ["h"]), (["h"], ["k"]), (["k"], ["j"]), (["j"], ["loss"])],
        outputs=["loss"], shared=[("embed.weight", (0, 3))], schedule="zbv", virtual_stages=2,
    )  # fmt: skip
    counts = [counted_by(zbv, r) for r in range(zbv.world_size)]
    assert [c.own for c in counts] == [True, False, True]
    assert [sorted(c.shared) for c in counts] == [[0], [], []]
