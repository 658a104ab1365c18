"""Serve request router for the units: the unit that holds a request's prompt prefix, unless
it is too busy; otherwise the least-loaded unit.

Units share nothing, so a prefix cached in one unit (``engine/kv/kv_manager.py``) helps only
requests sent to that unit. With ``routing.prefix_affinity`` the router remembers, per block
of the prompt (the same chained hashes as the units' caches, salt included), which unit it
last sent that prefix to, and sends a request to the unit of its longest remembered prefix:
a conversation's later turns go where its earlier turns are cached (Ray Serve LLM's
``PrefixCacheAffinityRouter``, SGLang's cache-aware router). That unit gets it only while its
load is at most the least-loaded unit's plus ``routing.max_imbalance``, so one hot prefix
(a shared system prompt) spreads once its unit is busy, and the next request of that prefix
remembers the unit it went to instead.

A unit's load is the larger of what it reports (``record_routing_stats``, running + waiting
sequences, polled every ``request_routing_stats_period_s``) and the requests this router has
sent it that have not completed (a burst between two polls). Among equally loaded units the
one this router has sent the fewest requests goes first, so fresh prefixes spread even on
idle units.

What it remembers is this router's own (each ingress replica learns on its own), bounded
(LRU, ``MAX_REMEMBERED`` blocks), and a guess: a unit may have evicted the prefix since, and
then it prefills the request whole, as any unit would.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from specserve.engine.kv.block_pool import BlockHash, hash_blocks

MAX_REMEMBERED = 1 << 16  # blocks: 2 MiB of hashes and ids, a million tokens at block size 16


class PrefixAffinity:
    """Which unit (an id) was last sent each prefix block: ``owner`` of the longest one
    remembered among the units given, ``remember`` after routing."""

    def __init__(self, block_size: int, max_blocks: int = MAX_REMEMBERED) -> None:
        self.block_size, self.max_blocks = block_size, max_blocks
        self._owners: OrderedDict[BlockHash, str] = OrderedDict()

    def hashes(self, tokens: Sequence[int], salt: str | None) -> list[BlockHash]:
        return hash_blocks(tokens, self.block_size, salt=salt)

    def owner(self, hashes: list[BlockHash], units: set[str]) -> str | None:
        for h in reversed(hashes):  # chained: a block's hash names its whole prefix
            unit = self._owners.get(h)
            if unit in units:
                return unit
        return None

    def forget(self, units: set[str]) -> None:
        """Drop what it remembers of ``units`` (gone: scaled down or replaced)."""
        for h in [h for h, unit in self._owners.items() if unit in units]:
            del self._owners[h]

    def remember(self, hashes: list[BlockHash], unit: str) -> None:
        for h in hashes:
            self._owners[h] = unit
            self._owners.move_to_end(h)
        while len(self._owners) > self.max_blocks:
            self._owners.popitem(last=False)


def _prompt(request: PendingRequest | None) -> tuple[list[int], str | None] | None:
    """A generate call's prompt ids and cache salt; None for every other call (stats...)."""
    payload = request.args[0] if request is not None and request.args else None
    asked = getattr(payload, "request", None)  # a UnitRequest's EngineRequest
    tokens = getattr(asked, "prompt_token_ids", None)
    if tokens is None:
        return None
    return tokens, asked.params.cache_salt


class UnitRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, prefix_affinity: bool = False, block_size: int = 16,
                         max_imbalance: int = 4) -> None:
        self.affinity = PrefixAffinity(block_size) if prefix_affinity else None
        self.max_imbalance = max_imbalance
        self.in_flight: Counter[str] = Counter()  # sent, not completed
        self.sent: Counter[str] = Counter()

    def load(self, replica: RunningReplica) -> float:
        reported = float((replica.routing_stats or {}).get("load", 0))
        return max(reported, self.in_flight[replica.replica_id.unique_id])

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        return self.rank(candidate_replicas, _prompt(pending_request))

    def rank(self, replicas: list[RunningReplica],
             prompt: tuple[list[int], str | None] | None) -> list[list[RunningReplica]]:
        """Ranks of replicas, the one to try first alone in the first rank; then the rest by
        load (Serve tries the next rank when a unit's queue is full)."""
        loads = {r.replica_id.unique_id: self.load(r) for r in replicas}
        by_load = sorted(replicas, key=lambda r: (loads[r.replica_id.unique_id],
                                                  self.sent[r.replica_id.unique_id]))
        first, least = by_load[0], loads[by_load[0].replica_id.unique_id]
        if self.affinity is not None and prompt is not None:
            hashes = self.affinity.hashes(*prompt)
            unit = self.affinity.owner(hashes, set(loads))
            if unit is not None and loads[unit] <= least + self.max_imbalance:
                first = next(r for r in replicas if r.replica_id.unique_id == unit)
            self.affinity.remember(hashes, first.replica_id.unique_id)
        return [[first]] + [[r] for r in by_load if r is not first]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new set of units: a unit that has gone (scaled down, replaced) is forgotten,
        its prefixes and counts with it, so its prompts go to the units that remain and are
        learnt there; a new unit has sent nothing, so it goes first among the least loaded."""
        super().update_replicas(replicas)
        here = {r.replica_id.unique_id for r in replicas}
        gone = (set(self.in_flight) | set(self.sent)) - here
        for counts in (self.in_flight, self.sent):
            for unit in gone:
                counts.pop(unit, None)
        if self.affinity is not None and gone:
            self.affinity.forget(gone)

    def on_send_request(self, replica_id) -> None:
        super().on_send_request(replica_id)
        self.in_flight[replica_id.unique_id] += 1
        self.sent[replica_id.unique_id] += 1

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        if self.in_flight[replica_id.unique_id] > 0:
            self.in_flight[replica_id.unique_id] -= 1
