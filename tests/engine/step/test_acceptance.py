"""The acceptance rules as pure functions (engine/step/acceptance.py), in its order: the tree's
shape (engine/runtime/token_tree.py), then each rule for chains and for trees. Greedy: a worked
example, a reference loop over (K, batch), hand-made and random trees, the tree on a chain
equal to the chain verifier. Seeded: the tree token for token against the chain and
target-only decoding. Sampled: determinism for given draws; the chain's per-position
goodness of fit (400k rows), the tree's chi-square against the exact joint of the first two
tokens; power checks that the same tests catch planted wrong updates."""

from __future__ import annotations

import doctest
import random
from functools import cache

import pytest
import torch
from scipy import stats
from specserve.config import SamplingParams
from specserve.engine.runtime import token_tree
from specserve.engine.runtime.token_tree import (
    chain_parents,
    tree_ancestors,
    tree_children,
    tree_depths,
    validate_tree,
)
from specserve.engine.step import acceptance
from specserve.engine.step.acceptance import (
    PLACEHOLDER,
    greedy_rejection_sample,
    rejection_sample,
    target_probs,
    tree_accept_greedy,
    tree_accept_sampled,
    tree_accept_seeded,
    without_replacement,
)
from specserve.engine.step.proposal import Proposal
from specserve.engine.step.sampling import compute_probs, position_noise, sample_from
from specserve.engine.step.verification import verify_greedy, verify_seeded

from tests.engine.step.test_verification import verify_row

# A depth-3 tree with several siblings per node (used by the hand-made cases):
#   root ─ 0:2 ─ 3:1 ─ 6:0
#        │     │     └ 7:2
#        │     └ 4:3 ─ 8:4
#        ├ 1:0 ─ 5:1 ─ 9:3
#        └ 2:4
PARENTS = [-1, -1, -1, 0, 0, 1, 3, 3, 4, 5]
TOKENS = [2, 0, 4, 1, 3, 1, 0, 2, 4, 3]


# ---------------------------------------------------------------------------------------------
# The tree's shape (token_tree) and validation


def test_depths_ancestors_children():
    assert tree_depths(PARENTS) == [1, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert tree_ancestors(PARENTS)[6] == [0, 3] and tree_ancestors(PARENTS)[9] == [1, 5]
    assert tree_ancestors(PARENTS)[:3] == [[], [], []]
    assert tree_children(PARENTS) == [[0, 1, 2], [3, 4], [5], [], [6, 7], [8], [9], [], [], [], []]
    assert tree_depths(chain_parents(4)) == [1, 2, 3, 4] and chain_parents(0) == []
    assert tree_depths([]) == [] and tree_ancestors([]) == []


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 2, 0], [-2], [-1, 0, 5]])
def test_malformed_parents_raise(parents):
    for check in (validate_tree, tree_depths, tree_ancestors, tree_children):
        with pytest.raises(ValueError, match="parent"):
            check(parents)
    with pytest.raises(ValueError, match="parent"):
        tree_accept_greedy(parents, [0] * len(parents), torch.zeros(len(parents) + 1, dtype=torch.long))


def test_malformed_tokens_raise():
    with pytest.raises(ValueError, match="2 tokens for 3 nodes"):
        validate_tree([-1, 0, 0], [1, 2])
    p = torch.full((3, 5), 0.2)
    for bad in (5, -1):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tree_accept_sampled([-1, 0], [1, bad], p, None, torch.Generator().manual_seed(0))


def test_the_doctests_hold():
    assert doctest.testmod(token_tree).failed == 0
    assert doctest.testmod(acceptance).failed == 0


# ---------------------------------------------------------------------------------------------
# 1. Greedy: chains


def test_greedy_chain_docstring_example():
    out = greedy_rejection_sample(torch.tensor([[5, 9, 2]]), torch.tensor([3]),
                                  torch.tensor([[5, 9, 7, 4]]))
    assert out.output_token_ids.tolist() == [[5, 9, 7, PLACEHOLDER]]
    assert out.num_accepted_tokens.tolist() == [2]


