"""The speculation cost model: when does drafting pay, and how far should it go?

With per-token acceptance rate α (each drafted token accepted independently with probability
α), speculation length γ, draft step cost c and verify cost v, both relative to one plain
target decode step *at the current batch size*, one speculative step emits on average
(1 − α^(γ+1)) / (1 − α) tokens and costs γ·c + v, so (Leviathan et al. 2023, eq. 1 and
Thm 3.8, with the verify cost made explicit)::

    speedup(α, γ, c, v) = (1 − α^(γ+1)) / ((1 − α) · (γ·c + v))

Worked example: α = 0.8, γ = 4, c = 0.05, v = 1.1 → (1 − 0.8^5) / (0.2 · 1.3) = 2.59.
On a memory-bound GPU v ≈ 1; on a CPU or a busy GPU v grows with γ and the optimum moves down.
"""

from __future__ import annotations


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """E[tokens emitted per speculative step] = (1 − α^(γ+1)) / (1 − α); γ + 1 when α = 1."""
    assert 0.0 <= alpha <= 1.0 and gamma >= 0
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, gamma: int, c: float, v: float) -> float:
    """Predicted speedup over target-only decoding (1.0 at γ = 0 with v = 1).

    >>> round(expected_speedup(0.8, 4, 0.05, 1.1), 2)
    2.59
    """
    assert c >= 0 and v > 0
    return expected_tokens_per_step(alpha, gamma) / (gamma * c + v)
