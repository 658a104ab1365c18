"""Which unit a request goes to (``serve/request_router.py``): a conversation's later turns go
to the unit that holds its prefix, and load still spreads.

The rule itself is tested on the router object with stand-ins for Serve's replica wrappers
(a name and the load a unit reports: all the router reads of them), where loads are exact;
then over real HTTP with two units behind Serve's real router, where a later turn that
lands on the unit holding its prefix shows in ``usage.prompt_tokens_details.cached_tokens``
(units share no cache) and the units' own admission counters show where requests went.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
from specserve.serve.request_router import PrefixAffinity, UnitRouter

from tests.serve.conftest import deployed_one, unit_args

DEPLOYMENT = DeploymentID(name="SpeculationUnit", app_name="routing")


@dataclass
class Unit:
    """What the router reads of a Serve replica wrapper: its id and its routing stats."""

    name: str
    reported: int = 0
    replica_id: ReplicaID = field(init=False)

    def __post_init__(self) -> None:
        self.replica_id = ReplicaID(unique_id=self.name, deployment_id=DEPLOYMENT)

    @property
    def routing_stats(self) -> dict:
        return {"load": self.reported}


def make_router(affinity: bool = True, max_imbalance: int = 2) -> UnitRouter:
    router = UnitRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(prefix_affinity=affinity, block_size=4, max_imbalance=max_imbalance)
    return router


def send(router: UnitRouter, units: list[Unit], tokens: list[int] | None,
         salt: str | None = None) -> str:
    """Route one request and send it (it stays in flight until :func:`finish`)."""
    unit = router.rank(units, None if tokens is None else (tokens, salt))[0][0]
    router.on_send_request(unit.replica_id)
    return unit.name


def finish(router: UnitRouter, name: str) -> None:
    router.on_request_completed(ReplicaID(unique_id=name, deployment_id=DEPLOYMENT), "-")


def conversations(router: UnitRouter, units: list[Unit]) -> dict[int, list[str]]:
    """Three conversations of three turns, interleaved, each turn done before the next: the
    unit of every turn, by conversation."""
    prompts = {c: [100 * c + i for i in range(10)] for c in range(3)}
    where: dict[int, list[str]] = {c: [] for c in prompts}
    for turn in range(3):
        for c, prompt in prompts.items():
            where[c].append(send(router, units, prompt))
            finish(router, where[c][-1])
            prompt += [100 * c + 50 + turn] * 6  # the answer and the next question
    return where


def test_a_conversation_stays_on_the_unit_of_its_first_turn_and_fresh_ones_spread():
    where = conversations(make_router(), [Unit("a"), Unit("b")])
    assert [turns[0] for turns in where.values()] == ["a", "b", "a"]  # fresh: fewest sent
    assert all(len(set(turns)) == 1 for turns in where.values()), where
    # The same traffic without affinity moves conversations between units: the test above
    # fails if the router forgets prefixes.
    where = conversations(make_router(affinity=False), [Unit("a"), Unit("b")])
    assert not all(len(set(turns)) == 1 for turns in where.values()), where


def test_a_hot_prefix_spreads_beyond_the_imbalance_and_load_reported_counts():
    router, units = make_router(max_imbalance=2), [Unit("a"), Unit("b")]
    prompt = list(range(12))
    sent = [send(router, units, prompt) for _ in range(8)]  # none finishes
    assert sent[:3] == ["a"] * 3 and "b" in sent[3:]
    counts = [sent.count("a"), sent.count("b")]
    assert abs(counts[0] - counts[1]) <= 2 + 1, sent
    for name in sent:
        finish(router, name)
    assert not +router.in_flight
    owner = send(router, units, prompt)  # the unit that got it last
    finish(router, owner)
    assert owner == sent[-1]
    # A unit that reports more load than the bound allows loses its prefixes' requests.
    next(u for u in units if u.name == owner).reported = 3
    assert send(router, units, prompt + [99] * 4) != owner


def test_a_salt_or_another_prefix_finds_no_owner_and_calls_without_a_prompt_go_by_load():
    router, units = make_router(), [Unit("a"), Unit("b", reported=1)]
    prompt = list(range(12))
    assert send(router, units, prompt) == "a"
    units[0].reported = 3  # b's 1 plus 2: still within the bound, a keeps its prefix
    assert send(router, units, prompt) == "a"
    assert send(router, units, prompt, salt="tenant") == "b"  # another tenant's blocks
    assert send(router, units, [7] + prompt[1:]) == "b"       # the first block differs
    assert send(router, units, None) == "b"                   # stats and other calls


def test_what_the_router_remembers_is_bounded():
    affinity = PrefixAffinity(block_size=1, max_blocks=8)
    old, new = affinity.hashes(list(range(20)), None), affinity.hashes(list(range(50, 60)), None)
    affinity.remember(old, "a")
    affinity.remember(new, "b")
    assert len(affinity._owners) == 8
    assert affinity.owner(old, {"a", "b"}) is None and affinity.owner(new, {"a", "b"}) == "b"
    assert affinity.owner(new, {"a"}) is None  # a unit that is gone owns nothing


def test_a_unit_that_goes_is_forgotten_and_its_prompts_are_learnt_where_they_land():
    """Autoscaling's scale-down (issue 55): Serve hands the router the units that remain
    (``update_replicas``, which wants the event loop Serve runs routers on)."""
    asyncio.run(_scale_down_and_up())


async def _scale_down_and_up() -> None:
    router, (a, b, c) = make_router(), [Unit("a"), Unit("b"), Unit("c")]
    prompt = list(range(12))
    assert send(router, [a, b], prompt) == "a"  # a holds the prefix, its request in flight
    router.update_replicas([b])                 # a drains and goes
    assert "a" not in router.in_flight and "a" not in router.sent
    assert "a" not in router.affinity._owners.values()
    router.update_replicas([b, c])              # a new unit comes
    assert send(router, [b, c], prompt) == "b"  # no owner left: the least loaded, first listed
    finish(router, "b")
    assert send(router, [b, c], prompt + [5] * 4) == "b"  # learnt there
    finish(router, "b")
    assert send(router, [b, c], [77] * 12) == "c"         # fresh prompts: the new unit first


# -- two units behind Serve's router, over HTTP ------------------------------------------------

@pytest.fixture(scope="module")
def two_units(ray_cluster, tiny_models):
    args = unit_args(tiny_models[0], kv_cache={"layout": "paged", "block_size": 16})
    args["num_units"] = 2
    yield from deployed_one("two", args)


def admitted_by_unit(url: str) -> dict[str, float]:
    families = {f.name: f for f in text_string_to_metric_families(
        httpx.get(url + "/metrics", timeout=60).text)}
    family = families.get("specserve:requests_admitted")
    return {s.labels["unit"]: s.value for s in family.samples
            if s.name.endswith("_total")} if family else {}


def test_two_units_turns_land_on_their_prefix_and_fresh_prompts_spread(two_units, tiny_models):
    url, model = two_units, Path(tiny_models[0]).name

    def complete(prompt: str) -> dict:
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    prompt, cached = "The quick brown fox jumps over the lazy dog, " * 4, []
    for turn in range(4):
        body = complete(prompt)
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
        prompt += body["choices"][0]["text"] + f" and then, turn {turn}?"
    # Least load alone would send turn 2 to the other unit (it has been sent fewer), whose
    # cache holds nothing of this conversation.
    assert cached[0] == 0 and all(c >= 32 for c in cached[1:]), cached
    for i in range(4):
        complete(f"{i} a fresh prompt of its own, long enough for two blocks of its own {i}")
    deadline = time.monotonic() + 120  # units report to the metrics hub every second
    while sum((counts := admitted_by_unit(url)).values()) < 8 or len(counts) < 2:
        assert time.monotonic() < deadline, counts
        time.sleep(0.2)
    assert len(counts) == 2 and min(counts.values()) >= 1, counts
