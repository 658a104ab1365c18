"""The speculation cost model: when does drafting pay, and how far should it go?

With per-token acceptance rate α (each drafted token accepted independently with probability
α), speculation length γ, draft step cost c and verify cost v, both relative to one plain
target decode step *at the current batch size*, one speculative step emits on average
(1 − α^(γ+1)) / (1 − α) tokens and costs γ·c + v, so (Leviathan et al. 2023, eq. 1 and
Thm 3.8, with the verify cost made explicit)::

    speedup(α, γ, c, v) = (1 − α^(γ+1)) / ((1 − α) · (γ·c + v))

Worked example: α = 0.8, γ = 4, c = 0.05, v = 1.1 → (1 − 0.8^5) / (0.2 · 1.3) = 2.59.
On a memory-bound GPU v ≈ 1; on a CPU or a busy GPU v grows with γ and the optimum moves down.

A proposer that drafts only where it finds something (n-gram and suffix: a match) drafts on a
``share`` s of the steps; the others emit one token each. With v the mean verify cost over all
steps and γ·c a drafting step's draft cost, a step emits s·E + (1 − s) tokens on average
(E the tokens of a drafting step, above) for s·γ·c + v: at s = 1 the formula above. Without
it, a proposer that rarely drafts would be predicted as if every step drafted (an n-gram
proposer on a random-weight model, where it seldom finds a match).
"""

from __future__ import annotations


def expected_tokens_per_step(alpha: float, gamma: float, share: float = 1.0) -> float:
    """E[tokens emitted per speculative step] = (1 − α^(γ+1)) / (1 − α); γ + 1 when α = 1;
    where only a ``share`` of the steps draft (module docstring), that share of it and one
    token for each other step."""
    assert 0.0 <= alpha <= 1.0 and gamma >= 0 and 0.0 <= share <= 1.0
    drafting = float(gamma + 1) if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)
    return share * drafting + (1.0 - share)


def expected_speedup(alpha: float, gamma: float, c: float, v: float, share: float = 1.0) -> float:
    """Predicted speedup over target-only decoding (1.0 at γ = 0 with v = 1); ``share``: the
    steps that draft (module docstring), ``γ·c`` the draft cost of one of them.

    >>> round(expected_speedup(0.8, 4, 0.05, 1.1), 2)
    2.59
    >>> round(expected_speedup(0.8, 4, 0.05, 1.1, share=0.25), 2)  # a quarter of the steps draft
    1.38
    """
    assert c >= 0 and v > 0
    return expected_tokens_per_step(alpha, gamma, share) / (share * gamma * c + v)
