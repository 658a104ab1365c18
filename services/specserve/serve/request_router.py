"""Serve request router for the units: send each request to the least-loaded unit.

Each unit reports ``{"load": running + waiting sequences}`` through ``record_routing_stats``
(Serve polls it every ``request_routing_stats_period_s``). Replicas are ranked by that load;
within the least-loaded rank Serve's usual queue-length probe breaks ties, which also covers
bursts that arrive between two polls.
"""

from __future__ import annotations

from itertools import groupby

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


def unit_load(replica: RunningReplica) -> float:
    return float((replica.routing_stats or {}).get("load", 0))


class LeastLoadedUnitRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=unit_load)
        return [list(group) for _, group in groupby(ordered, key=unit_load)]
