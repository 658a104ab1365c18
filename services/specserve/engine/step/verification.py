"""From the verify forward's logits and a step's proposals to the tokens each row emits
(pure functions; the engine's steps 3 and 4 meet here).

The target forward (:meth:`TargetCalls.launch
<specserve.engine.target_calls.TargetCalls.launch>`) returns, per row, logits at its
``num_draft_tokens + 1`` positions. This module groups the rows by kind, stages what each
kind needs of the host (drafts, sampling settings, the noise keys of every position by the
row's seed, uniforms), and calls :mod:`~specserve.engine.step.acceptance`, which does the
arithmetic: the ragged rows padded to one ``[B, K + 1]`` batch (K = ``max_spec_len``, the
most drafts of any row), ``p`` and ``q`` after the request's sampling transform, the noise
drawn from those keys, the rule. Rows are verified in three calls, one per kind:

- **greedy** rows: drafts kept while they equal the target argmax (:func:`verify_greedy`);
- **seeded** sampled rows: drafter-invariant verification, so the text is the target-only
  text of the seed at any K, in any batch (:func:`verify_seeded`);
- **unseeded** sampled rows: the rejection test, which accepts more (:func:`verify_sampled`).

A row whose proposal is a token tree (``Proposal.parents``) is verified alone by
:func:`verify_tree` (the tree rules of :mod:`~specserve.engine.step.acceptance`: the greedy
walk, the drafter-invariant walk with the chain's noise per depth, or multi-candidate
rejection with draws from :func:`~specserve.engine.step.sampling.step_generator`).

On the compiled path the greedy rows' verification runs inside the forward's graph
(:func:`~specserve.engine.step.acceptance.greedy_in_bucket`, installed by the worker as the
graph's verdict): the step's result is then a graph output, and :func:`judge` takes it as it
is (``judged``).

What a kind needs of the host (drafts, sampling settings, noise keys, uniforms) is known
before the target's forward: the worker stages it (:func:`stage`) into the forward's
:class:`~specserve.engine.runtime.forward_batch.Upload`, so a step makes one host-to-device copy;
called alone, each kind sends its own in one copy.

Every draw is a function of (seed, position) alone (:mod:`~specserve.engine.step.sampling`), never
of the batch or of K, which is why rows can be regrouped and padded freely.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from specserve.config import SamplingParams
from specserve.engine.grammar import masked
from specserve.engine.runtime.forward_batch import Upload
from specserve.engine.runtime.kernels import argmax as row_argmax
from specserve.engine.step.acceptance import (
    RejectionOutput,
    draft_probs,
    greedy_rejection_sample,
    pad_drafts,
    pad_rows,
    sampled_chains,
    seeded_chains,
    target_probs,
    tree_accept_greedy,
    tree_accept_sampled,
    tree_accept_seeded,
)
from specserve.engine.step.penalties import penalize
from specserve.engine.step.proposal import TopK
from specserve.engine.step.sampling import (
    compute_probs_each,
    compute_probs_rows,
    noise_key,
    noise_keys,
    position_uniform,
    settings_host,
    step_generator,
    with_logit_bias,
)
from specserve.engine.step.verify_batch import Verdict, VerifyRow


def chain_kinds(rows: list[VerifyRow]) -> dict[str, list[VerifyRow]]:
    """The chain rows (no tree) of each kind: greedy, seeded, unseeded (module docstring)."""
    chains = [r for r in rows if r.proposal.parents is None]
    sampled = [r for r in chains if not r.params.greedy]
    return {"greedy": [r for r in chains if r.params.greedy],
            "seeded": [r for r in sampled if r.params.seed is not None],
            "unseeded": [r for r in sampled if r.params.seed is None]}


def kind_inputs(kind: str, rows: list[VerifyRow]) -> dict[str, torch.Tensor]:
    """What one kind's rows need of the host (module docstring), on the host: the drafts
    (``[B, K + 1]``: padded with 0, then their count), and for sampled rows each verified
    position's sampling settings and noise key, where each key's draw goes (seeded) and the
    rejection test's uniforms (unseeded). Greedy rows without a draft need nothing."""
    counts = [r.num_logits for r in rows]
    if kind == "greedy" and max(counts) == 1:
        return {}
    inputs = {"drafts": pad_drafts([r.proposal for r in rows])}
    if kind != "greedy":
        inputs["settings"] = settings_host([r.params for r in rows], counts)
        inputs["keys"] = noise_keys([noise_key(r.seed, r.position + j)
                                     for r, n in zip(rows, counts) for j in range(n)])
    if kind == "seeded":  # where each key's draw goes in [B, K + 1] (row-major: as drawn)
        inputs["drawn_at"] = torch.tensor([i * max(counts) + j for i, n in enumerate(counts)
                                           for j in range(n)], dtype=torch.long)
    if kind == "unseeded":
        inputs["uniform"] = torch.tensor(
            [[position_uniform(r.seed, r.position + j) if j < n - 1 else 1.0
              for j in range(max(counts) - 1)] for r, n in zip(rows, counts)],
            dtype=torch.float32)
    return inputs


