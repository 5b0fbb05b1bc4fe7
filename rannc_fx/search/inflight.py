"""Under 1F1B, how many micro-batches a stage may hold in flight as each of its variants,
and the view of one micro-batch count the layered DP works on (``Positioned``: per edge
every variant's t, u and the positions where it is the one the stage runs, under 1F1B or
ZB-H1).

This module imports numpy only (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..schedules.kinds import ONE_F_ONE_B
from .dp_chain import Edges
from .dp_positioned import Entries
from .terms import SELECTIVE, StageTerms, reruns
from .variants import VARIANTS

__all__ = ["Positioned", "depth_limit", "max_in_flight"]


def max_in_flight(terms: StageTerms, recompute: int, m: int, budget: float,
                  saved: np.ndarray | float = 0.0, transient: np.ndarray | float = 0.0,
                  host: bool = False, full: np.ndarray | None = None) -> np.ndarray:
    """The largest n in [0, m] with ``terms.memory(n, recompute, transient) - saved <=
    budget`` (0: none; ``recompute``: rho, 0 to 3; ``saved``: ``variants.state_saved``,
    -inf where the variant cannot be; ``transient``: ``variants.after_transient``).

    Memory grows with n, so a division estimates the limit and the formula itself settles
    it: the limit agrees with ``evaluate`` to the last bit.
    """
    def mem(n: np.ndarray | int) -> np.ndarray:
        return terms.memory(n, recompute, transient, host, full) - saved

    per = (terms.cuts - terms.cout if reruns(recompute) else terms.keep + terms.cuts
           if recompute == SELECTIVE else terms.held(0) + terms.cuts)
    one = mem(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        est = np.floor(1 + (budget - one) / per)
    est = np.where(per > 0, est, np.where(one <= budget, m, 0))
    n = np.clip(np.nan_to_num(est, nan=0.0), 0, m).astype(np.int64)
    while True:
        up = (n < m) & (mem(n + 1) <= budget)
        down = (n > 0) & (mem(n) > budget)
        if not (up.any() or down.any()):
            return n
        n += up.astype(np.int64) - down.astype(np.int64)


def depth_limit(fit: np.ndarray, lo: np.ndarray, m: int) -> int:
    """D: 1 + the largest in-flight limit below m of variants valid for n in [lo, fit].

    From d = D on, n = min(m, d) is past every limit below m, so nothing changes any more;
    D = 1: every variant runs alike at every position (as under GPipe).
    """
    lim = np.concatenate((fit, lo - 1))
    lim = lim[lim < m]
    return 1 + int(lim.max()) if len(lim) else 1


@dataclass(frozen=True)
class Positioned:
    """One m under a schedule where a stage's variant depends on its position: the relaxed
    edges, and per edge every variant's t, u and the positions where the stage runs it,
    x in [lo, fit] (fit 0: none; -1: the variant is not allowed, its t and u meaningless),
    x = min(held, d) for a stage d from the end.

    1F1B (``held`` = m): x is the stage's in-flight count, and variant v (``VARIANTS``) is
    valid where the variants before it do not fit: x in [1 + max(fit[:v]), fit[v]].
    ZB-H1 (``schedule`` "zbh1", ``held`` = min(m, S): ``zb_view.ZeroBubble``) gives
    ``lo`` (``first``), its columns only its variants (``kinds``).
    """

    m: int
    edges: Edges
    t: np.ndarray  # (edges, len(VARIANTS)), or (edges, len(kinds))
    u: np.ndarray
    fit: np.ndarray
    held: int = 0  # 0: m
    schedule: str = ONE_F_ONE_B.name
    first: np.ndarray | None = None  # lo where given
    stages: int = 0  # the view's plans have this many stages (0: any; ZB-H1's, held = S)
    kinds: tuple[int, ...] = ()  # the variants (``VARIANTS`` indices) of t's columns; (): all

    def kind(self, col: np.ndarray) -> np.ndarray:
        """The variants of columns ``col``."""
        return np.asarray(self.kinds)[col] if self.kinds else np.asarray(col)

    def column(self, kind: np.ndarray) -> np.ndarray:
        """The columns of variants ``kind``."""
        if not self.kinds:
            return np.asarray(kind)
        where = np.zeros(len(VARIANTS), np.int64)
        where[list(self.kinds)] = np.arange(len(self.kinds))
        return where[np.asarray(kind, np.int64)]

    @property
    def limit(self) -> int:
        return self.held or self.m

    @property
    def lo(self) -> np.ndarray:
        if self.first is not None:
            return self.first
        before = np.maximum.accumulate(np.maximum(self.fit, 0), axis=1)
        return np.concatenate((np.ones((len(self.fit), 1), np.int64), before[:, :-1] + 1),
                              axis=1)

    @property
    def exists(self) -> np.ndarray:
        """(edges, variants): whether the variant is valid anywhere."""
        return self.fit >= self.lo

    def depth(self) -> int:
        ok = self.exists
        return depth_limit(self.fit[ok], self.lo[ok], self.limit)

    def entries(self, mask: np.ndarray) -> Entries:
        """The variants in ``mask`` (edges, variants), sorted by (end, reps, start, variant)."""
        e, lo = self.edges, self.lo
        x, v = np.nonzero(mask & self.exists)
        order = np.lexsort((v, e.start[x], e.via[x], e.end[x]))
        x, v = x[order], v[order]
        return Entries(e.start[x], e.end[x], e.reps[x], self.t[x, v], self.u[x, v],
                       self.kind(v), lo[x, v], self.fit[x, v], x,
                       None if e.move is None else e.move[x])

    def exact(self, path: list[int]) -> tuple[list[float], list[float], list[int],
                                               bool] | None:
        """t, u and variant of the stages of ``path`` at their true positions, and whether
        every one fits at n = m (so GPipe runs them alike: 1F1B only); None if one does not
        fit, or if the view is of plans of another stage count (``stages``: ZB-H1's queue of
        W is there or not by it)."""
        ts, us, kinds, alike = [], [], [], self.schedule == ONE_F_ONE_B.name
        if self.schedule != ONE_F_ONE_B.name and min(self.m, len(path)) > self.limit:
            return None  # holds more than the view counts
        if self.stages and len(path) != self.stages:
            return None  # the view's t and u are those of plans of its stage count alone
        lo = self.lo
        for s, x in enumerate(path):
            n = min(self.limit, len(path) - s)
            col = next((v for v in range(self.t.shape[1]) if lo[x, v] <= n <= self.fit[x, v]),
                       None)
            if col is None:
                return None
            ts.append(float(self.t[x, col]))
            us.append(float(self.u[x, col]))
            kinds.append(int(self.kind(np.array(col))))
            alike &= bool(self.fit[x, col] >= self.m)  # GPipe (n = m) picks the same variant
        return ts, us, kinds, alike
