"""Routing arithmetic, exhaustively on small numbers: every sample moves once, to the right rank."""

from __future__ import annotations

import itertools

import pytest
import torch

from rannc_fx.plan.plan import Plan
from rannc_fx.plan.values import ValueSpec
from rannc_fx.runtime.executor import check_outputs_routable
from rannc_fx.schedules import routing
from rannc_fx.schedules.routing import Transfer
from tests.dist_utils import make_plan, scalar, tensor


def _compositions(total: int, most_parts: int = 3) -> list[tuple[int, ...]]:
    out = []
    for parts in range(1, min(total, most_parts) + 1):
        for cut in itertools.combinations(range(1, total), parts - 1):
            b = (0, *cut, total)
            out.append(tuple(b[i + 1] - b[i] for i in range(parts)))
    return out


def _chain_plan(local: int, mbs: int, replicas: tuple[int, ...]) -> Plan:
    """x (batched) -> h_s between consecutive stages; skip from stage 0 to every later one;
    pos (unbatched) from stage 0 on; y (unbatched input) read by the last stage."""
    n = len(replicas)
    values: dict[str, ValueSpec] = {
        "x": tensor("x", (1, 4)),
        "y": tensor("y", (3,), batch_dim=None),
        "skip": tensor("skip", (2, 3), batch_dim=1, requires_grad=True),
        "pos": tensor("pos", (5,), batch_dim=None, requires_grad=True),
        "loss": scalar("loss"),
        "logits": tensor("logits", (1, 7)),
    }
    io: list[tuple[list[str], list[str]]] = []
    for s in range(n):
        values[f"h{s}"] = tensor(f"h{s}", (1, 6), requires_grad=True)
        ins = ["x"] if s == 0 else [f"h{s - 1}", "skip", "pos", "x"]
        outs = [f"h{s}"] if s < n - 1 else ["loss", "logits"]
        if s == 0 and n > 1:
            outs += ["skip", "pos"]
        io.append((ins + ["y"] if s == n - 1 else ins, outs))
    return make_plan(
        global_batch=local * sum(replicas),
        micro_batches=mbs,
        replicas=replicas,
        values=values,
        inputs=["x", "y"],
        stage_io=io,
        outputs=["loss", "logits"],
    )


def _configs():
    for world in range(1, 5):
        for local in (1, 2, 3):
            for mbs in range(1, 5):
                for reps in _compositions(world):
                    yield world, local, mbs, reps


def _valid(local: int, mbs: int, reps: tuple[int, ...]) -> bool:
    g = local * sum(reps)
    return mbs <= g and g // mbs >= max(reps)


ALL = list(_configs())
VALID = [c for c in ALL if _valid(*c[1:])]


def _cover(pieces: list[tuple[int, int]], span: tuple[int, int]) -> None:
    """The pieces are disjoint and their union is exactly ``span``."""
    pieces = sorted(pieces)
    assert pieces, span
    assert pieces[0][0] == span[0] and pieces[-1][1] == span[1]
    for (a, b), (c, d) in zip(pieces, pieces[1:], strict=False):
        assert a < b and b == c < d


def test_even_split():
    for n in range(13):
        for parts in range(1, 6):
            spans = routing.even_split(3, 3 + n, parts)
            sizes = [b - a for a, b in spans]
            assert len(spans) == parts and sum(sizes) == n
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
            assert all(spans[i][1] == spans[i + 1][0] for i in range(parts - 1))


@pytest.mark.parametrize("world,local,mbs,reps", VALID)
def test_spans_partition_the_batch(world, local, mbs, reps):
    plan = _chain_plan(local, mbs, reps)
    g = plan.global_batch
    assert routing.local_batch(plan) == local
    _cover([routing.rank_span(plan, j) for j in range(world)], (0, g))
    mb_spans = routing.microbatch_spans(g, mbs)
    _cover(mb_spans, (0, g))
    for st in plan.stages:
        total = 0.0
        for i, mb in enumerate(mb_spans):
            spans = [routing.replica_span(plan, st.index, k, i) for k in range(st.replicas)]
            _cover(spans, mb)
            sizes = [b - a for a, b in spans]
            assert max(sizes) - min(sizes) <= 1
            assert max(sizes) <= st.samples  # the plan's largest slice bounds every buffer
            total += sum(routing.share(plan, st.index, k, i) for k in range(st.replicas))
        assert total == pytest.approx(1.0)