Staged = dict[str, dict[str, int]]  # per kind, each input's index in the step's Upload


def stage(rows: list[VerifyRow], upload: Upload) -> Staged:
    """Each chain kind's :func:`kind_inputs`, added to ``upload``, the forward's (the worker
    stages a verify this way: one host-to-device copy a step); :func:`judge` reads them there."""
    return {kind: {name: upload.add(x) for name, x in kind_inputs(kind, picked).items()}
            for kind, picked in chain_kinds(rows).items() if picked}


def _on_device(kind: str, rows: list[VerifyRow], device: torch.device,
               staged: tuple[Upload, Staged] | None) -> dict[str, torch.Tensor]:
    """A kind's inputs on ``device``: where :func:`stage` put them (sent with the forward's),
    or sent now in one copy of their own."""
    if staged is None:
        upload = Upload()
        indices = {name: upload.add(x) for name, x in kind_inputs(kind, rows).items()}
    else:
        upload, indices = staged[0], staged[1].get(kind, {})
    upload.send(device)
    return {name: upload[i] for name, i in indices.items()}


# A row's result on the device: a chain's sampler call and its row there, or a tree's Verdict
# (walked on the host), and the logits its log-probabilities are read from (its logits as
# decided on for a sampled row, the model's for a greedy one: emitted_logprobs)
Outcome = tuple[RejectionOutput | Verdict, int, torch.Tensor]


def judge(rows: list[VerifyRow], logits: list[torch.Tensor],
          staged: tuple[Upload, Staged] | None = None, judged: RejectionOutput | None = None
          ) -> dict[VerifyRow, Outcome]:
    """Verify a step's rows, each chain kind (module docstring) in one sampler call, each
    tree alone, on the device: nothing is read back yet (a worker queues the next forward
    before it reads: ``ModelWorker.launch``); :func:`verdicts` reads. ``logits``: each
    row's ``[num_logits, V]``, in row order, or ``[num_logits]`` argmax ids when every row of
    the forward was greedy. ``staged``: the step's upload and :func:`stage`'s indices into it
    (None: each kind sends its own). ``judged``: the greedy rows' result, made inside the
    forward's graph (``acceptance.greedy_in_bucket``) where every row is a greedy chain.

    A row with a ``logit_bias``, penalties or a ``mask`` (a grammar's, a ``min_tokens``'s) is
    verified on its logits with those applied: the constrained target distribution, at every
    position (greedy argmax, p of the rejection test, the recovered and bonus tokens alike)."""
    given = dict(zip(rows, logits, strict=True))
    decided = {row: x if row.plain else constrain_logits(x, row) for row, x in given.items()}
    outcomes: dict[VerifyRow, Outcome] = {}
    trees = [r for r in rows if r.proposal.parents is not None]
    sampled = [r for r in trees if not r.params.greedy]  # their p in one transform
    probs = dict(zip(sampled, compute_probs_rows([decided[r] for r in sampled],
                                                 [r.params for r in sampled]))) if sampled else {}
    for row in trees:
        outcomes[row] = (verify_tree(row, decided[row], probs.get(row)), 0, _logprobs_of(row, given, decided))
    rules = {"greedy": verify_greedy, "seeded": verify_seeded, "unseeded": verify_sampled}
    for kind, picked in chain_kinds(rows).items():
        if not picked:
            continue
        if judged is not None:
            assert kind == "greedy" and len(picked) == len(rows), "a verdict covers greedy chains"
            out = judged
        else:
            inputs = _on_device(kind, picked, logits[0].device, staged)
            out = rules[kind](picked, [decided[r] for r in picked], inputs)
        outcomes.update((row, (out, j, _logprobs_of(row, given, decided))) for j, row in enumerate(picked))
    return outcomes