@pytest.mark.parametrize("k", [1, 3, 5, 8])
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_greedy_matches_a_reference_loop(k, batch):
    gen = torch.Generator().manual_seed(k * 100 + batch)
    argmax = torch.randint(0, 4, (batch, k + 1), generator=gen)  # small vocab: frequent matches
    drafts = torch.where(torch.rand(batch, k, generator=gen) < 0.7, argmax[:, :k],
                         torch.randint(0, 4, (batch, k), generator=gen))
    num_draft_tokens = torch.randint(0, k + 1, (batch,), generator=gen)
    out = greedy_rejection_sample(drafts, num_draft_tokens, argmax)
    for b in range(batch):
        expected = []
        for i in range(int(num_draft_tokens[b])):
            if drafts[b, i] != argmax[b, i]:
                break
            expected.append(int(drafts[b, i]))
        expected.append(int(argmax[b, len(expected)]))
        assert out.emitted(b) == expected
        assert out.num_accepted_tokens[b] == len(expected) - 1
        assert (out.output_token_ids[b, len(expected):] == PLACEHOLDER).all()


# ---------------------------------------------------------------------------------------------
# 1. Greedy: trees


def test_greedy_tree_docstring_example():
    out = tree_accept_greedy([-1, -1, 0, 0, 1], [7, 5, 2, 9, 4], torch.tensor([5, 3, 8, 0, 0, 6]))
    assert out.path == [1] and out.emitted == [5, 8] and out.num_accepted == 1


@pytest.mark.parametrize(("argmax", "path", "emitted"), [
    # one argmax per row (row 0: the root, row i + 1: node i)
    ([2, 1, 0, 0, 0, 0, 0, 2, 0, 0, 0], [0, 3, 6], [2, 1, 0, 2]),   # depth 3, bonus after leaf 6
    ([2, 1, 0, 0, 2, 0, 0, 0, 0, 0, 0], [0, 3, 7], [2, 1, 2, 0]),   # second grandchild of 3
    ([2, 3, 0, 0, 0, 4, 0, 0, 0, 1, 0], [0, 4, 8], [2, 3, 4, 1]),
    ([0, 0, 1, 0, 0, 0, 3, 0, 0, 0, 0], [1, 5, 9], [0, 1, 3, 0]),
    ([0, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0], [1], [0, 4]),               # 4 is no child of node 1
    ([4, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0], [2], [4, 1]),               # leaf 2: bonus token 1
    ([3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], [], [3]),                   # no child carries 3
])
def test_greedy_hand_made_tree(argmax, path, emitted):
    out = tree_accept_greedy(PARENTS, TOKENS, torch.tensor(argmax))
    assert (out.path, out.emitted) == (path, emitted)
    logits = torch.nn.functional.one_hot(torch.tensor(argmax), 5).float() * 3 - 1  # [N + 1, 5]
    assert tree_accept_greedy(PARENTS, TOKENS, logits) == out


def test_greedy_first_of_duplicate_siblings_wins():
    out = tree_accept_greedy([-1, -1, 1], [3, 3, 2], torch.tensor([3, 0, 2, 0]))
    assert out.path == [0] and out.emitted == [3, 0]


def _random_tree(rng: random.Random, num_nodes: int, vocab: int) -> tuple[list[int], list[int]]:
    """A random tree, siblings carrying distinct tokens (at most ``vocab`` children a node)."""
    parents: list[int] = []
    tokens: list[int] = []
    for i in range(num_nodes):
        parent = rng.randrange(-1, i)
        used = {tokens[j] for j in range(i) if parents[j] == parent}
        free = [t for t in range(vocab) if t not in used]
        if not free:
            parent, free = i - 1, list(range(vocab))  # node i - 1 has no children yet
        parents.append(parent)
        tokens.append(rng.choice(free))
    return parents, tokens


