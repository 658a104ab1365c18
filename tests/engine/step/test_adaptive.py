"""The per-step K controller: its cost fit, its acceptance statistics and its choices, driven
by a synthetic unit (known step costs, Bernoulli acceptance) so every expectation is exact."""

from __future__ import annotations

import random

import numpy as np
import pytest
from specserve.config import AdaptiveConfig
from specserve.engine.step.adaptive import (
    DecayedLeastSquares,
    PositionAcceptance,
    Row,
    SizeCosts,
    SpecLengthController,
)


def test_least_squares_recovers_known_costs():
    fit = DecayedLeastSquares((1.0, 8.0, 64.0), decay=0.99)
    rng = random.Random(0)
    for _ in range(200):
        rows, tokens = rng.randint(1, 16), rng.randint(1, 200)
        fit.observe((1.0, rows, tokens), 0.05 + 0.001 * rows + 0.0004 * tokens)
    assert fit.predict((1.0, 4, 100)) == pytest.approx(0.05 + 0.004 + 0.04, rel=1e-4)


def test_least_squares_keeps_costs_non_negative():
    """Noise that suggests more tokens cost less must not produce a negative slope (it would
    make the controller draft as far as it can)."""
    fit = DecayedLeastSquares((1.0, 64.0), decay=0.99)
    for tokens, seconds in ((1, 0.060), (5, 0.058), (2, 0.061), (4, 0.057)):
        fit.observe((1.0, tokens), seconds)
    assert (fit.theta >= 0).all()
    assert fit.predict((1.0, 100)) >= fit.predict((1.0, 1))


def test_least_squares_solves_collinear_and_empty_features_as_numpy_does():
    """The fit's own elimination (Python floats, no numpy call a step) against numpy's solve of
    the same ridge system: at batch 1 with nothing drafted, rows and padded rows are the same
    feature, and a feature never seen (no sampled rows) is all zeros."""
    fit = DecayedLeastSquares((1.0, 8.0, 64.0, 65536.0), decay=0.98)
    rng = random.Random(2)
    for _ in range(100):
        context = rng.randint(10, 500)
        fit.observe((1.0, 1, 1, context), 0.006 + 2e-7 * context + rng.uniform(-1e-4, 1e-4))
    xtx, xty = np.array(fit.xtx), np.array(fit.xty)
    ridge = 1e-6 * (np.trace(xtx) / 4 + 1e-12)
    expected = np.linalg.solve(xtx + ridge * np.eye(4), xty)
    assert (expected >= 0).all() and fit.theta == pytest.approx(expected, rel=1e-6)
    assert fit.predict((1.0, 1, 1, 300)) == pytest.approx(0.006 + 6e-5, rel=0.05)
    empty = DecayedLeastSquares((1.0, 8.0, 64.0), decay=0.98)
    for rows in range(1, 9):
        empty.observe((1.0, rows, 0.0), 0.001 * rows)
    assert empty.theta[2] == 0 and empty.predict((1.0, 4, 0.0)) == pytest.approx(0.004, rel=1e-3)


def test_position_acceptance_counts_and_extrapolates():
    acc = PositionAcceptance(max_k=4, decay=1.0)
    for _ in range(10):
        acc.observe(asked=2, drafted=2, accepted=1)   # position 0 accepted, 1 rejected
        acc.observe(asked=2, drafted=1, accepted=1)   # proposer found only one token
        acc.observe(asked=2, drafted=0, accepted=0)   # found nothing
        acc.observe(asked=2, drafted=2, accepted=2)
    rates, got = acc.rates()
    assert rates[0] == pytest.approx(3 / 4) and rates[1] == pytest.approx(1 / 4)
    assert got[0] == pytest.approx(3 / 4) and got[1] == pytest.approx(2 / 4)
    # positions 2, 3 never asked: keep the last conditional ratio (1/4 / 3/4), yield stays flat
    assert rates[2] == pytest.approx(rates[1] / 3) and rates[3] == pytest.approx(rates[2] / 3)
    assert got[2] == got[1] == got[3]