def _logprobs_of(row: VerifyRow, given: dict[VerifyRow, torch.Tensor],
                 decided: dict[VerifyRow, torch.Tensor]) -> torch.Tensor:
    """The logits a row's log-probabilities are read from (:func:`verdicts`)."""
    return given[row] if row.params.greedy else decided[row]


def constrain_logits(logits: torch.Tensor, row: VerifyRow) -> torch.Tensor:
    """``logits`` (``[n, V]``) as ``row`` is decided on: its request's ``logit_bias`` added,
    its penalties for the tokens before each position (``penalties.py``), then its mask
    applied; the same tensor where it has none of them."""
    logits = with_logit_bias(logits, row.params.logit_bias)
    if row.history is not None:
        logits = penalize(logits, row.params, row.history, row.proposal.token_ids, row.proposal.parents)
    return logits if row.mask is None else masked(logits, row.mask)


def verdicts(rows: list[VerifyRow], outcomes: dict[VerifyRow, Outcome]) -> list[Verdict]:
    """Each row's :class:`Verdict`, in row order, read back (one read per sampler call), with
    its emitted tokens' log-probabilities where its request asked: a sampled row's of its
    constrained distribution (what the token was drawn from), a greedy row's the model's
    log-softmax, as without a grammar."""
    out = []
    for row in rows:
        res, j, logits = outcomes[row]
        verdict = res if isinstance(res, Verdict) else Verdict(res.emitted(j), res.accepted(j))
        if row.params.logprobs is not None:
            verdict = replace(verdict, logprobs=emitted_logprobs(row.params, logits, verdict.emitted,
                                                                 verdict.path))
        out.append(verdict)
    return out


def send(outcomes: dict[VerifyRow, Outcome]) -> None:
    """Queue each sampler call's result to the host (:meth:`RejectionOutput.send`)."""
    calls = {id(res): res for res, _, _ in outcomes.values() if isinstance(res, RejectionOutput)}
    for res in calls.values():
        res.send()


def token_logprobs(logp: torch.Tensor, tokens: list[int], top: int
                   ) -> list[tuple[float, list[tuple[int, float]]]]:
    """Row i of ``logp`` (``[m, V]`` log-probabilities): ``tokens[i]``'s value and the ``top``
    likeliest ``(token, value)`` pairs, read back to the host in one copy each."""
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    if not top:
        return [(value, []) for value in chosen]
    top_values, top_ids = logp.topk(top, dim=-1)
    return list(zip(chosen, [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_values.tolist())]))


def prompt_token_logprobs(logp: torch.Tensor, tokens: list[int], top: int
                          ) -> list[tuple[float, list[tuple[int, float]], int]]:
    """:func:`token_logprobs` with each token's rank in its row (1: the likeliest; vLLM's
    ``rank``: one more than the tokens of a greater value), for prompt tokens."""
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])
    ranks = ((logp > chosen).sum(dim=1) + 1).tolist()
    return [(value, alternatives, rank)
            for (value, alternatives), rank in zip(token_logprobs(logp, tokens, top), ranks)]


def emitted_logprobs(params: SamplingParams, logits: torch.Tensor, emitted: list[int],
                     path: list[int] | None) -> list[tuple[float, list[tuple[int, float]]]]:
    """Each emitted token's log-probability and the ``params.logprobs`` likeliest tokens', from
    the target's logits row that decided it (a chain's rows in order; a tree's root row, then
    its kept nodes' rows). Sampled requests: log p after their transform (what the token was
    drawn from: -inf outside top-k / top-p); greedy ones: the model's log-softmax. The same
    rows decide the same tokens without speculation, so the values are target-only's.

    logits: ``[num_draft_tokens + 1, V]`` (not argmax ids)."""
    assert logits.ndim == 2, "logprobs need the logits, not argmax ids"
    index = list(range(len(emitted))) if path is None else [0, *(n + 1 for n in path)]
    x = logits[index].float()  # [len(emitted), V]
    if params.greedy:
        logp = torch.log_softmax(x, dim=-1)
    else:
        logp = compute_probs_each(x, [params], [x.shape[0]]).log()
    return token_logprobs(logp, emitted, params.logprobs)