@pytest.mark.parametrize("world,local,mbs,reps", VALID)
def test_every_sample_moves_once(world, local, mbs, reps):
    plan = _chain_plan(local, mbs, reps)
    owners = [routing.rank_span(plan, j) for j in range(world)]

    def holds(rank: int, span: tuple[int, int], a: int, b: int) -> bool:
        return span[0] <= a < b <= span[1]

    # graph inputs: only the batched x moves, from its owner, covering each replica's need
    tx = routing.input_transfers(plan)
    assert {t.value for t in tx} <= {"x"}
    for st in plan.stages:
        if "x" not in st.inputs:
            continue
        for i in range(mbs):
            for k, rank in enumerate(st.ranks):
                need = routing.replica_span(plan, st.index, k, i)
                mine = [t for t in tx if t.dst == rank and t.microbatch == i]
                _cover([(t.start, t.stop) for t in mine], need)
                assert all(holds(t.src, owners[t.src], t.start, t.stop) for t in mine)
                assert all(t.dst_base == need[0] and t.src_base == owners[t.src][0] for t in mine)

    # cut values: batched by overlap from the replica holding them; unbatched whole, k % r1
    for i in range(mbs):
        cuts = routing.cut_transfers(plan, i)
        assert not any(t.local for t in cuts)  # producer and consumer are different ranks
        for cv in plan.cut_values:
            prod = plan.stages[cv.producer]
            for c in cv.consumers:
                cons = plan.stages[c]
                for k2, dst in enumerate(cons.ranks):
                    mine = [t for t in cuts if t.value == cv.name and t.dst == dst]
                    if cv.spec.batch_dim is None:
                        assert [t.src for t in mine] == [prod.ranks[k2 % prod.replicas]]
                        assert not mine[0].batched
                        continue
                    need = routing.replica_span(plan, c, k2, i)
                    _cover([(t.start, t.stop) for t in mine], need)
                    for t in mine:
                        k1 = prod.ranks.index(t.src)
                        have = routing.replica_span(plan, prod.index, k1, i)
                        assert holds(t.src, have, t.start, t.stop) and t.src_base == have[0]
        grads = routing.grad_transfers(plan, i)
        assert grads == [t.reversed() for t in cuts]  # every cut value here needs a gradient
        assert all(g.kind == "grad" for g in grads)

    # model outputs: the batched logits go home to the owner of each sample, once
    out = routing.output_transfers(plan)
    assert {t.value for t in out} == {"logits"}
    for j in range(world):
        _cover([(t.start, t.stop) for t in out if t.dst == j], owners[j])
        assert all(t.dst_base == owners[j][0] for t in out if t.dst == j)


@pytest.mark.parametrize("world,local,mbs,reps", VALID)
def test_each_pair_posts_in_the_same_order(world, local, mbs, reps):
    """What rank a sends to b, phase by phase, is what b receives from a, in that order."""
    plan = _chain_plan(local, mbs, reps)
    routes = [routing.rank_routes(plan, r) for r in range(world)]

    def phases(rr: routing.RankRoutes) -> list[list[Transfer]]:
        return [*rr.inputs, *rr.cuts, rr.outputs, *reversed(rr.grads)]

    for a in range(world):
        for b in range(world):
            if a == b:
                continue
            sent = [[t for t in ph if t.src == a and t.dst == b] for ph in phases(routes[a])]
            got = [[t for t in ph if t.src == a and t.dst == b] for ph in phases(routes[b])]
            assert sent == got
    for r, rr in enumerate(routes):
        st = plan.stage_of_rank(r)
        for i in range(mbs):
            assert len(rr.args[i]) == len(st.inputs)
            assert all(t.dst == r for pieces in rr.args[i] for t in pieces)


