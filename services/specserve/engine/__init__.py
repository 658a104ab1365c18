"""The speculative decoding engine: pure torch, no Ray.

Vocabulary (every name in this package uses it):

- **target**: the model whose output we promise. Its distribution over the next token is
  ``p`` (after the request's temperature / top-k / top-p transform).
- **draft** (or *proposer*): anything that proposes tokens cheaply: a smaller model of the
  same tokenizer (``draft_model``), an EAGLE head that reads the target's hidden states
  (``eagle``), or prompt lookup (``ngram``, ``suffix``). A draft model's distribution is
  ``q``; a token chosen deterministically from the context (an n-gram or suffix-tree match,
  an EAGLE top-k expansion) has for q a point mass on it, passed as None.
- **features** (``hidden``): the target's final hidden state at a position (what its LM head
  reads), which the verify forward returns for an ``eagle`` proposer.
- **K** (γ, ``num_speculative_tokens``): how many tokens are drafted per step for a sequence.
  ``max_spec_len`` is the largest K in a batch. A row may draft fewer (``num_draft_tokens``),
  even zero, which is plain target-only decoding.
- **chain** and **tree**: a chain is K drafts in a row; a tree drafts several continuations
  at once and lets the target keep the longest it agrees with (SpecInfer, Medusa, EAGLE;
  layout in ``runtime/token_tree.py``), from its **root**, the row's last committed token.
- **verify**: one target forward over ``[pending tokens..., draft_1..draft_K]`` (or the tree's
  nodes) that yields ``p`` at the K + 1 positions that follow the last committed token.
- **accepted** tokens: the drafts the target keeps, a prefix of the chain or a path from the
  tree's root (``num_accepted_tokens`` in ``0..K``). Greedy: while the draft equals the
  target argmax. Sampled: draft ``x`` kept with probability ``min(1, p(x) / q(x))``.
- **recovered** token: the final token when a draft was rejected (a tree: when every child of
  the last accepted node was), the target's token in its place: sampled from
  ``norm(max(0, p - q))`` at that position (greedy: the target argmax).
- **bonus** token: the final token when nothing was rejected (all K drafts kept, or the
  tree's path ended at a leaf): one more token from ``p`` after the last draft (greedy: its
  argmax), free from the same forward.
- **emitted** = the accepted tokens, then one final token (recovered or bonus):
  ``accepted + 1`` tokens a step, never none. ``PLACEHOLDER`` (-1) fills a chain output's
  positions after a row's emitted tokens.
- **draft** (as a count, ``num_drafts``): one proposal round for one sequence with K ≥ 1.
- **acceptance rate** = accepted tokens / draft tokens.
- **mean acceptance length** = 1 + accepted tokens / drafts: tokens emitted per target
  forward while speculating (1.0 means speculation bought nothing).
- **slot**: a sequence's row in a KV cache; its **length** is how many tokens have their keys
  and values stored. Rollback is setting the length back.

The engine is four folders and the loop over them (``farm-studio look`` draws them as a
stack: each imports only those below it):

- ``kv/``: the KV cache (slots or paged blocks with prefix caching);
- ``runtime/``: the model's forward and its kernels, over the KV cache;
- ``step/``: a step's rows, the scheduler, K, verification and sampling;
- ``drafts/``: the proposers, trained heads and published formats, and the draft link;
- loose modules: the loop (``spec_decode.py``), what a step asks of the target and
  launching ahead (``target_calls.py``), the target's worker (``worker.py``: a model, its
  cache and the verify next to the logits), loading (``loader.py``, ``shard_loader.py``),
  the tokenizer, structured outputs' grammars (``grammar.py``) and ``builder.py``, which
  assembles an engine from its configuration.

The engine's step (``spec_decode.py``, :class:`SpecDecodeEngine`) is a thin loop over named
parts, one module each, side by side (the scheduler, the draft link and the K planner import
none of each other: the engine hands each what it needs):

- **step batch** (``step/step_batch.py``, :class:`StepBatch`): one step's rows in forward order,
  each a **row** (a sequence that verifies: its start, K cap, K, proposal, grammar mask,
  verdict, features) or a **chunk** (a prompt chunk it prefills); every part fills its fields
  of the same rows, and the step's phase times are its **clock**.
- **scheduler** (``step/scheduler.py``): the sequences, waiting and running; admission, the step's
  rows under its prefill budget (chunks), preemption, and the ``n`` samples of a request
  waiting to **fork** from its first sample's prefill.
- **draft link** (``drafts/draft_link.py``): the proposer as the step sees it: which sequences are
  **attached** to it, the proposer call, the target features it reads, and its loss and
  re-attachment (a lost draft costs speed, never output).
- **K planner** (``step/k_planner.py``): every decision about K: a row's **cap** (its request's K,
  ``max_tokens``, the context), its K each step, and what the step tells the K
  **controller** (``step/adaptive.py``, the cost model that picks K).
- **target calls** (``target_calls.py``): a step's verify launched and read back into its
  rows, prompt chunks in the same forward; on a GPU the next plain decode step **launched
  ahead**, before this one is read, its rows each **following** a row of this one.
- **acceptance** (``step/acceptance.py``): the rules that decide the accepted, recovered and bonus
  tokens, for chains and token trees side by side; ``verification.py`` runs them over a
  step's rows, next to the logits.
- **forward batch** (``runtime/forward_batch.py``): what one model forward takes
  (:class:`ForwardBatch`) and returns (:class:`Forwarded`), for the target and every draft.
- **counters** (``step/stats.py``, :class:`EngineCounters`): everything the engine counts, filled by
  the step and read whole (a snapshot) by the unit, its metrics and ``/v1/units/stats``.
- **proposal** (``step/proposal.py``): what crosses between a proposer and the target
  (``DraftRequest``, ``Proposal``, ``TopK``), imported by both sides.

Around the engine (``specserve/serve/``), one word each:

- **unit**: one Serve replica of ``SpeculationUnit`` with the **draft group** (the draft
  model's actor, a ``DraftWorker``) and the **target group** (its tensor-parallel **ranks**,
  ``TargetRank``) it starts: one placement group, the unit of scaling; KV never leaves it.
- **coordinator**: the unit's own process (bundle 0 of its placement group,
  ``coordinator_cpus``): it runs the engine, whose target and proposer are the groups'
  clients (the card's "speculation coordinator").
- **engine loop** (``serve/engine_loop.py``): the coordinator's thread that owns the engine,
  and the asyncio side that feeds it requests.
- **draft head** (``drafts/draft_head.py``): a trained draft (EAGLE's head, or a small decoder on the
  target's embeddings); **training** (``specserve/training/``, ``specserve train-draft``) makes
  one.
"""
