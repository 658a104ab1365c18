"""The speculative decoding engine: pure torch, no Ray.

Vocabulary (every name in this package uses it):

- **target**: the model whose output we promise. Its distribution over the next token is
  ``p`` (after the request's temperature / top-k / top-p transform).
- **draft** (or *proposer*): anything that proposes tokens cheaply: a smaller model of the
  same tokenizer (``draft_model``), an EAGLE head that reads the target's hidden states
  (``eagle``), or prompt lookup (``ngram``). A draft model's distribution is ``q``; a proposer
  without a model proposes deterministically, which is the same as a one-hot ``q``.
- **features** (``hidden``): the target's final hidden state at a position (what its LM head
  reads), which the verify forward returns for an ``eagle`` proposer.
- **K** (γ, ``num_speculative_tokens``): how many tokens are drafted per step for a sequence.
  ``max_spec_len`` is the largest K in a batch. A row may draft fewer (``num_draft_tokens``),
  even zero, which is plain target-only decoding.
- **verify**: one target forward over ``[pending tokens..., draft_1..draft_K]`` that yields
  ``p`` at the K + 1 positions that follow the last committed token.
- **accepted** tokens: the leading drafts the rejection sampler keeps
  (``num_accepted_tokens`` in ``0..K``). Greedy: while the draft equals the target argmax.
  Sampled: draft ``x`` kept with probability ``min(1, p(x) / q(x))``.
- **recovered** token: on the first rejection, a token sampled from
  ``norm(max(0, p - q))`` at that position (greedy: the target argmax).
- **bonus** token: when all K drafts are accepted, one more token sampled from ``p`` at
  position K + 1 (greedy: its argmax). Each step therefore emits ``accepted + 1`` tokens.
- **draft** (as a count, ``num_drafts``): one proposal round for one sequence with K ≥ 1.
- **acceptance rate** = accepted tokens / draft tokens.
- **mean acceptance length** = 1 + accepted tokens / drafts: tokens emitted per target
  forward while speculating (1.0 means speculation bought nothing).
- **slot**: a sequence's row in a KV cache; its **length** is how many tokens have their keys
  and values stored. Rollback is setting the length back.
"""