def test_a_chains_deep_positions_speak_only_for_the_rows_that_reached_them():
    """K = 1 for a long while (first drafts kept 3 times in 10), then two probes of 8 drafts
    that were kept whole. Positions 1 to 7 were met only by those two rows, after their first
    draft was kept: the chance of keeping the first j + 1 cannot exceed that of keeping the
    first, and K = 8 must not be priced at 7 tokens a step. The plain ratio of accepted to
    asked at each position called positions 1 to 7 certain."""
    acc = PositionAcceptance(max_k=8, decay=1.0)
    for i in range(50):
        acc.observe(asked=1, drafted=1, accepted=int(i % 10 < 3))
    for _ in range(2):
        acc.observe(asked=8, drafted=8, accepted=8)
    rates, got = acc.rates()
    assert rates[0] == pytest.approx(17 / 52)
    assert rates[1:] == pytest.approx([17 / 52] * 7)  # each later position: 2 kept of the 2 there
    assert (np.diff(rates) <= 0).all() and (got == 1).all()
    assert 1 + rates.sum() < 4  # expected tokens a step of K = 8; the plain ratio said 7.3


def test_k_follows_the_acceptance_of_the_proposer_it_governs():
    """In a hybrid, the model-free part's long accepted runs (suffix decoding drafts to the
    row's cap) must not raise the model's K, nor count as its acceptance: each source is
    measured apart, and K is chosen from ``k_source``'s."""
    ctl = SpecLengthController(4, AdaptiveConfig())
    ctl.k_source = "eagle"
    for _ in range(10):
        ctl.observe_draft(4, 4, 4, "suffix")
        ctl.observe_draft(4, 4, 0, "eagle")
    assert ctl.acceptance.rates()[0][0] == 0.0
    assert ctl.by_source["suffix"].rates()[0][0] == 1.0
    assert list(ctl.acceptance.asked) == list(ctl.by_source["eagle"].asked)
    pooled = SpecLengthController(4, AdaptiveConfig())  # one proposer: every row
    pooled.observe_draft(4, 4, 4, "suffix")
    pooled.observe_draft(4, 4, 0)
    assert pooled.acceptance.rates()[0][0] == pytest.approx(0.5, abs=0.01)


class SyntheticUnit:
    """Step time = fixed + per_token * tokens (+ draft per K); each drafted token is accepted
    with probability ``alpha`` until the first rejection. Every ``prefill_every`` steps a new
    request's prefill (200 tokens) runs, as in a real unit: besides the drafts' own variation,
    that is what tells the cost fit a fixed part from a per-token part."""

    def __init__(self, ctl: SpecLengthController, *, alpha: float, fixed: float = 0.05,
                 per_token: float = 0.0005, draft_per_k: float = 0.0, seed: int = 0,
                 prefill_every: int = 10) -> None:
        self.ctl, self.alpha, self.prefill_every, self.steps = ctl, alpha, prefill_every, 0
        self.fixed, self.per_token, self.draft_per_k = fixed, per_token, draft_per_k
        self.rng = random.Random(seed)

    def step(self, batch: int, cap: int = 4, adaptive: bool = True) -> list[int]:
        self.steps += 1
        if self.steps % self.prefill_every == 0:
            self.ctl.observe_forward(1, 200, 200 * 200, self.fixed + self.per_token * 200)
        rows = [Row(context=100, cap=cap, adaptive=adaptive, sampled=False)] * batch
        ks = self.ctl.plan(rows)
        tokens = sum(k + 1 for k in ks)
        self.ctl.observe_forward(batch, tokens, tokens * 100, self.fixed + self.per_token * tokens)
        if max(ks):
            self.ctl.observe_propose(max(ks), sum(k > 0 for k in ks), self.draft_per_k * max(ks))
        for k in ks:
            accepted = 0
            while accepted < k and self.rng.random() < self.alpha:
                accepted += 1
            self.ctl.observe_draft(k, k, accepted)
        self.ctl.observe_accept(batch, 0, 0.001)
        return ks

    def run(self, steps: int, batch: int, **kw) -> list[list[int]]:
        return [self.step(batch, **kw) for _ in range(steps)]


def controller(**cfg) -> SpecLengthController:
    return SpecLengthController(4, AdaptiveConfig(**cfg))


def test_keeps_configured_k_until_calibrated():
    ctl = controller(warmup_steps=10)
    ks = SyntheticUnit(ctl, alpha=0.0).run(10, batch=1)
    assert all(k == [4] for k in ks) and not ctl.calibrated