def verify_tree(row: VerifyRow, logits: torch.Tensor, p: torch.Tensor | None) -> Verdict:
    """One row whose drafts form a tree; logits: ``[N + 1, V]`` (or argmax ids, greedy), row
    0 after the row's last token, row i + 1 after node i; ``p``: a sampled row's ``[N + 1, V]``
    after its transform (None for a greedy row). Its verdict, walked on the host."""
    parents, tokens = row.proposal.parents, row.proposal.token_ids
    if row.params.greedy:
        return tree_accept_greedy(parents, tokens, logits)
    if row.params.seed is not None:
        return tree_accept_seeded(parents, tokens, p, row.seed, row.position)
    q = row.proposal.probs
    if isinstance(q, TopK):
        q = q.dense(p.shape[-1], p.device)
    return tree_accept_sampled(parents, tokens, p, q, step_generator(row.seed, row.position))


def verify_greedy(rows: list[VerifyRow], logits: list[torch.Tensor],
                  inputs: dict[str, torch.Tensor] | None = None) -> RejectionOutput:
    """Greedy verification against the target argmax. ``inputs``: :func:`kind_inputs`' on
    the logits' device (None: sent here).

    logits[i]: ``[num_draft_tokens_i + 1, V]`` logits or ``[num_draft_tokens_i + 1]`` argmax ids.
    """
    assert len(rows) == len(logits) and all(x.ndim in (1, 2) for x in logits)
    if inputs is None:
        inputs = _on_device("greedy", rows, logits[0].device, None)
    drafts = inputs.get("drafts")  # none staged where no row has a draft: K = 0
    if drafts is None and all(x.ndim == 1 for x in logits):  # decodes' argmax ids: each row emits
        return RejectionOutput.unpack(F.pad(torch.stack(logits), (1, 0)))  # its own, 0 accepted
    max_spec_len = 0 if drafts is None else drafts.shape[1] - 1
    argmax = torch.stack([pad_rows(x if x.ndim == 1 else row_argmax(x), max_spec_len + 1, 0)
                          for x in logits])  # [B, K + 1]
    if drafts is None:
        drafts = argmax.new_zeros(len(rows), 1)  # [B, 0 drafts, then their count 0]
    return greedy_rejection_sample(drafts[:, :-1], drafts[:, -1], argmax)


def verify_seeded(rows: list[VerifyRow], logits: list[torch.Tensor],
                  inputs: dict[str, torch.Tensor] | None = None) -> RejectionOutput:
    """Drafter-invariant verification: the text is the target-only text of the seed.
    ``inputs``: :func:`kind_inputs`' on the logits' device (None: sent here).

    logits[i]: ``[num_draft_tokens_i + 1, V]``.
    """
    assert len(rows) == len(logits)
    inputs = inputs or _on_device("seeded", rows, logits[0].device, None)
    draft_token_ids, num_draft_tokens = inputs["drafts"][:, :-1], inputs["drafts"][:, -1]  # [B, K], [B]
    p = target_probs([r.params for r in rows], logits, draft_token_ids.shape[1],
                     inputs["settings"])  # [B, K + 1, V]
    return seeded_chains(draft_token_ids, num_draft_tokens, p, inputs["keys"], inputs["drawn_at"])


def verify_sampled(rows: list[VerifyRow], logits: list[torch.Tensor],
                   inputs: dict[str, torch.Tensor] | None = None) -> RejectionOutput:
    """The rejection test (Leviathan), its draws fixed by (seed, position). ``inputs``:
    :func:`kind_inputs`' on the logits' device (None: sent here).

    logits[i]: ``[num_draft_tokens_i + 1, V]``.
    """
    assert len(rows) == len(logits)
    inputs = inputs or _on_device("unseeded", rows, logits[0].device, None)
    draft_token_ids, num_draft_tokens = inputs["drafts"][:, :-1], inputs["drafts"][:, -1]  # [B, K], [B]
    max_spec_len = draft_token_ids.shape[1]
    p = target_probs([r.params for r in rows], logits, max_spec_len, inputs["settings"])  # [B, K + 1, V]
    q = draft_probs([r.proposal for r in rows], draft_token_ids, p.shape[-1])  # [B, K, V] or None
    return sampled_chains(draft_token_ids, num_draft_tokens, p, q, inputs["uniform"], inputs["keys"])