@pytest.mark.parametrize("world,local,mbs,reps", VALID)
def test_order_is_canonical(world, local, mbs, reps):
    """Both ends see one list, so their per-pair message order agrees."""
    plan = _chain_plan(local, mbs, reps)
    rank_of = {r: (st.index, st.ranks.index(r)) for st in plan.stages for r in st.ranks}
    # inputs: micro-batch, input, consumer stage, consumer replica, owner rank
    keys = [(t.microbatch, t.slot, *rank_of[t.dst], t.src) for t in routing.input_transfers(plan)]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    for i in range(mbs):
        # cut values: value, consumer stage, consumer replica, producer replica
        keys = [(t.slot, *rank_of[t.dst], rank_of[t.src][1])
                for t in routing.cut_transfers(plan, i)]
        assert keys == sorted(keys) and len(set(keys)) == len(keys)
    # outputs: micro-batch, output, producer replica, owner rank
    keys = [(t.microbatch, t.slot, rank_of[t.src][1], t.dst)
            for t in routing.output_transfers(plan)]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)


EMPTY = [c for c in ALL if not _valid(*c[1:]) and c[2] <= c[1] * c[0]]


@pytest.mark.parametrize("world,local,mbs,reps", EMPTY)
def test_empty_replica_is_refused(world, local, mbs, reps):
    plan = _chain_plan(local, mbs, reps)
    with pytest.raises(ValueError, match="replicas, so one would get none"):
        for st in plan.stages:
            for i in range(mbs):
                routing.replica_span(plan, st.index, 0, i)