def _root_to_leaf_paths(parents: list[int]) -> list[list[int]]:
    ancestors = tree_ancestors(parents)
    leaves = set(range(len(parents))) - set(parents)
    return [[*ancestors[leaf], leaf] for leaf in sorted(leaves)] or [[]]


def test_greedy_tree_is_target_only_greedy_and_the_best_chain():
    for seed in range(60):  # many random cases, one test
        _greedy_tree_is_target_only_greedy_and_the_best_chain(seed)


def _greedy_tree_is_target_only_greedy_and_the_best_chain(seed):
    """Random trees and logits with many ties (integer logits, V = 4): the tree keeps the nodes
    whose whole path matches the argmax (a reference computed node by node), and emits what the
    chain verifier emits on the best of the tree's root-to-leaf paths."""
    rng = random.Random(seed)
    vocab = 4
    parents, tokens = _random_tree(rng, rng.randrange(0, 12), vocab)
    logits = torch.randint(0, 3, (len(parents) + 1, vocab),
                           generator=torch.Generator().manual_seed(seed)).float()  # [N + 1, V]
    out = tree_accept_greedy(parents, tokens, logits)

    argmax = logits.argmax(dim=-1).tolist()
    matched = []  # the nodes whose path from the root carries the argmax at every step
    for i, parent in enumerate(parents):
        if (parent == -1 or parent in matched) and tokens[i] == argmax[parent + 1]:
            matched.append(i)
    assert out.path == matched
    assert out.emitted == [tokens[i] for i in matched] + [argmax[matched[-1] + 1 if matched else 0]]

    best = max((verify_greedy([verify_row(Proposal([tokens[i] for i in path]))],
                              [logits[[0] + [i + 1 for i in path]]]).emitted(0)
                for path in _root_to_leaf_paths(parents)), key=len)
    assert out.emitted == best


def test_greedy_chain_equals_the_chain_verifier():
    for seed in range(100):  # many random cases, one test
        _greedy_chain_equals_the_chain_verifier(seed)


def _greedy_chain_equals_the_chain_verifier(seed):
    gen = torch.Generator().manual_seed(seed)
    k = seed % 7
    logits = torch.randint(0, 3, (k + 1, 5), generator=gen).float()  # ties on purpose
    argmax = logits.argmax(dim=-1)
    drafts = torch.where(torch.rand(k, generator=gen) < 0.75, argmax[:k],
                         torch.randint(0, 5, (k,), generator=gen))
    chain = verify_greedy([verify_row(Proposal(drafts.tolist()))], [logits])
    tree = tree_accept_greedy(chain_parents(k), drafts.tolist(), logits)
    assert tree.emitted == chain.emitted(0) and tree.num_accepted == int(chain.num_accepted_tokens[0])
    assert tree.path == list(range(tree.num_accepted))


# ---------------------------------------------------------------------------------------------
# 2. Seeded (drafter-invariant): trees, token for token against chains and target-only text

SEEDED = SamplingParams(temperature=0.8, top_k=4, seed=0)


def test_seeded_chain_equals_the_chain_verifier():
    for seed in range(60):  # many random cases, one test
        _seeded_chain_equals_the_chain_verifier(seed)


def _seeded_chain_equals_the_chain_verifier(seed):
    gen = torch.Generator().manual_seed(seed)
    k, vocab, position = seed % 6, 6, 3 + seed
    logits = torch.randn(k + 1, vocab, generator=gen) * 2  # [K + 1, V]
    p = target_probs([SEEDED], [logits], k)[0]  # [K + 1, V], as the chain computes it
    truth = [int(sample_from(p[j], position_noise(seed, position + j, vocab))) for j in range(k + 1)]
    drafts = [t if random.Random(seed * 31 + j).random() < 0.75 else (t + 1) % vocab
              for j, t in enumerate(truth[:k])]
    chain = verify_seeded([verify_row(Proposal(drafts), SEEDED, seed, position)], [logits])
    tree = tree_accept_seeded(chain_parents(k), drafts, p, seed, position)
    assert tree.emitted == chain.emitted(0) and tree.num_accepted == int(chain.num_accepted_tokens[0])


