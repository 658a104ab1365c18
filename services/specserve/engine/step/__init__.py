"""The step: which sequences run, how many tokens each drafts, and what the target keeps.

A step's rows are one :class:`~specserve.engine.step.step_batch.StepBatch` (``step_batch.py``),
built by the scheduler (``scheduler.py``: admission, the prefill budget, preemption, forks of
``n`` samples) and filled in turn: K per row by the K planner (``k_planner.py``, with the cost
model controller of ``adaptive.py`` and ``cost_model.py``), drafts by the draft link
(``drafts/``), then the target's verdicts: ``verification.py`` turns a verify's logits and the
proposals (``proposal.py``) into emitted tokens with the rules of ``acceptance.py`` and the
distributions and counter-based draws of ``sampling.py``, each position's logits first
penalized for the tokens before it (``penalties.py``). A request inside the engine is a
``sequence.py`` :class:`~specserve.engine.step.sequence.Sequence`; everything counted goes to
``stats.py``. The loop that runs a step is ``engine/spec_decode.py``.
"""
