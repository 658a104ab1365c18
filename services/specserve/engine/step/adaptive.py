"""Per-step speculation length: choose K (0 = off) from the cost model, with measured inputs.

Before every step the controller predicts, for each candidate K in 0..K_max, how many tokens
the batch's decoding rows will emit and how long the step will take, and keeps the K with the
most tokens per second. Both sides of that ratio are measured on this unit, not assumed:

- **acceptance**, per proposer and draft position j, as decayed counts of rows *asked* for at least j + 1
  drafts, rows that *got* at least j + 1 (an n-gram proposer often finds fewer, or none), and
  rows whose draft j was *accepted* (for a chain: whose first j + 1 were). Then
  E[emitted | K] = 1 + Σ_{j<K} P(first j + 1 accepted | asked ≥ j + 1)
  with no independence assumption: n-gram acceptance is strongly correlated across positions,
  and the closed form (1 − α^(K+1)) / (1 − α) under-predicts it. For a chain each term is a
  product-limit estimate (``PositionAcceptance.rates``): a position's own ratio among the rows
  that reached it, multiplied up, so a deep position that only probes met speaks for them
  alone. **Token trees** are counted
  by node: a tree proposer drafts its nodes best first, so the tree of budget K is the first K
  nodes of a larger one, and node j is accepted when it lies on the kept path; the same sum
  then predicts a tree's emitted tokens, and K is the tree's node budget (the acceptance per
  depth and sibling rank that this sum adds up is on /metrics, ``stats.py``). K follows the acceptance of
  the proposer it governs (``k_source``): in a hybrid, the model part's. The model-free first
  part drafts to the row's cap and is picked per row by its own estimate (``hybrid.py``), so
  its long accepted runs must not raise the model's K, nor its misses lower it.
- **cost**, fitted online by decayed least squares with non-negative coefficients:
  the target forward as ``θ0 + θ1·rows + θ2·padded + θ3·attention`` (padded = the token rows
  the forward computes, each row at its group's longest: where rows draft unevenly, as the
  suffix proposer's do, more than their new tokens, and a fit on the new tokens called a long
  K cheap at batch 8; attention = Σ new tokens × context), the draft phase as
  ``φ0 + φ1·K + φ2·K·rows`` and the accept phase as ``ψ0 + ψ1·rows + ψ2·sampled logit
  rows``. The design's c and v (draft and verify cost relative to one target decode step) are
  these predictions at the current batch size and context lengths, divided by the K = 0
  prediction.
- **size**: kernels are not linear in the work where the matrices are small. On this
  project's CPU (MKL/oneDNN GEMMs) a batch-1 forward of 2 or 3 tokens costs 1.7x and 2.2x one
  of 1 token, more than one of 4 or 5 (1.4x); a linear fit through those points calls 2 and 3
  cheap and picks them. So forwards of up to ``MEASURED_SIZES`` padded tokens (rows x longest
  row) are also averaged per size, less their attention term, and a size measured twice is
  predicted from its own mean plus the fit's attention term; other sizes from the fit. A size
  the fit calls cheap gets chosen, measured and, if it is not, left.

Smoothing and hysteresis: the statistics decay per observation; K changes only after
``min_dwell_steps`` at the current one, and only to a K whose predicted throughput beats the
current K's by ``hysteresis``. Exploration: every ``probe_interval_steps`` one decoding row
(in turn) drafts twice the current K, at least ``PROBE_MIN_K`` (up to its cap), so acceptance
beyond the current K, or at all when K = 0, stays measured and K can come back, a doubling at
a time. Not the full cap at once: a token tree's budget may be 16 nodes, and on a CPU a probe
of 16 costs a step about two decodes (measured, bench-tree) every ``probe_interval_steps``.
Batch size counts decoding rows only; prefill rows run in forwards of their own and only feed
the forward-cost fit.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

from specserve.config import AdaptiveConfig
from specserve.engine.step.cost_model import expected_tokens_per_step

_MIN_WEIGHT = 2.0  # decayed rows a position needs before its own counts are used
MEASURED_SIZES = 64  # padded forward sizes (rows x longest row) whose mean time is kept
PROBE_MIN_K = 4  # the smallest K an exploration probe drafts (module docstring)


class DecayedLeastSquares:
    """Online ``y ≈ θ·x`` with exponentially decayed weights and θ ≥ 0 (costs never shrink as
    work grows). Features are divided by ``scale`` so the normal equations stay conditioned.

    Every step observes and predicts, with three or four features: in Python floats, since a
    numpy call's own cost is microseconds (on a 2-core Zen 3 the controller took 0.46 ms a step
    at batch 1 with these in numpy, 0.15-0.18 ms now: ``load/bench_adaptive.py
    --controller-steps``). θ is solved when first asked after an observation."""

    def __init__(self, scale: tuple[float, ...], decay: float) -> None:
        self.scale = tuple(float(v) for v in scale)
        self.decay = decay
        n = len(scale)
        self.xtx = [[0.0] * n for _ in range(n)]
        self.xty = [0.0] * n
        self.num_observations = 0
        self._per_unit: tuple[float, ...] | None = None  # θ / scale, for predict

    def observe(self, x: tuple[float, ...], y: float) -> None:
        v = [float(f) / s for f, s in zip(x, self.scale)]
        d = self.decay
        for row, vi in zip(self.xtx, v):
            for j, vj in enumerate(v):
                row[j] = d * row[j] + vi * vj
        self.xty = [d * t + vi * y for t, vi in zip(self.xty, v)]
        self.num_observations += 1
        self._per_unit = None

    def predict(self, x: tuple[float, ...]) -> float:
        return sum(map(operator.mul, self.per_unit, x))

    @property
    def per_unit(self) -> tuple[float, ...]:
        """θ / scale: the seconds each unit of each feature costs."""
        if self._per_unit is None:
            self._per_unit = tuple(t / s for t, s in zip(self._solve(), self.scale))
        return self._per_unit

    @property
    def theta(self) -> np.ndarray:
        return np.array([c * s for c, s in zip(self.per_unit, self.scale)])

    def _solve(self) -> list[float]:
        """Active-set non-negative solve: drop the most negative coefficient and re-solve."""
        n = len(self.xty)
        ridge = 1e-6 * (sum(self.xtx[i][i] for i in range(n)) / n + 1e-12)
        active = list(range(n))
        theta = [0.0] * n
        while active:
            sub = _solve_spd([[self.xtx[i][j] + (ridge if i == j else 0.0) for j in active] for i in active],
                             [self.xty[i] for i in active])
            if min(sub) >= 0:
                for i, t in zip(active, sub):
                    theta[i] = t
                return theta
            active.pop(sub.index(min(sub)))
        return theta


def _solve_spd(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b, for a small symmetric positive definite ``a`` (a ridge keeps the normal
    equations so): Gaussian elimination, whose pivots are then positive, no swaps needed."""
    n = len(b)
    a, b = [row[:] for row in a], b[:]
    for i in range(n):
        ai = a[i]
        for r in range(i + 1, n):
            ar = a[r]
            f = ar[i] / ai[i]
            for c in range(i, n):
                ar[c] -= f * ai[c]
            b[r] -= f * b[i]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        x[i] = (b[i] - sum(a[i][c] * x[c] for c in range(i + 1, n))) / a[i][i]
    return x


