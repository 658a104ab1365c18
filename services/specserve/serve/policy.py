"""The speculation policy: per request, speculation on or off, how far, and why.

(Not to be confused with ``request_router.py``, which picks the unit a request goes to.)

Every decision carries a reason, returned to the client (``x-speculation`` header, the
``usage.speculation`` block) and counted in metrics. The rules, first match wins:

==================  =====  ===============================================================
reason              on?    when
==================  =====  ===============================================================
client_override     either the request's ``speculation.enabled`` (on: its K, fixed)
not_configured      off    the deployment runs no proposer
draft_unavailable   off    the draft group is lost (the unit re-attaches it when it is back)
short_output        off    ``max_tokens`` below ``short_output_tokens`` (for a draft model:
                           its prefill does not pay back on a short answer)
high_concurrency    off    the unit's load reached the threshold (hysteresis + dwell)
low_acceptance      off    the request's class measured an acceptance rate below break-even,
                           where per-step K cannot save the cost (below)
probe               on     a share of a low-acceptance class, fixed K, to notice recovery
default             on     everything else; K chosen per step by the coordinator
==================  =====  ===============================================================

``low_acceptance`` and ``short_output`` act only where per-step K cannot save the cost. A
model-free proposer
(n-gram, suffix) drafts nothing when it finds nothing, and with per-step K (``adaptive``) the
coordinator stops drafting where drafts are rejected, so switching a class or a short request
off saves nothing and loses the requests that would pay. A draft model costs per request
whatever the step's K (its prefill; EAGLE reads the target's features every step), so there
both switches stay. Classes are per unit, so per proposer (a unit serves one), and separate traffic
by shape as well as by route and tenant (``ingress.class_key``): a 600-token code edit and a
one-line question on the same route do not share an acceptance rate.

The router runs inside the unit the request was sent to (the Serve request router picks the
least-loaded unit), so the load it reasons about is that unit's own, exact and current, not a
routing-stats snapshot. Its state is small: the concurrency gate and one acceptance EWMA per
class (route / tenant / traffic class), LRU-bounded. It takes a clock so tests drive it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from specserve.config import SpeculationPolicyConfig
from specserve.methods import PROPOSERS
from specserve.serve.protocol import SpeculationOptions
from specserve.serve.unit_messages import Decision

UNCALIBRATED_BREAK_EVEN = 0.1  # acceptance rate assumed to break even until costs are measured


class ConcurrencyGate:
    """Speculation allowed or not by load, with two thresholds and a minimum dwell time, so a
    load that oscillates around one threshold does not flip the state on every request."""

    def __init__(self, off_at: int, on_at: int, min_dwell_s: float,
                 clock: Callable[[], float]) -> None:
        assert on_at < off_at
        self.off_at, self.on_at, self.min_dwell_s = off_at, on_at, min_dwell_s
        self.clock = clock
        self.open = True
        self.flips = 0
        self._since = -float("inf")

    def update(self, load: int) -> bool:
        now = self.clock()
        if now - self._since >= self.min_dwell_s:
            if self.open and load >= self.off_at:
                self.open, self._since, self.flips = False, now, self.flips + 1
            elif not self.open and load <= self.on_at:
                self.open, self._since, self.flips = True, now, self.flips + 1
        return self.open


@dataclass
class _ClassStats:
    accepted: float = 0.0      # decayed sums: rate = accepted / drafted
    drafted: float = 0.0
    requests: int = 0
    low: bool = False
    turns: int = 0             # requests seen while low (the probe schedule counts these)

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class AcceptanceTracker:
    """Acceptance rate per class as an EWMA over finished requests (each weighted by its draft
    tokens), with a low / recovered state that uses a hysteresis margin."""

    def __init__(self, cfg: SpeculationPolicyConfig) -> None:
        self.cfg = cfg
        self.classes: OrderedDict[str, _ClassStats] = OrderedDict()

    def get(self, key: str) -> _ClassStats:
        stats = self.classes.get(key)
        if stats is None:
            stats = self.classes[key] = _ClassStats()
            while len(self.classes) > self.cfg.max_classes:
                self.classes.popitem(last=False)
        self.classes.move_to_end(key)
        return stats

    def observe(self, key: str, num_draft_tokens: int, num_accepted_tokens: int,
                break_even: float) -> None:
        if num_draft_tokens <= 0:
            return
        s = self.get(key)
        keep = 1.0 - self.cfg.acceptance_ewma_weight
        s.accepted = keep * s.accepted + num_accepted_tokens
        s.drafted = keep * s.drafted + num_draft_tokens
        s.requests += 1
        if s.requests < self.cfg.acceptance_min_requests:
            return
        if not s.low and s.rate < break_even:
            s.low, s.turns = True, 0
        elif s.low and s.rate >= break_even + self.cfg.acceptance_hysteresis:
            s.low = False

    def is_probe(self, s: _ClassStats) -> bool:
        """Every ``round(1 / probe_share)``-th request of a low class is speculated."""
        s.turns += 1
        if self.cfg.probe_share <= 0:
            return False
        return s.turns % max(1, round(1.0 / self.cfg.probe_share)) == 0


class SpeculationPolicy:
    """The rules of the table above, in its order, over the unit's load and the acceptance
    measured per class."""

    def __init__(self, cfg: SpeculationPolicyConfig, *, method: str | None, default_k: int,
                 adaptive: bool, max_num_seqs: int, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.cfg = cfg
        self.method = method
        self.default_k = default_k
        self.adaptive = adaptive
        off_at, on_at = cfg.concurrency_thresholds(max_num_seqs)
        self.gate = ConcurrencyGate(off_at, on_at, cfg.min_dwell_s, clock)
        self.acceptance = AcceptanceTracker(cfg)
        # low_acceptance cannot save anything per-step K does not (the module docstring).
        self.per_step_k_suffices = (adaptive and method is not None
                                    and not PROPOSERS[method].draft_model)

    def break_even(self, measured: float | None) -> float:
        """The acceptance rate a class needs: the configured one, else the cost model's."""
        if self.cfg.low_acceptance_threshold is not None:
            return self.cfg.low_acceptance_threshold
        return UNCALIBRATED_BREAK_EVEN if measured is None else measured

    def decide(self, options: SpeculationOptions | None, *, max_tokens: int | None, load: int,
               key: str, draft_available: bool) -> Decision:
        """The decision for one request.

        ``options``: the request's ``speculation`` extension, or None. ``load``: the unit's
        requests in flight, this one not counted. ``key``: the request's acceptance class.
        """
        options = options or SpeculationOptions()
        k = options.num_speculative_tokens or self.default_k
        off = lambda reason: Decision(False, reason, self.method, 0)  # noqa: E731
        allowed = self.gate.update(load)  # every request moves the gate, whatever its fate
        if options.enabled is False:
            return off("client_override")
        if self.method is None:
            return Decision(False, "not_configured", None, 0)
        if not draft_available:
            return off("draft_unavailable")
        if options.enabled:
            return Decision(True, "client_override", self.method, k)
        if (max_tokens is not None and max_tokens < self.cfg.short_output_tokens
                and not self.per_step_k_suffices):
            return off("short_output")
        if not allowed:
            return off("high_concurrency")
        stats = self.acceptance.classes.get(key)
        if stats is not None and stats.low and not self.per_step_k_suffices:
            if self.acceptance.is_probe(stats):
                return Decision(True, "probe", self.method, k)
            return off("low_acceptance")
        return Decision(True, "default", self.method, k, adaptive=self.adaptive)

    def observe(self, key: str, decision: Decision, num_draft_tokens: int,
                num_accepted_tokens: int, break_even: float | None) -> None:
        """A finished request's acceptance, for its class (only speculated ones inform it)."""
        if decision.enabled:
            self.acceptance.observe(key, num_draft_tokens, num_accepted_tokens,
                                    self.break_even(break_even))