def test_seeded_tree_emits_the_target_only_text_as_a_chain_would():
    for seed in range(40):  # many random cases, one test
        _seeded_tree_emits_the_target_only_text_as_a_chain_would(seed)


def _seeded_tree_emits_the_target_only_text_as_a_chain_would(seed):
    """A Markov target (p after a node depends on its token); a random tree with the seed's
    target-only text planted to a random depth. The tree emits a prefix of that text at least
    that deep, and the chain verifier on the accepted path emits the same tokens."""
    rng, vocab, position = random.Random(seed), 6, 100 + 7 * seed
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab + 1, vocab, generator=gen) * 2  # row 0: the root; row t + 1: after t
    table = target_probs([SEEDED], [logits], vocab)[0]  # [V + 1, V]

    text, row = [], 0  # the target-only text of the seed
    for j in range(6):
        text.append(int(sample_from(table[row], position_noise(seed, position + j, vocab))))
        row = text[-1] + 1

    parents, tokens = _random_tree(rng, rng.randrange(0, 10), vocab)
    node, planted = -1, rng.randrange(0, 5)
    for token in text[:planted]:  # follow the text down the tree, adding the nodes it lacks
        found = [i for i, (pa, t) in enumerate(zip(parents, tokens)) if pa == node and t == token]
        node = found[0] if found else _append(parents, tokens, node, token)
    rows = [0] + [t + 1 for t in tokens]
    tree = tree_accept_seeded(parents, tokens, table[rows], seed, position)
    assert tree.num_accepted >= planted and tree.emitted == text[: tree.num_accepted + 1]

    path_rows = [0] + [tokens[i] + 1 for i in tree.path]
    chain = verify_seeded([verify_row(Proposal(tree.emitted[:-1]), SEEDED, seed, position)],
                          [logits[path_rows]])
    assert chain.emitted(0) == tree.emitted


def _append(parents: list[int], tokens: list[int], parent: int, token: int) -> int:
    parents.append(parent)
    tokens.append(token)
    return len(parents) - 1


# ---------------------------------------------------------------------------------------------
# 3. Sampled: chains (per-position goodness of fit)


def test_zero_drafts_is_plain_sampling():
    p = torch.tensor([[[0.0, 1.0, 0.0]]])  # [1, 1, 3]
    out = rejection_sample(torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]), p, None,
                           torch.zeros(1, 0), torch.ones(1, 3))
    assert out.emitted(0) == [1] and out.num_accepted_tokens.tolist() == [0]


def test_deterministic_for_given_draws():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 4, 10, generator=gen), -1)
    q = torch.softmax(torch.randn(4, 3, 10, generator=gen), -1)
    drafts = sample_from(q.reshape(-1, 10), torch.empty(12, 10).exponential_(generator=gen)).view(4, 3)
    u, noise = torch.rand(4, 3, generator=gen), torch.empty(4, 10).exponential_(generator=gen)
    args = (drafts, torch.tensor([3, 2, 1, 0]), p, q, u, noise)
    a, b = rejection_sample(*args), rejection_sample(*args)
    assert torch.equal(a.output_token_ids, b.output_token_ids)


def test_identical_draft_and_target_accept_everything():
    p = torch.softmax(torch.randn(64, 4, 6), -1)
    drafts = torch.multinomial(p[:, :3].reshape(-1, 6), 1).view(64, 3)
    out = rejection_sample(drafts, torch.full((64,), 3), p, p[:, :3].clone(),
                           torch.rand(64, 3) * 0.999, torch.empty(64, 6).exponential_())
    assert (out.num_accepted_tokens == 3).all()


