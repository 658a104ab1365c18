"""Proposers: what drafts the K tokens the target verifies.

Each proposer is its own module; they share the small interface in :mod:`.base`.
"""

from specserve.engine.proposers.base import DraftRequest, Proposal, Proposer

__all__ = ["DraftRequest", "Proposal", "Proposer"]
