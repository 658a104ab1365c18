"""A model-free proposer first, a draft model for the rest (``speculative.first``).

Where a model-free proposer is confident (prompt lookup: the sequence's last 2+ tokens
occurred before; suffix decoding: a match whose continuation is likely enough), its draft is
free and often long (summaries, code, revisions, the loops small models fall into); only the
other rows ask the draft model. Every draft is a draft like any other to the rejection
sampler (a model-free draft is deterministic: its q is one-hot), so mixing them per row keeps
the output exactly the target's.

Which one, per row and step. A first proposer that estimates its own acceptance (suffix
decoding: the expected accepted length from its counts) gets the row when that estimate,
scaled by how its estimates have come true here (accepted / predicted, measured), is at least
the tokens the model's drafts have had accepted per step here (measured); the model's time is
not counted, so ties go to the free proposer. One without an estimate (n-gram lookup) gets
every row it matches. Both measurements are exponentially decayed means over the steps each
proposer drafted, read back from :meth:`commit` (the committed length less the length the
proposal was made at is the accepted count). The calibration starts from a prior of 1 worth
``PRIOR_STEPS`` steps, and every ``PROBE_EVERY``-th row the first proposer is refused goes to
it anyway, so a bad start (a warm cache's first guesses, all wrong) cannot lock it out: a
proposer that never drafts would never be measured again.

How far. The model drafts at most the coordinator's K for the step (``DraftRequest.k``,
chosen from the measured acceptance and costs). A first proposer that estimates its
acceptance drafts up to the row's cap (``DraftRequest.cap``: its request's K, max_tokens and
context): its drafts cost nothing to make and its own confidence limits them, while a K
brought down by a model's rejections would cut its long runs short. One without an estimate
(n-gram lookup) keeps to the coordinator's K.

Rows the first proposer serves still reach the model proposer with ``k = 0`` when it reads
the target's features: EAGLE must receive every feature once, in order, even on steps where
it drafts nothing.
"""

from __future__ import annotations

import dataclasses

from specserve.engine.drafts.base import Proposer
from specserve.engine.step.proposal import DraftRequest, Proposal


class DecayedMean:
    """An exponentially decayed mean; ``None`` until observed, unless it has a ``prior``,
    which counts as ``prior_steps`` observations that never decay."""

    def __init__(self, decay: float = 0.95, prior: float | None = None,
                 prior_steps: float = 0.0) -> None:
        self.decay = decay
        self.total = self.weight = 0.0
        self.prior_total = 0.0 if prior is None else prior * prior_steps
        self.prior_weight = 0.0 if prior is None else prior_steps

    def observe(self, value: float) -> None:
        self.total = self.decay * self.total + value
        self.weight = self.decay * self.weight + 1.0

    @property
    def value(self) -> float | None:
        weight = self.weight + self.prior_weight
        return (self.total + self.prior_total) / weight if weight else None


PRIOR_STEPS = 4.0   # the calibration's prior (1.0: estimates come true) counts as this many steps
PROBE_EVERY = 16    # every this many refusals, the first proposer drafts the row anyway


class HybridProposer(Proposer):
    drafts_to_cap = True  # the first proposer drafts up to the row's cap (module docstring)

    def __init__(self, first: Proposer, model: Proposer) -> None:
        self.first = first
        self.model = model
        self.method = model.method
        self.needs_hidden = model.needs_hidden
        self.model_accepted = DecayedMean()   # tokens accepted per step the model drafted
        self.first_calibration = DecayedMean(prior=1.0, prior_steps=PRIOR_STEPS)  # accepted / estimated
        self.first_accepted = DecayedMean()   # tokens accepted per step the first drafted
        # seq_id -> (drafted by the first?, the sequence's length then, the first's estimate)
        self._pending: dict[int, tuple[bool, int, float | None]] = {}
        self.rows_first = self.rows_model = 0  # rows each proposer drafted for
        self._refused = 0

    def warm_up(self) -> dict:
        return self.model.warm_up()

    def start(self, seq_id: int, seed: int) -> None:
        self.first.start(seq_id, seed)
        self.model.start(seq_id, seed)

    def use_grammars(self, compiler) -> None:
        self.model.use_grammars(compiler)

    def fork(self, seq_id: int, parent_id: int, seed: int, num_tokens: int) -> None:
        self.first.fork(seq_id, parent_id, seed, num_tokens)
        self.model.fork(seq_id, parent_id, seed, num_tokens)

    def commit(self, seq_id: int, num_valid_tokens: int) -> None:
        pending = self._pending.pop(seq_id, None)
        if pending is not None:
            by_first, length, estimate = pending
            accepted = num_valid_tokens - length
            if by_first:
                self.first_accepted.observe(accepted)
                if estimate:
                    self.first_calibration.observe(accepted / estimate)
            else:
                self.model_accepted.observe(accepted)
        self.first.commit(seq_id, num_valid_tokens)
        self.model.commit(seq_id, num_valid_tokens)

    def learn(self, token_ids: list[int], prompt_len: int) -> None:
        self.first.learn(token_ids, prompt_len)
        self.model.learn(token_ids, prompt_len)

    def finish(self, seq_id: int) -> None:
        self._pending.pop(seq_id, None)
        self.first.finish(seq_id)
        self.model.finish(seq_id)

    def reset(self) -> None:
        self._pending.clear()
        self.first.reset()
        self.model.reset()

    def flush(self) -> None:
        self.model.flush()

    def state(self) -> dict[str, float]:
        return self.first.state() | self.model.state()

    def _takes(self, proposal: Proposal) -> bool:
        """The first proposer's draft gets the row (the module docstring)."""
        if not proposal.token_ids:
            return False
        model = self.model_accepted.value
        if proposal.expected_accepted is None or model is None:
            return True
        if proposal.expected_accepted * self.first_calibration.value >= model:
            return True
        self._refused += 1
        return self._refused % PROBE_EVERY == 0

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        looked = self.first.propose([r if r.cap is None else dataclasses.replace(r, k=r.cap)
                                     for r in requests])
        # Only an estimate-bearing draft is limited by its own confidence; others keep to k.
        looked = [p if p.expected_accepted is not None
                  else dataclasses.replace(p, token_ids=p.token_ids[:r.k])
                  for p, r in zip(looked, requests)]
        takes = [self._takes(p) for p in looked]
        asks = [dataclasses.replace(r, k=0) if take else r for r, take in zip(requests, takes)]
        rows = [i for i, r in enumerate(asks) if r.k > 0 or (self.needs_hidden and r.hidden is not None)]
        drafted = dict(zip(rows, self.model.propose([asks[i] for i in rows]))) if rows else {}
        out = []
        for i, (r, take) in enumerate(zip(requests, takes)):
            proposal = looked[i] if take else drafted.get(i, Proposal([]))
            proposal = dataclasses.replace(
                proposal, source=self.first.method if take else self.model.method)
            if proposal.token_ids:
                self._pending[r.seq_id] = (take, len(r.token_ids), looked[i].expected_accepted)
                self.rows_first += take
                self.rows_model += not take
            out.append(proposal)
        return out
