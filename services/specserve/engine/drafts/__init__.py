"""The drafts: everything that proposes tokens for the target to verify.

The proposers (``base.py``'s :class:`~specserve.engine.drafts.base.Proposer`): prompt lookup
(``ngram.py``), suffix decoding (``suffix.py``), a draft model (``draft_model.py``), an EAGLE
head (``eagle.py``, its dynamic token trees grown by ``tree_growth.py``) and a hybrid of a
model-free part in front of a model (``hybrid.py``). A trained head and its files are
``draft_head.py``; the published EAGLE formats it reads, ``published_drafts.py``. The engine
sees the proposer through ``draft_link.py``: which sequences are attached, the call each step,
the target features it ships, and what happens when the proposer stops answering.
"""
