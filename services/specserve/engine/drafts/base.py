"""The interface every proposer implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

from specserve.engine.grammar import GrammarCompiler
from specserve.engine.step.proposal import DraftRequest, Proposal


class Proposer(ABC):
    """Drafts tokens. Stateful proposers (a draft model's cache) track sequences by id.

    A proposer that lives elsewhere (a Ray actor) raises :class:`ProposerUnavailable` from any
    method when it cannot answer; the engine then decodes target-only until it is back.
    """

    method: str  # its row in the registry (specserve.methods.PROPOSERS)
    needs_hidden = False  # True: reads the target's hidden states (EAGLE); the engine sends them
    drafts_to_cap = False  # True: may draft up to DraftRequest.cap, past the coordinator's k

    @classmethod
    def from_config(cls, spec) -> Proposer:
        """A proposer without a draft model, from its ``SpeculativeConfig`` (builder.py)."""
        raise NotImplementedError(f"{cls.__name__} drafts with a model: use from_draft")

    @classmethod
    def from_draft(cls, draft, *, target_vocab_size: int | None = None,
                   options: dict | None = None) -> Proposer:
        """A proposer around a loaded draft (a ``ModelWorker``), drafting over the target's
        ``target_vocab_size`` ids, with its ``speculative.<method>`` settings as a dict
        (``options``: they cross to a draft actor as plain data; builder.py)."""
        raise NotImplementedError(f"{cls.__name__} has no draft model: use from_config")

    def warm_up(self) -> dict:
        """Run the draft's model in every shape drafting will use, before the first request
        (a compiled draft compiles and captures here, not inside a step; ``ModelWorker.warm_up``);
        its report. A proposer without a model has nothing to warm: ``{}``."""
        return {}

    def start(self, seq_id: int, seed: int) -> None:
        """A new sequence begins (reserve state; a second start of one id starts it afresh).
        ``seed`` is the request's: the draft's draws derive from it and the position."""

    def use_grammars(self, compiler: GrammarCompiler | None) -> None:
        """Compile requests' grammars (``DraftRequest.grammar``) with ``compiler``, to draft
        within them (None: draft freely). A proposer without a model ignores it."""

    def fork(self, seq_id: int, parent_id: int, seed: int, num_tokens: int) -> None:
        """A new sequence begins whose first ``num_tokens`` tokens are ``parent_id``'s (one of
        ``n`` samples of a prompt, ``n > 1``): it may start from a copy of the parent's state
        over them. By default it starts afresh and catches up from its tokens."""
        self.start(seq_id, seed)

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        """Draft for a batch; one proposal per request, in order, each at most ``k`` long."""

    def commit(self, seq_id: int, num_valid_tokens: int) -> None:
        """The sequence's first ``num_valid_tokens`` tokens are final; drop state past them."""

    def finish(self, seq_id: int) -> None:
        """The sequence ended or was aborted (release state)."""

    def learn(self, token_ids: list[int], prompt_len: int) -> None:
        """A sequence finished normally (stop, EOS or length, not aborted): a proposer that
        drafts from earlier responses keeps what it wants of ``token_ids[prompt_len:]``.
        Called in the engine's process, before :meth:`finish`."""

    def reset(self) -> None:
        """Forget every sequence (a draft re-attached after a loss: what it held is stale)."""

    def state(self) -> dict[str, float]:
        """What the proposer holds across requests, for the metrics (gauges named here;
        ``specserve:proposer_state{name}``): suffix decoding's response cache, for one."""
        return {}

    def flush(self) -> None:
        """Deliver buffered bookkeeping now (a remote proposer; called when the unit is idle)."""