def test_speculates_alone_with_good_acceptance():
    """Weight-streaming-bound (a token costs 1% of a step): with α = 0.8 the most K wins."""
    ctl = controller()
    SyntheticUnit(ctl, alpha=0.8).run(200, batch=1)
    assert ctl.k == 4
    assert ctl.estimated_speedup > 2.0


def test_turns_off_when_verify_cost_grows_with_the_batch():
    """Compute-bound at 32 rows (a token costs as much as the fixed part / 10): each extra
    drafted token costs more than it returns at α = 0.45, so K goes to 0."""
    ctl = controller()
    SyntheticUnit(ctl, alpha=0.45, per_token=0.005).run(300, batch=32)
    assert ctl.k == 0
    assert ctl.estimated_speedup == pytest.approx(1.0)


def test_turns_off_when_nothing_is_accepted_and_probes_one_row():
    ctl = controller(probe_interval_steps=8)
    ks = SyntheticUnit(ctl, alpha=0.0).run(300, batch=4)
    assert ctl.k == 0
    tail = ks[-64:]
    probes = [k for k in tail if max(k) > 0]
    assert len(probes) == 64 // 8
    assert all(sorted(k) == [0, 0, 0, 4] for k in probes)  # one row drafts its full K


def test_comes_back_when_acceptance_recovers():
    ctl = controller(probe_interval_steps=4)
    unit = SyntheticUnit(ctl, alpha=0.0)
    unit.run(200, batch=2)
    assert ctl.k == 0
    unit.alpha = 0.9
    unit.run(400, batch=2)
    assert ctl.k >= 3


def k_changes(**cfg) -> list[int]:
    """Steps at which K changed while the batch alternates between 4 and 6 rows."""
    ctl = controller(**cfg)
    unit = SyntheticUnit(ctl, alpha=0.5, per_token=0.0025)
    unit.run(50, batch=4)
    changes, last = [], ctl.k
    for i in range(400):
        unit.step(batch=4 if i % 2 else 6)
        if ctl.k != last:
            changes.append(i)
            last = ctl.k
    return changes


def test_k_does_not_flap_between_near_ties():
    """A batch that alternates between two sizes whose best K differ slightly must not make K
    change on every step: changes are at least min_dwell_steps apart, and few."""
    changes = k_changes(min_dwell_steps=8, hysteresis=0.05)
    assert all(b - a >= 8 for a, b in zip(changes, changes[1:]))
    assert len(changes) <= 25


def test_without_hysteresis_the_same_load_flaps():
    """The check above has power: with no dwell and no margin, K changes constantly."""
    assert len(k_changes(min_dwell_steps=1, hysteresis=0.0)) > 50


# Batch-1 target forward of 1..5 tokens, ms, measured on this project's CPU (SmolLM2-135M,
# float32, MKL): 2 and 3 tokens cost more than 4 and 5.
CPU_FORWARD_MS = {1: 54.0, 2: 90.0, 3: 112.0, 4: 77.0, 5: 69.0}