class SizeCosts:
    """Decayed mean seconds per padded forward size (module docstring); a size's mean decays
    only with that size's own observations."""

    def __init__(self, decay: float, max_size: int = MEASURED_SIZES) -> None:
        self.decay = decay
        self.total = np.zeros(max_size + 1)
        self.weight = np.zeros(max_size + 1)

    def observe(self, size: int, seconds: float) -> None:
        if 1 <= size < len(self.total):
            self.total[size] = self.decay * self.total[size] + seconds
            self.weight[size] = self.decay * self.weight[size] + 1.0

    def get(self, size: int) -> float | None:
        if 1 <= size < len(self.total) and self.weight[size] >= 1.5:  # two observations
            return float(self.total[size] / self.weight[size])
        return None


class PositionAcceptance:
    """Decayed per-position counts: asked / drafted / accepted (see the module docstring), and
    for a chain's product-limit estimate (:meth:`rates`) the rows that reached each position:
    ``reached[j]``, asked for at least j + 1 drafts with the first j kept; ``offered[j]``,
    asked for at least j + 1 with at least j drafted."""

    def __init__(self, max_k: int, decay: float) -> None:
        self.decay = decay
        self.asked = np.zeros(max_k)
        self.drafted = np.zeros(max_k)
        self.accepted = np.zeros(max_k)
        self.reached = np.zeros(max_k)
        self.offered = np.zeros(max_k)
        self.trees = False  # a token tree was counted: nodes, not a chain's positions

    def observe(self, asked: int, drafted: int, accepted: int | list[int]) -> None:
        """``accepted``: how many of a chain's first drafts were kept, or a tree's kept nodes."""
        if asked <= 0:
            return
        chain = isinstance(accepted, int)
        for counts, n in ((self.asked, asked), (self.drafted, drafted),
                          (self.offered, min(asked, drafted + 1)),
                          (self.reached, min(asked, accepted + 1) if chain else 0)):
            counts *= self.decay
            counts[: min(n, len(counts))] += 1.0
        self.accepted *= self.decay
        if chain:
            self.accepted[: min(accepted, len(self.accepted))] += 1.0
        else:
            self.trees = True
            self.accepted[[j for j in accepted if j < len(self.accepted)]] += 1.0

    @property
    def measured(self) -> bool:
        return bool(self.asked[0] >= _MIN_WEIGHT)

    def rates(self) -> tuple[np.ndarray, np.ndarray]:
        """``(acc, drafted)`` per position: P(first j + 1 accepted | asked ≥ j + 1) and
        P(got ≥ j + 1 drafts | asked ≥ j + 1).

        A chain's are products over the positions up to j of each position's own ratio among
        the rows that reached it (a product-limit estimate, as survival curves are: a row asked
        for fewer drafts is censored there). Each position then speaks for the rows that met it,
        and the result cannot rise with j. The plain ratio accepted[j] / asked[j] mixed
        populations: deep positions are asked only while K is high or in a probe, and two
        probes that went well measured positions 4 to 7 at 1.0 behind a first position at 0.46,
        which priced K = 8 at 7 tokens a step. A tree's nodes keep the plain ratio (node j may
        be a sibling of node j - 1). Sparse positions extrapolate from the last measured ones
        (acceptance keeps its last conditional ratio, the yield stays flat)."""
        k = len(self.asked)
        if self.trees:
            return self._node_rates()
        accepted, reached = self.accepted.tolist(), self.reached.tolist()
        drafted, offered = self.drafted.tolist(), self.offered.tolist()
        acc, got = [0.0] * k, [1.0] * k  # (Python floats: every step asks, numpy calls cost)
        ratio, acc_before, got_before = 0.5, 1.0, 1.0
        for j in range(k):
            if reached[j] >= _MIN_WEIGHT:
                ratio = accepted[j] / reached[j]
            acc[j] = acc_before * min(1.0, ratio)  # unmeasured: the last ratio (0.5 at first)
            got[j] = got_before * (min(1.0, drafted[j] / offered[j]) if offered[j] >= _MIN_WEIGHT else 1.0)
            acc_before, got_before = acc[j], got[j]
        return np.array(acc), np.array(got)

    def _node_rates(self) -> tuple[np.ndarray, np.ndarray]:
        """A tree's: each node's plain ratio among the rows asked for it."""
        k = len(self.asked)
        asked, drafted, accepted = self.asked.tolist(), self.drafted.tolist(), self.accepted.tolist()
        acc, got = [0.0] * k, [1.0] * k
        for j in range(k):
            if asked[j] >= _MIN_WEIGHT:
                acc[j] = accepted[j] / asked[j]
                got[j] = drafted[j] / asked[j]
            elif j == 0:
                acc[j], got[j] = 0.5, 1.0
            else:
                ratio = acc[j - 1] / acc[j - 2] if j >= 2 and acc[j - 2] > 0 else acc[0]
                acc[j] = acc[j - 1] * min(1.0, ratio)
                got[j] = got[j - 1]
        acc, got = np.array(acc), np.array(got)
        return np.clip(acc, 0.0, 1.0), np.clip(got, 0.0, 1.0)


