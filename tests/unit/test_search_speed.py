"""The search's shortcuts change nothing: window minima, skipped stages and pruned DPs.

Each shortcut is checked against the plain computation it replaces, bit for bit: the range
minima of ``windows`` against the shifted rows, the DPs that read windows against those that
read one row per stage, and whole searches with every shortcut against searches without.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rannc_fx.search import (
    SearchSpace,
    candidates,
    needed_sizes,
    positions,
    samples_per_replica,
    scan,
    search_pass,
    windows,
)
from rannc_fx.search import context as run
from rannc_fx.search import dp_chain as kernel
from rannc_fx.search import dp_positioned as layers
from rannc_fx.search.dp_chain import Edges
from rannc_fx.search.dp_positioned import Entries
from rannc_fx.search.windows import RangeMin, find_runs
from tests.unit.test_search import outcome, random_case, random_table


def _shifted(row: np.ndarray, prev: np.ndarray, width: int, r: int) -> np.ndarray:
    """(layers, width): row at (prev[b], n - r), inf where that is no state."""
    blocks = row.reshape(-1, width)
    out = np.full((len(prev), width), np.inf)
    for b, p in enumerate(prev):
        if p >= 0 and r < width:
            out[b, r:] = blocks[p, : width - r]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_window_minima_are_the_minima_of_the_shifted_rows(seed: int) -> None:
    rng = np.random.default_rng(seed)
    nb, width, pad, ring = int(rng.integers(1, 4)), int(rng.integers(1, 12)), 16, 3
    prev = rng.integers(-1, nb, nb)
    tables = RangeMin(ring=ring, prev=prev, width=width, pad=pad, levels=5)
    rows = {}
    for i in range(7):
        row = rng.uniform(0, 10, nb * width)
        row[rng.uniform(size=row.size) < 0.2] = np.inf
        rows[i] = row
        tables.set(i, row)
        lo = rng.integers(1, pad + 1, 20)
        hi = np.minimum(lo + rng.integers(0, 16, 20), pad)
        start = rng.integers(max(0, i - ring + 1), i + 1, 20)
        size = hi - lo + 1
        runs = windows.Runs(start, lo, hi, np.zeros(20, np.int64), np.zeros(2, np.int64),
                            np.frexp(size.astype(float))[1] - 1)
        got = tables.window(runs, 0, 20)
        for k in range(20):
            want = np.min([_shifted(rows[int(start[k])], prev, width, r)
                           for r in range(int(lo[k]), int(hi[k]) + 1)], axis=0)
            assert np.array_equal(got[k], want)


def test_runs_cover_every_stage_once_with_equal_keys() -> None:
    rng = np.random.default_rng(0)
    n, B = 400, 6
    end = np.sort(rng.integers(1, B + 1, n))
    start = np.array([int(rng.integers(0, e)) for e in end])
    reps = rng.integers(1, 9, n)
    key = rng.integers(0, 2, n).astype(float)
    kind = rng.integers(0, 2, n)
    idx = np.flatnonzero(rng.uniform(size=n) < 0.8)
    for longest in (None, 2):
        runs, ends = find_runs(idx, end, start, reps, (key,), B, kind=kind, longest=longest)
        covered = []
        for k in range(len(runs.start)):
            members = [x for x in idx if end[x] == ends[k] and start[x] == runs.start[k]
                       and kind[x] == kind[runs.first[k]] and key[x] == key[runs.first[k]]
                       and runs.lo[k] <= reps[x] <= runs.hi[k]]
            assert sorted({int(reps[x]) for x in members}) == list(
                range(int(runs.lo[k]), int(runs.hi[k]) + 1))
            assert longest is None or runs.hi[k] - runs.lo[k] < longest
            covered += members
        # duplicates (same start, end, reps, kind, key) read one window: each counted once
        assert set(covered) == set(idx.tolist())
        assert (np.diff(ends) >= 0).all()
        assert all(runs.groups[b] <= k < runs.groups[b + 1] for k, b in enumerate(ends))


def _edges(rng: np.random.Generator, B: int, W: int, G: int, m: int) -> Edges:
    """Random stages whose t depends on the samples per replica alone (long runs)."""
    per_q = rng.uniform(0.1, 1.0, (B + 1, B + 1, G + 1))
    rows = []
    for j in range(1, B + 1):
        for i in range(j):
            for r in range(1, W + 1):
                if r * m <= G and rng.uniform() < 0.9:
                    q = samples_per_replica(G, m, r)
                    rows.append((i, j, r, per_q[i, j, q], per_q[i, j, q] + 0.01 * r))
    a = np.array(rows)
    small = np.int32
    return Edges(a[:, 0].astype(small), a[:, 1].astype(small), a[:, 2].astype(small),
                 a[:, 3], a[:, 4], np.zeros(len(a)), np.zeros(len(a), bool))


@pytest.mark.parametrize("stages", [None, 3])
def test_dp_over_windows_equals_dp_over_rows(monkeypatch: pytest.MonkeyPatch,
                                             stages: int | None) -> None:
    monkeypatch.setattr(windows, "MEAN_RUN", 0)  # windows even for runs of one
    rng = np.random.default_rng(1)
    B, W, G, m = 6, 24, 48, 2
    e = _edges(rng, B, W, G, m)
    space = SearchSpace(world_size=W, global_batch=G, memory_budget=1.0, link_bandwidth=1.0,
                        stages=stages)
    st = kernel.build_states(space)
    plain = dataclasses.replace(st, prev=None)
    lo = kernel.groups(e.end, B)
    hi = lo[:-1] + (lo[1:] - lo[:-1]) // 2  # the first half of each end block's stages
    for w, bottleneck, h in ((e.t, False, None), (e.u, True, None), (e.t, False, hi)):
        assert kernel._windows(e, w, st, B, lo[1:] if h is None else h) is not None
        D, shifted = kernel.forward(e, w, st, B, bottleneck=bottleneck, hi=h)
        D0, shifted0 = kernel.forward(e, w, plain, B, bottleneck=bottleneck, hi=h)
        assert np.array_equal(D, D0)
        if np.isfinite(D[B, st.final]):
            assert kernel.backtrack(e, w, shifted, st, B, bottleneck=bottleneck, hi=h) == \
                kernel.backtrack(e, w, shifted0, plain, B, bottleneck=bottleneck, hi=h)


@pytest.mark.parametrize("stages", [None, 3])
def test_layered_dp_over_windows_equals_dp_over_rows(monkeypatch: pytest.MonkeyPatch,
                                                     stages: int | None) -> None:
    monkeypatch.setattr(windows, "MEAN_RUN", 0)
    rng = np.random.default_rng(2)
    B, W, G, m = 5, 16, 64, 4
    e = _edges(rng, B, W, G, m)
    n = len(e.t)
    rho = rng.integers(0, 2, n).astype(bool)
    q = np.array([samples_per_replica(G, m, int(r)) for r in e.reps])
    fit = np.where(q > 4, 1 + q % 3, m)  # in-flight limits by size, as memory gives them
    ent = Entries(e.start, e.end, e.reps, e.t + rho, e.u, rho, np.where(rho, 1, 1), fit,
                  np.arange(n))
    space = SearchSpace(world_size=W, global_batch=G, memory_budget=1.0, link_bandwidth=1.0,
                        stages=stages)
    L = layers.build_layers(space, 3 if stages is None else stages)
    depth = np.minimum(L.depth, m)

    def weights(idx: np.ndarray) -> np.ndarray:
        return np.where(ent.valid(idx, depth), ent.t[idx, None], np.inf)

    for bottleneck in (False, True):
        V = layers.forward(ent, weights, L, B, bottleneck=bottleneck,
                           keys=(ent.t, ent.lo, ent.fit))
        V0 = layers.forward(ent, weights, L, B, bottleneck=bottleneck)
        assert np.array_equal(V, V0)
        assert np.isfinite(V[B, L.final])
        assert layers.backtrack(ent, weights, V, L, B, bottleneck=bottleneck) == \
            layers.backtrack(ent, weights, V0, L, B, bottleneck=bottleneck)


def _plain_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """Undo every shortcut: rows instead of windows, every stage, unpruned bottleneck DPs."""
    monkeypatch.setattr(kernel, "runs_and_tables", lambda *a, **k: None)
    monkeypatch.setattr(layers, "runs_and_tables", lambda *a, **k: None)
    monkeypatch.setattr(candidates.Candidates, "_live", lambda self: np.arange(len(self.iu)))
    least = run.least_bottleneck
    for user in (scan, positions):  # where the flat and the layered scans call it
        monkeypatch.setattr(user, "least_bottleneck",
                            lambda r, e, s_inf, prune: least(r, e, s_inf, prune=False))


def _key(res: object) -> object:
    if res is None:
        return None
    return (res.stages, res.micro_batches, res.schedule, res.evaluation)


@pytest.mark.parametrize("seed", range(3))
def test_shortcuts_find_the_plan_the_plain_search_finds(seed: int) -> None:
    """Random spaces up to 24 ranks (forced stages and replicas, schedules, recomputation,
    tight budgets): the same plan and step, bit for bit, with and without the shortcuts."""
    rng = np.random.default_rng(300 + seed)
    cases = [random_case(rng, 8, 24, tight=0.5) for _ in range(25)]
    fast = [outcome(search_pass, t, s) for t, s in cases]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(windows, "MEAN_RUN", 0)
        forced = [outcome(search_pass, t, s) for t, s in cases]
        mp.setattr(windows, "_TABLES", 300)  # fewer sparse-table levels, as big searches get
        few_levels = [outcome(search_pass, t, s) for t, s in cases]
    with pytest.MonkeyPatch.context() as mp:
        _plain_search(mp)
        plain = [outcome(search_pass, t, s) for t, s in cases]
    assert sum(p is not None for p in plain) >= 8
    for a, b, d, c in zip(fast, forced, few_levels, plain, strict=True):
        assert _key(a) == _key(c) and _key(b) == _key(c) and _key(d) == _key(c)


def test_stages_that_fit_nowhere_are_never_edges() -> None:
    """The stages ``Candidates._live`` drops make no edge of any m, under either schedule."""
    rng = np.random.default_rng(5)
    space = SearchSpace(world_size=8, global_batch=32, memory_budget=3.0, link_bandwidth=1.0,
                        micro_batches=(1, 2, 4))
    table = random_table(rng, 12, needed_sizes(space))
    st = kernel.build_states(space)
    c = candidates.Candidates(table, space, st)
    assert 0 < len(c.live) < len(c.iu)
    every = candidates.Candidates(table, space, st)
    object.__setattr__(every, "live", np.arange(len(every.iu)))
    for m in (1, 2, 4):
        a, b = c.gpipe(m), every.gpipe(m)
        assert a is not None and b is not None
        for f in ("start", "end", "reps", "t", "u", "mem", "kind"):
            assert np.array_equal(getattr(a, f), getattr(b, f))
        fa, fb = c.one_f_one_b(m), every.one_f_one_b(m)
        assert (fa is None) == (fb is None)
        if fa is not None and fb is not None:
            assert np.array_equal(fa.t, fb.t) and np.array_equal(fa.fit, fb.fit)
            assert np.array_equal(fa.edges.start, fb.edges.start)