def _marginals_match(p, q, *, deterministic: bool, n: int = 400_000, seed: int = 0):
    """Run the sampler on ``n`` i.i.d. rows with context-free p (``[K+1, V]``) and q
    (``[K, V]``). For every position j, the token emitted at j, among rows that reached j,
    must be distributed as p_j. Returns the smallest chi-square p-value over positions."""
    gen = torch.Generator().manual_seed(seed)
    k, v = q.shape
    if deterministic:  # n-gram style: one fixed draft per position, one-hot q
        drafts = q.argmax(-1).expand(n, k)
        draft_probs = None
    else:
        drafts = torch.multinomial(q, n, replacement=True, generator=gen).T  # [n, K]
        draft_probs = q.expand(n, k, v)
    out = rejection_sample(drafts, torch.full((n,), k), p.expand(n, k + 1, v), draft_probs,
                           torch.rand(n, k, generator=gen),
                           torch.empty(n, v).exponential_(generator=gen))
    pvalues = []
    for j in range(k + 1):
        reached = out.num_accepted_tokens >= j
        counts = torch.bincount(out.output_token_ids[reached, j], minlength=v).double()
        expected = p[j].double() / p[j].double().sum() * counts.sum()
        keep = expected > 0
        assert counts[~keep].sum() == 0, f"position {j} emitted a token p gives zero mass"
        pvalues.append(stats.chisquare(counts[keep], expected[keep]).pvalue)
    return min(pvalues)


@pytest.mark.parametrize("deterministic", [False, True])
def test_emitted_tokens_have_the_target_distribution(deterministic):
    """Chi-square goodness of fit per position, 400k rows, V = 6, K = 3; threshold 1e-3
    (seeded, so the outcome is fixed). ``test_power_of_the_distribution_test`` shows the
    same test rejects q at this kind of mismatch."""
    gen = torch.Generator().manual_seed(42)
    p = compute_probs(torch.randn(4, 6, generator=gen) * 1.5, torch.full((4,), 0.7),
                      torch.full((4,), 0), torch.full((4,), 1.0))
    q = torch.softmax(torch.randn(3, 6, generator=gen) * 1.5, -1)  # deliberately mismatched
    assert _marginals_match(p, q, deterministic=deterministic) > 1e-3


def test_power_of_the_distribution_test():
    """A sampler that always accepts the draft produces q, and the chi-square test on the
    emitted first token rejects that at p < 1e-6 with 20k rows."""
    gen = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(6, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(6, generator=gen) * 1.5, -1)
    draws = torch.multinomial(q, 20_000, replacement=True, generator=gen)
    counts = torch.bincount(draws, minlength=6).double()
    assert stats.chisquare(counts, p.double() * 20_000).pvalue < 1e-6


# ---------------------------------------------------------------------------------------------
# 3. Sampled: trees (exact distribution of the first two emitted tokens)

V = 5
# The target: P1 at the root, P[a] after a token a (every node's row is P[its token]).
# Token 4 is impossible first (a top-k cut), and the draft proposes it often: r(x) = 0.
P1 = torch.tensor([0.35, 0.25, 0.2, 0.2, 0.0])
P = torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(1)), -1)
# The draft, deliberately mismatched; it never proposes 0 after a token (q(x) = 0 where p > 0).
Q1 = torch.tensor([0.1, 0.4, 0.1, 0.1, 0.3])
Q = torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(2)) * 1.5, -1)
Q[:, 0] = 0
Q = Q / Q.sum(-1, keepdim=True)
ROWS = torch.cat([P1[None], P])  # [V + 1, V]: row 0 the root's p, row t + 1 the p after token t
JOINT = P1[:, None].double() * P.double()  # [V, V]: P(first = a, second = b)
N_DRAWS = 20_000
N_POWER = 5_000  # the wrong variants below fail at a quarter of the draws, by far (p < 1e-80)

_Q1L, _QL, _PL = Q1.tolist(), Q.tolist(), P.tolist()


@cache
def _q(parent_token: int | None, earlier: tuple[int, ...] = ()) -> torch.Tensor:
    """The draft's q after ``parent_token`` (None: the root), without ``earlier`` tokens."""
    q = Q1 if parent_token is None else Q[parent_token]
    return without_replacement(q, earlier) if earlier else q