@pytest.mark.parametrize("rows,batch_dim", [(1, 0), (3, 0), (2, 1), (3, 2)])
@pytest.mark.parametrize("reps", [(1, 1), (2, 1), (1, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize("mbs", [1, 2, 3])
def test_rows_move_with_their_samples(rows, batch_dim, reps, mbs):
    """Simulate the moves on real tensors whose entries name their sample."""
    shape = [2, 2, 2]
    shape[batch_dim] = rows
    spec = tensor("h", shape, batch_dim=batch_dim, requires_grad=True)
    values = {"x": tensor("x", (1,)), "h": spec, "loss": scalar("loss")}
    plan = make_plan(
        global_batch=6 * sum(reps),
        micro_batches=mbs,
        replicas=reps,
        values=values,
        inputs=["x"],
        stage_io=[(["x"], ["h"]), (["h"], ["loss"])],
        outputs=["loss"],
    )

    def sample_ids(span: tuple[int, int]) -> torch.Tensor:
        """A tensor for ``span`` whose every entry is the global sample it belongs to."""
        n = span[1] - span[0]
        ids = torch.arange(span[0], span[1]).repeat_interleave(rows).to(torch.float32)
        view = [1, 1, 1]
        view[batch_dim] = n * rows
        return ids.view(view).expand(spec.shape_for(n)).contiguous()

    prod, cons = plan.stages
    for i in range(mbs):
        have = {
            r: sample_ids(routing.replica_span(plan, 0, k, i)) for k, r in enumerate(prod.ranks)
        }
        for k2, dst in enumerate(cons.ranks):
            need = routing.replica_span(plan, 1, k2, i)
            out = torch.full(spec.shape_for(need[1] - need[0]), -1.0)
            for t in routing.cut_transfers(plan, i):
                if t.dst != dst:
                    continue
                a, n = t.src_rows(spec)
                b, n2 = t.dst_rows(spec)
                assert n == n2
                out.narrow(batch_dim, b, n).copy_(have[t.src].narrow(batch_dim, a, n))
            torch.testing.assert_close(out, sample_ids(need))


def test_integers_move_nowhere_and_constants_are_refused():
    values = {
        "x": tensor("x", (1,)),
        "n": ValueSpec(name="n", kind="int", int_coeffs=((1, 0),)),
        "h": tensor("h", (1,)),
        "loss": scalar("loss"),
    }
    io = [(["x"], ["h", "n"]), (["h", "n"], ["loss"])]
    plan = make_plan(
        global_batch=4,
        micro_batches=2,
        replicas=(1, 1),
        values=values,
        inputs=["x"],
        stage_io=io,
        outputs=["loss"],
    )
    assert [t.value for t in routing.cut_transfers(plan, 0)] == ["h"]
    assert routing.grad_transfers(plan, 0) == []  # h does not require grad here

    const = dict(values, n=ValueSpec(name="n", kind="constant"))
    plan = make_plan(
        global_batch=4,
        micro_batches=2,
        replicas=(1, 1),
        values=const,
        inputs=["x"],
        stage_io=io,
        outputs=["loss"],
    )
    with pytest.raises(ValueError, match="constants inside each stage"):
        routing.cut_transfers(plan, 0)


def test_an_output_interleaved_in_an_unknown_layout_is_refused_when_the_batch_is_split():
    inter = tensor("out", (2, 4)).model_copy(update={"interleaved": True})
    values = {"x": tensor("x", (1, 4)), "out": inter, "loss": scalar("loss")}

    def plan(world: int, mbs: int, spec: ValueSpec) -> Plan:
        return make_plan(global_batch=4, micro_batches=mbs, replicas=(world,),
                         values=dict(values, out=spec), inputs=["x"],
                         stage_io=[(["x"], ["loss", "out"])], outputs=["loss", "out"])

    for world, mbs in ((2, 1), (1, 2)):
        with pytest.raises(ValueError, match=r"model output 1 \('out'.*interleaved.*"
                           r"out\.view\(seq, batch, -1\).*loss inside the model"):
            check_outputs_routable(plan(world, mbs, inter))
    check_outputs_routable(plan(1, 1, inter))  # one rank, one micro-batch: nothing is cut
    check_outputs_routable(plan(2, 2, inter.model_copy(update={"interleave": 2})))


def test_uneven_local_batch_is_refused():
    plan = _chain_plan(2, 1, (1, 1))
    bad = plan.model_copy(update={"global_batch": 5})
    with pytest.raises(ValueError, match="multiple of the world size"):
        routing.local_batch(bad)


def test_needs_grad_is_floating_and_flagged():
    assert routing.needs_grad(tensor("a", (1,), requires_grad=True))
    assert not routing.needs_grad(tensor("a", (1,), requires_grad=False))
    assert not routing.needs_grad(tensor("a", (1,), dtype="int64", requires_grad=True))
    assert routing.needs_grad(tensor("a", (1,), dtype="bfloat16", requires_grad=True))


def test_transfer_rows_and_reverse():
    spec = tensor("h", (4, 2), requires_grad=True)
    t = Transfer("cut", "h", 0, 0, src=0, dst=2, start=5, stop=7, src_base=3, dst_base=5)
    assert t.src_rows(spec) == (8, 8) and t.dst_rows(spec) == (0, 8)
    r = t.reversed()
    assert (r.src, r.dst, r.src_base, r.dst_base, r.kind) == (2, 0, 5, 3, "grad")
    assert r.src_rows(spec) == (0, 8) and r.dst_rows(spec) == (8, 8)


def test_the_module_docstring_example():
    plan = _chain_plan(4, 2, (2, 1))  # G = 12 on 3 ranks; stage 0 on ranks 0-1, stage 1 on 2

    def moves(ts: list[Transfer], value: str) -> list[tuple[int, int, int, int]]:
        return [
            (t.src, t.dst, t.start, t.stop) for t in ts if t.value == value and t.microbatch == 0
        ]

    x = [m for m in moves(routing.input_transfers(plan), "x") if m[1] in (0, 1)]
    assert x == [(0, 0, 0, 3), (0, 1, 3, 4), (1, 1, 4, 6)]
    assert moves(routing.cut_transfers(plan, 0), "h0") == [(0, 2, 0, 3), (1, 2, 3, 6)]
    assert moves(routing.output_transfers(plan), "logits") == [(2, 0, 0, 4), (2, 1, 4, 6)]
