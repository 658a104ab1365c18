"""Proposers: what drafts the K tokens the target verifies.

Each proposer is its own module; they share the small interface in :mod:`.base`, and
:mod:`specserve.methods` is their registry (one line per proposer).
"""