@cache
def _top(parent_token: int | None, n: int) -> list[int]:
    return _q(parent_token).topk(n).indices.tolist()


def _draw(rng: random.Random, parent_token: int | None, earlier: tuple[int, ...] = ()) -> int:
    weights = list(_Q1L if parent_token is None else _QL[parent_token])
    for t in earlier:
        weights[t] = 0.0
    return rng.choices(range(V), weights)[0]


class _Tree:
    """A tree under construction: parents, tokens and each node's q (None: a point mass)."""

    def __init__(self):
        self.parents: list[int] = []
        self.tokens: list[int] = []
        self.q: list[torch.Tensor | None] = []

    def add(self, parent: int, token: int, q: torch.Tensor | None) -> int:
        self.parents.append(parent)
        self.tokens.append(token)
        self.q.append(q)
        return len(self.tokens) - 1

    def token(self, node: int) -> int | None:
        return None if node == -1 else self.tokens[node]

    def iid(self, rng: random.Random, parent: int, n: int) -> list[int]:
        """``n`` i.i.d. children of ``parent``, each drawn from the draft's q: q_i = q."""
        ctx = self.token(parent)
        return [self.add(parent, _draw(rng, ctx), _q(ctx)) for _ in range(n)]

    def distinct(self, rng: random.Random, parent: int, n: int) -> list[int]:
        """``n`` children without replacement: q_i = q without the earlier siblings."""
        ctx, drawn = self.token(parent), ()
        for _ in range(n):
            token = _draw(rng, ctx, drawn)
            self.add(parent, token, _q(ctx, drawn))
            drawn += (token,)
        return [i for i, pa in enumerate(self.parents) if pa == parent]

    def top(self, parent: int, n: int) -> list[int]:
        """The draft's ``n`` likeliest tokens, deterministic given the context: point masses."""
        return [self.add(parent, t, None) for t in _top(self.token(parent), n)]


def _iid(rng):  # SpecInfer: 3 i.i.d. children of the root, 2 of each, one grandchild deeper
    tree = _Tree()
    for child in tree.iid(rng, -1, 3):
        grandchildren = tree.iid(rng, child, 2)
    tree.iid(rng, grandchildren[0], 1)
    return tree


def _without_replacement(rng):  # Recursive Speculative Decoding
    tree = _Tree()
    for child in tree.distinct(rng, -1, 3):
        grandchildren = tree.distinct(rng, child, 2)
    tree.distinct(rng, grandchildren[1], 2)
    return tree


def _point_mass(rng):  # a model-free proposer: the same tree every step, 4 first (never kept)
    tree = _Tree()
    for token in (1, 4, 0):
        tree.top(tree.add(-1, token, None), 2)
    return tree


def _mixed(rng):
    """Mixed kinds and depths: an n-gram token with a depth-3 chain of point masses, a sampled
    sibling with two i.i.d. children, a sibling drawn without the previous one's token (a leaf)."""
    tree = _Tree()
    node = tree.add(-1, 2, None)
    for _ in range(2):
        node = tree.top(node, 1)[0]
    sampled = tree.iid(rng, -1, 1)[0]
    tree.iid(rng, sampled, 2)
    tree.add(-1, _draw(rng, None, (tree.tokens[sampled],)), _q(None, (tree.tokens[sampled],)))
    return tree


def _chain(rng):
    tree = _Tree()
    node = -1
    for _ in range(3):
        node = tree.iid(rng, node, 1)[0]
    return tree


DRAFTERS = {"iid": _iid, "without_replacement": _without_replacement, "point_mass": _point_mass,
            "mixed": _mixed, "chain": _chain}


def _first_two(emitted: list[int], rng: random.Random) -> tuple[int, int]:
    """The first two tokens: a one-token step is followed by plain sampling from the target."""
    if len(emitted) > 1:
        return emitted[0], emitted[1]
    return emitted[0], rng.choices(range(V), _PL[emitted[0]])[0]