@dataclass(frozen=True)
class Row:
    """One decoding row as the controller sees it before the step."""

    context: int       # tokens already in the target cache
    cap: int           # the most it may draft now (its request's K, max_tokens and context)
    adaptive: bool     # False: the client fixed K, so the row drafts ``cap``
    sampled: bool      # not greedy: the accept phase works on full distributions
    limit: int | None = None  # its request's K (default: cap); what K is chosen for

    @property
    def level(self) -> Row:
        """The row as K is chosen for it: a request's last steps, capped by its max_tokens,
        must not move the K of the steps that follow (a batch-1 request's last step, capped
        at 1, would find K = 0 better than K = 1 and hold the next request at 0)."""
        return self if self.limit is None else Row(self.context, self.limit, self.adaptive, self.sampled)


class SpecLengthController:
    def __init__(self, max_k: int, cfg: AdaptiveConfig) -> None:
        assert max_k >= 1
        self.max_k = max_k
        self.cfg = cfg
        self.k = max_k                   # current K for adaptive rows
        self.estimated_speedup = 1.0     # predicted throughput at K over K = 0, last step
        self.steps = 0
        self._break_even: tuple | None = None  # (what it was solved from, the value)
        self._last_switch = 0
        self._probe_turn = 0
        # Acceptance per proposer (``Proposal.source``); K is chosen from ``k_source``'s, the
        # proposer K governs (a hybrid's model part: its first part drafts to the row's cap
        # and is chosen per row by its own estimate, hybrid.py). None: every row counts.
        self.k_source: str | None = None
        self.by_source: dict[str, PositionAcceptance] = {}
        self.acceptance = PositionAcceptance(max_k, cfg.decay)
        self.forward_cost = DecayedLeastSquares((1.0, 8.0, 64.0, 65536.0), cfg.decay)
        self.sizes = SizeCosts(cfg.decay)
        self.propose_cost = DecayedLeastSquares((1.0, 4.0, 32.0), cfg.decay)
        self.accept_cost = DecayedLeastSquares((1.0, 8.0, 64.0), cfg.decay)

    # -- measurements -------------------------------------------------------------------------
    def observe_forward(self, rows: int, tokens: int, attention: int, seconds: float,
                        padded: int | None = None) -> None:
        """One target forward: ``rows`` rows, ``tokens`` new tokens in all, ``attention`` =
        Σ new tokens x context, ``padded`` = the token rows it computed, each group of rows
        at its longest (default: ``tokens``)."""
        padded = padded or tokens
        self.forward_cost.observe((1.0, rows, padded, attention), seconds)
        self.sizes.observe(padded, seconds - self._attention_seconds(attention))

    def forward_seconds(self, rows: int, attention: float, padded: int) -> float:
        """Predicted seconds of a target forward of ``padded`` token rows: the size's measured
        mean plus the attention term where the size was measured, the linear fit elsewhere."""
        measured = self.sizes.get(padded)
        if measured is None:
            return self.forward_cost.predict((1.0, rows, padded, attention))
        return measured + self._attention_seconds(attention)

    def _attention_seconds(self, attention: float) -> float:
        return self.forward_cost.predict((0.0, 0.0, 0.0, attention))

    def observe_propose(self, k: int, rows: int, seconds: float) -> None:
        self.propose_cost.observe((1.0, k, k * rows), seconds)

    def observe_accept(self, rows: int, sampled_logit_rows: int, seconds: float) -> None:
        self.accept_cost.observe((1.0, rows, sampled_logit_rows), seconds)

    def observe_draft(self, asked: int, drafted: int, accepted: int | list[int],
                      source: str | None = None) -> None:
        """One row's step: drafts it was asked for, got and had accepted (a tree: the kept
        nodes' indices); ``source``: the proposer that drafted them."""
        if source is not None:
            if source not in self.by_source:
                self.by_source[source] = PositionAcceptance(self.max_k, self.cfg.decay)
            self.by_source[source].observe(asked, drafted, accepted)
        if self.k_source is None or source in (None, self.k_source):
            self.acceptance.observe(asked, drafted, accepted)

    @property
    def calibrated(self) -> bool:
        return (self.steps > self.cfg.warmup_steps and self.acceptance.measured
                and self.forward_cost.num_observations >= 4
                and self.propose_cost.num_observations >= 2)

    # -- the choice ---------------------------------------------------------------------------
    def plan(self, rows: list[Row]) -> list[int]:
        """K per decoding row for this step (fixed rows keep their cap)."""
        self.steps += 1
        adaptive = [i for i, r in enumerate(rows) if r.adaptive and r.cap > 0]
        if not adaptive:
            return [0 if r.adaptive else r.cap for r in rows]
        if self.cfg.enabled and self.calibrated:
            self._update_k([r.level for r in rows])
        ks = [min(r.cap, self.k) if r.adaptive else r.cap for r in rows]
        if self.k < self.max_k and self.steps % self.cfg.probe_interval_steps == 0:
            i = adaptive[self._probe_turn % len(adaptive)]
            self._probe_turn += 1
            ks[i] = min(rows[i].cap, max(2 * self.k, PROBE_MIN_K))
        return ks

    def _update_k(self, rows: list[Row]) -> None:
        throughput = self.throughputs(rows)
        best = max(range(len(throughput)), key=throughput.__getitem__)  # the first best, as argmax
        if (best != self.k and self.steps - self._last_switch >= self.cfg.min_dwell_steps
                and throughput[best] > throughput[self.k] * (1.0 + self.cfg.hysteresis)):
            self.k, self._last_switch = best, self.steps
        self.estimated_speedup = float(throughput[self.k] / throughput[0])

    def throughputs(self, rows: list[Row], rates=None) -> list[float]:
        """:meth:`throughput` at every K from 0 to ``max_k``, the acceptance sums taken once."""
        sums = self._sums(rates)
        return [self._throughput(rows, k, *sums) for k in range(self.max_k + 1)]

    def throughput(self, rows: list[Row], k: int, rates=None) -> float:
        """Predicted emitted tokens per second of a step where adaptive rows draft ``k``."""
        return self._throughput(rows, k, *self._sums(rates))

    def _sums(self, rates) -> tuple[list[float], list[float]]:
        """Expected accepted and drafted tokens within the first j drafts, j = 0 .. max_k."""
        acc, got = rates if rates is not None else self.acceptance.rates()
        return [0.0, *np.cumsum(acc).tolist()], [0.0, *np.cumsum(got).tolist()]

    def _throughput(self, rows: list[Row], k: int, acc_sum: list[float], got_sum: list[float]) -> float:
        emitted = attention = sampled = 0.0
        drafting, k_step = 0, 0
        for r in rows:
            ki = min(r.cap, k) if r.adaptive else r.cap
            ki = min(ki, self.max_k)
            n = 1.0 + got_sum[ki]
            emitted += 1.0 + acc_sum[ki]
            attention += n * (r.context + n)
            sampled += n if r.sampled else 0.0
            drafting += ki > 0
            k_step = max(k_step, ki)
        seconds = (self.forward_seconds(len(rows), attention, len(rows) * (1 + k_step))
                   + self.accept_cost.predict((1.0, len(rows), sampled)))
        if k_step:
            seconds += self.propose_cost.predict((1.0, k_step, k_step * drafting))
        return float(emitted / max(seconds, 1e-9))

    def break_even_acceptance(self, context: int = 256) -> float | None:
        """The per-token acceptance rate α below which no K pays for one sequence alone
        (the closed form of the cost model with the measured c and v); None until measured.
        Cached until a cost fit changes: the router asks once per finished request."""
        if self.forward_cost.num_observations < 4 or self.propose_cost.num_observations < 2:
            return None
        # (every forward observed, sized or not, counts in forward_cost.num_observations)
        key = (self.forward_cost.num_observations, self.propose_cost.num_observations,
               self.accept_cost.num_observations, context)
        if self._break_even is None or self._break_even[0] != key:
            self._break_even = (key, self._solve_break_even(context))
        return self._break_even[1]

    def _solve_break_even(self, context: int) -> float:
        costs = []
        for k in range(self.max_k + 1):
            n = 1.0 + k
            t = (self.forward_seconds(1, n * (context + n), k + 1)
                 + self.accept_cost.predict((1.0, 1, 0.0)))
            if k:
                t += self.propose_cost.predict((1.0, k, k))
            costs.append(max(t, 1e-9))

        def pays(alpha: float) -> bool:
            return any(expected_tokens_per_step(alpha, k) * costs[0] / costs[k] > 1.0
                       for k in range(1, self.max_k + 1))

        if pays(0.0):
            return 0.0
        lo, hi = 0.0, 1.0
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if pays(mid) else (mid, hi)
        return hi