def run_on_cpu_costs(ctl: SpecLengthController, steps: int = 600, alpha: float = 0.5) -> float:
    """The share of uncapped steps drafting K = 4 over the last half of ``steps`` batch-1 steps
    on the CPU's costs (draft 3.6 ms a token). Every 16th step is a request's last, whose cap
    (its max_tokens) is 0..3: that is how a real unit meets the small sizes without choosing
    them."""
    rng = random.Random(0)
    at_four = uncapped = 0
    for step in range(steps):
        if step % 40 == 0:
            ctl.observe_forward(1, 120, 120 * 120, 0.054 + 0.0008 * 120, 120)  # a prefill
        cap = (step // 16) % 4 if step % 16 == 15 else 4
        (k,) = ctl.plan([Row(context=200, cap=cap, adaptive=True, sampled=False, limit=4)])
        forward = CPU_FORWARD_MS[k + 1] / 1000
        ctl.observe_forward(1, k + 1, (k + 1) * (200 + k + 1), forward, k + 1)
        if k:
            ctl.observe_propose(k, 1, 0.0036 * k)
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        ctl.observe_draft(k, k, accepted)
        ctl.observe_accept(1, 0, 0.0005)
        if step >= steps // 2:
            uncapped += cap == 4
            at_four += cap == 4 and k == 4
    return at_four / uncapped


def test_measured_sizes_are_predicted_as_measured():
    """On the CPU's costs K = 4 is best at α = 0.5 (23 tok/s against 16 and 15 at K = 1 and
    2). The controller holds it, and predicts each size it met as measured, the sizes that a
    line through the others would call cheap (2 and 3 tokens) included."""
    ctl = controller()
    share = run_on_cpu_costs(ctl)
    assert ctl.k == 4 and share > 0.95, share
    for n, ms in CPU_FORWARD_MS.items():
        predicted = ctl.forward_seconds(1, n * (200 + n), n)
        assert predicted == pytest.approx(ms / 1000, rel=0.02), (n, predicted)
    fit = [ctl.forward_cost.predict((1.0, 1, n, n * (200 + n))) for n in (2, 3)]
    assert fit[0] < 0.080 and fit[1] < 0.090, fit  # what the line alone would have used


def test_a_batchs_forward_is_priced_by_the_token_rows_it_computes():
    """A batch of 8 whose rows draft unevenly (the suffix proposer finds long matches for some
    and nothing for others) computes every row at its longest: 8 x 9 token rows for 8 + 20 new
    tokens. Forwards cost by those rows; past the measured sizes the fit must say so and pick
    K = 0 where drafting does not pay back. A fit on the new tokens called K = 8 at batch 8
    cheap and kept it (docs/BENCHMARKS.md: the router at 16 streams, before and after)."""
    ctl = SpecLengthController(8, AdaptiveConfig())
    per_row, fixed = 0.0015, 0.004
    rng = random.Random(1)
    for _ in range(300):
        k = rng.randint(0, 8)
        lengths = [1 + (k if rng.random() < 0.3 else 0) for _ in range(8)]  # 3 in 10 find drafts
        padded = 8 * max(lengths)
        ctl.observe_forward(8, sum(lengths), sum(lengths) * 300, fixed + per_row * padded, padded)
        ctl.observe_propose(max(k, 1), 8, 0.0002)
        ctl.observe_accept(8, 0, 0.0005)
        for n in lengths:
            ctl.observe_draft(k, n - 1, (n - 1) // 2)
    for padded in (72, 80):  # beyond the sizes kept apart: the fit
        assert ctl.forward_seconds(8, 0.0, padded) == pytest.approx(fixed + per_row * padded, rel=0.05)
    rows = [Row(context=300, cap=8, adaptive=True, sampled=False)] * 8
    throughput = [ctl.throughput(rows, k) for k in range(9)]
    assert max(range(9), key=throughput.__getitem__) == 0, throughput


def test_a_capped_last_step_does_not_move_k():
    """A batch-1 request's last step, capped at 1 by its max_tokens, finds K = 0 better than
    K = 1 on these costs. That decides the step (it drafts at most 1), not the K of the
    requests that follow; without the request's own K (``limit``) it did."""
    for limit, after in ((4, 4), (None, 0)):
        ctl = controller(min_dwell_steps=1)
        run_on_cpu_costs(ctl)
        assert ctl.k == 4
        (k,) = ctl.plan([Row(context=200, cap=1, adaptive=True, sampled=False, limit=limit)])
        assert k <= 1 and ctl.k == after, (limit, ctl.k)


def test_size_costs_need_two_observations_and_ignore_large_sizes():
    sizes = SizeCosts(decay=0.9, max_size=8)
    sizes.observe(3, 0.01)
    assert sizes.get(3) is None
    sizes.observe(3, 0.03)
    assert sizes.get(3) == pytest.approx((0.9 * 0.01 + 0.03) / 1.9)
    sizes.observe(9, 1.0)
    assert sizes.get(9) is None and sizes.weight.sum() == pytest.approx(1.9)


def test_fixed_rows_keep_their_k():
    ctl = controller()
    unit = SyntheticUnit(ctl, alpha=0.0)
    unit.run(100, batch=2)
    assert ctl.k == 0
    rows = [Row(100, 4, adaptive=False, sampled=False), Row(100, 3, adaptive=True, sampled=False)]
    assert ctl.plan(rows)[0] == 4


def test_break_even_matches_the_closed_form():
    """v(K) = 1 + 0.1 K, c = 0: K = 1 pays when 1 + α > 1.1, so break-even α = 0.1."""
    ctl = controller()
    for tokens in range(1, 40):
        ctl.observe_forward(1, tokens, tokens * (256 + tokens), 1.0 + 0.1 * (tokens - 1))
    for k in range(1, 5):
        ctl.observe_propose(k, 1, 0.0)
    ctl.observe_accept(1, 0, 0.0)
    assert ctl.break_even_acceptance(context=256) == pytest.approx(0.1, abs=2e-3)


def test_break_even_unknown_before_costs_are_measured():
    assert controller().break_even_acceptance() is None


def test_rates_are_probabilities():
    ctl = controller()
    SyntheticUnit(ctl, alpha=0.7).run(100, batch=3)
    acc, got = ctl.acceptance.rates()
    assert np.all((0 <= acc) & (acc <= 1)) and np.all(np.diff(acc) <= 1e-12)


def test_break_even_is_solved_again_only_when_a_cost_fit_changed(monkeypatch):
    ctl = controller()
    for tokens in range(1, 10):
        ctl.observe_forward(1, tokens, tokens * (256 + tokens), 1.0 + 0.1 * (tokens - 1))
    for k in range(1, 5):
        ctl.observe_propose(k, 1, 0.0)
    solves = []
    real = ctl._solve_break_even
    monkeypatch.setattr(ctl, "_solve_break_even", lambda c: solves.append(c) or real(c))
    first = ctl.break_even_acceptance()
    assert ctl.break_even_acceptance() == first and len(solves) == 1
    ctl.observe_forward(1, 3, 3 * 259, 1.2)
    assert ctl.break_even_acceptance() == pytest.approx(first, abs=0.05) and len(solves) == 2
    ctl.break_even_acceptance(context=512)
    assert len(solves) == 3


def test_a_trees_kept_nodes_are_counted_by_their_index():
    """A token tree's acceptance is counted per node (its index in the proposal, best first):
    node j is accepted when it lies on the kept path, so the sum over the first K nodes
    predicts a budget-K tree's accepted tokens, as it does a chain's."""
    acc = PositionAcceptance(6, decay=0.999)
    for _ in range(10):
        acc.observe(6, 6, [1, 4])  # node 0 rejected, its sibling 1 kept, then 1's child 4
    rates, got = acc.rates()
    assert rates[0] == 0 and rates[2] == rates[3] == rates[5] == 0
    assert rates[1] > 0.99 and rates[4] > 0.99 and (got == 1).all()
    acc.observe(6, 6, 2)  # a chain's count still means its first drafts
    assert acc.accepted[0] > 0 and acc.accepted[1] > 9


def test_probes_draft_twice_the_current_k_not_the_whole_budget():
    """A tree's budget may be 16 nodes: a probe drafts twice the current K (at least 4), so it
    explores a doubling at a time instead of paying for the full budget every interval."""
    ctl = SpecLengthController(16, AdaptiveConfig(probe_interval_steps=4))
    rows = [Row(context=100, cap=16, adaptive=True, sampled=False) for _ in range(3)]
    for k, probe in ((0, 4), (1, 4), (4, 8), (12, 16)):
        ctl.k = k
        ctl.steps = 3  # plan() counts this step as the 4th: a probe step
        ctl.cfg = ctl.cfg.model_copy(update={"enabled": False})  # keep K where it was set
        assert sorted(ctl.plan(rows)) == sorted([k, k, probe])


def test_the_cost_model_counts_the_steps_that_do_not_draft():
    """``share``: a proposer that drafts on a share of the steps (n-gram: where it finds a
    match) emits one token on each of the others; at share 1 the formula is Leviathan's."""
    import doctest

    from specserve.engine.step import cost_model
    from specserve.engine.step.cost_model import expected_speedup, expected_tokens_per_step

    assert doctest.testmod(cost_model).failed == 0
    assert expected_tokens_per_step(0.5, 2, share=0.5) == pytest.approx(0.5 * 1.75 + 0.5)
    assert expected_speedup(0.5, 2, 0.1, 1.0, share=0.0) == pytest.approx(1.0)  # never drafts
    assert expected_speedup(0.5, 2, 0.1, 1.0, share=1.0) == expected_speedup(0.5, 2, 0.1, 1.0)