def _counts(drafter, n: int = N_DRAWS, seed: int = 0, q_of=lambda tree: tree.q) -> torch.Tensor:
    """``[V, V]`` counts of (first, second) emitted token over ``n`` steps, each drafting a
    fresh tree with ``drafter`` and verifying it with q_i = ``q_of(tree)``."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    counts = [[0] * V for _ in range(V)]
    for _ in range(n):
        tree = drafter(rng)
        p = ROWS[[0] + [t + 1 for t in tree.tokens]]  # [N + 1, V]
        out = tree_accept_sampled(tree.parents, tree.tokens, p, q_of(tree), gen)
        first, second = _first_two(out.emitted, rng)
        counts[first][second] += 1
    return torch.tensor(counts, dtype=torch.float64)


def _pvalue(counts: torch.Tensor) -> float:
    """Chi-square goodness of fit of ``[V, V]`` counts to JOINT; a zero-mass cell never hit."""
    expected = JOINT / JOINT.sum() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "emitted a token pair the target gives zero mass"
    return stats.chisquare(counts[keep], expected[keep]).pvalue


@pytest.mark.parametrize("case", list(DRAFTERS))
def test_sampled_tree_keeps_the_target_distribution(case):
    """20k steps per case, 20 cells with mass (first token 4 has none); seeded, so the outcome is
    fixed; threshold 1e-3. ``test_power_*`` shows the same test catches wrong updates."""
    assert _pvalue(_counts(DRAFTERS[case])) > 1e-3


def test_sampled_chain_sampler_agrees_on_the_same_drafts():
    """The chain verifier, run on the chain case's drafts (batched), passes the same test: the
    tree on a chain and the chain have one distribution."""
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    trees = [_chain(rng) for _ in range(N_DRAWS)]
    drafts = torch.tensor([t.tokens for t in trees])  # [n, 3]
    p = ROWS[torch.cat([torch.zeros(N_DRAWS, 1, dtype=torch.long), drafts + 1], 1)]  # [n, 4, V]
    q = torch.stack([torch.stack(t.q) for t in trees])  # [n, 3, V]
    out = rejection_sample(drafts, torch.full((N_DRAWS,), 3), p, q, torch.rand(N_DRAWS, 3, generator=gen),
                           torch.empty(N_DRAWS, V).exponential_(generator=gen))
    counts = torch.zeros(V, V, dtype=torch.float64)
    for i in range(N_DRAWS):
        counts[_first_two(out.emitted(i), rng)] += 1
    assert _pvalue(counts) > 1e-3


def test_sampled_chain_equals_the_chain_sampler_given_the_same_draws():
    for seed in range(200):  # many random cases, one test
        _sampled_chain_equals_the_chain_sampler_given_the_same_draws(seed)


def _sampled_chain_equals_the_chain_sampler_given_the_same_draws(seed):
    """With the uniforms of the tried drafts and the final noise the tree drew, the chain
    sampler makes the same decisions (up to rounding at exact ties; none in these draws)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    k = seed % 5
    tree = _Tree()
    node = -1
    for _ in range(k):
        node = tree.iid(rng, node, 1)[0] if seed % 2 else tree.top(node, 1)[0]
    p = ROWS[[0] + [t + 1 for t in tree.tokens]]  # [K + 1, V]
    state = gen.get_state()
    q = torch.stack(tree.q) if seed % 4 == 1 and k else tree.q  # [K, V] tensor or a list per node
    out = tree_accept_sampled(tree.parents, tree.tokens, p, q, gen)

    gen.set_state(state)  # replay the tree's draws: one uniform per tried draft, then the noise
    tried = min(out.num_accepted + 1, k)
    uniform = torch.ones(1, k)
    for j in range(tried):
        uniform[0, j] = torch.rand((), generator=gen)
    noise = torch.empty(V).exponential_(generator=gen)[None]  # [1, V]
    q = torch.stack(tree.q)[None] if seed % 2 and k else None
    chain = rejection_sample(torch.tensor([tree.tokens], dtype=torch.long).view(1, k), torch.tensor([k]),
                             p[None], q, uniform, noise)
    assert out.emitted == chain.emitted(0)


def test_power_no_residual_update(monkeypatch):
    """Not updating r after a rejected sibling (trying the next sibling against p again)
    over-emits the drafted tokens: the test rejects it at p < 1e-6."""
    monkeypatch.setattr(acceptance, "_residual_after_rejection", lambda r, q, token: r)
    assert _pvalue(_counts(_iid, n=N_POWER)) < 1e-6


def test_power_residual_not_renormalised(monkeypatch):
    """``max(0, r - q)`` left unnormalised: the final race does not mind, but later siblings
    are tested against a residual of mass below 1 and kept too rarely. Subtler; caught too."""
    def unnormalised(r, q, token):
        return (r - (torch.nn.functional.one_hot(torch.tensor(token), V) if q is None else q)).clamp(min=0)

    monkeypatch.setattr(acceptance, "_residual_after_rejection", unnormalised)
    assert _pvalue(_counts(_iid, n=N_POWER)) < 1e-6


def test_power_q_instead_of_q_i():
    """Siblings drawn without replacement but verified as if i.i.d. (q_i = q): the condition on
    q_i is not a formality."""
    assert _pvalue(_counts(_without_replacement, n=N_POWER, q_of=lambda tree: [
        None if q is None else _q(None if pa == -1 else tree.tokens[pa])
        for pa, q in zip(tree.parents, tree.q)])) < 1e-6


def test_without_replacement_helper():
    q = torch.tensor([0.5, 0.25, 0.25, 0.0])
    assert without_replacement(q, [0]).tolist() == [0.0, 0.5, 0.5, 0.0]
    assert without_replacement(q, [1, 2]).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert without_replacement(q, [0, 1, 2]).tolist() == [0.0] * 4
    assert without_replacement(q, []).tolist() == q.tolist()


def test_sampled_edge_cases():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])  # [3, 3]
    # r(x) = 0: node 0 (token 0) is always rejected; its sibling 1 always kept, then the bonus.
    for _ in range(20):
        out = tree_accept_sampled([-1, -1], [0, 1], p, [torch.tensor([1.0, 0.0, 0.0]), None], gen)
        assert out.path == [1] and out.emitted == [1, 0]
    # q(x) = 0 where r(x) > 0: accepted (the ratio is infinite), as the chain does.
    out = tree_accept_sampled([-1], [1], p[[0, 2]], [torch.tensor([1.0, 0.0, 0.0])], gen)
    assert out.emitted == [1, 0]
    # q_i == r exactly but the token rejected by rounding: the residual would be all zeros.
    r = torch.tensor([0.5, 0.5, 0.0])
    assert torch.equal(acceptance._residual_after_rejection(r, r.clone(), 0), r)
    # No drafts at all: plain sampling from row 0.
    assert tree_accept_sampled([], [], p[:1], None, gen).emitted == [1]


# ---------------------------------------------------------------------------------------------
# The sampling transform that p and q come from (sampling.compute_probs)


def test_top_k_top_p_transform():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    one = torch.ones(1)
    probs = compute_probs(logits, one, torch.tensor([2]), one)
    assert (probs[0, 2:] == 0).all() and probs[0, :2].sum().item() == pytest.approx(1.0)
    full = torch.softmax(logits, -1)[0]
    # top_p just above the top token's mass keeps exactly two tokens.
    probs = compute_probs(logits, one, torch.tensor([0]), torch.tensor([full[0].item() + 1e-3]))
    assert (probs[0] > 0).tolist() == [True, True, False, False, False]
    probs = compute_probs(logits, one, torch.tensor([0]), torch.tensor([full[0].item() - 1e-3]))
    assert (probs[0] > 0).tolist() == [True, False, False, False, False]
