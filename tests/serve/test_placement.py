"""A unit configured as the Helm chart configures it: coordinator and target ranks pinned to
nodes advertising ``specserve_target``, the draft outside the unit's placement group on a node
advertising ``specserve_draft``. Here one local node advertises both (a Kubernetes cluster
cannot be had); the test proves the placement group and the draft actor are requested that
way and that the unit serves correctly with its draft."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import ray
from specserve.config import UnitConfig
from specserve.engine.tokenizer import encode_prompt
from specserve.serve.placement import process_group_backend, target_device

from tests.serve.conftest import deployed_one, unit_args
from tests.serve.test_http import target_only_text
from tests.tiny import make_tiny_tokenizer


@pytest.fixture(scope="module")
def split_app(ray_cluster, tiny_models):
    args = unit_args(tiny_models[0], speculative={
        "method": "draft_model", "num_speculative_tokens": 3, "draft": {"source": tiny_models[1]},
        "adaptive": {"enabled": False}})
    args["unit"].update({"accelerator": "gpu", "target_node_resource": "specserve_target",
                         "draft_placement": "own", "draft_node_resource": "specserve_draft",
                         # A draft step takes milliseconds; the default 10 s limit could still
                         # call a draft that a busy machine delayed dead, and the test needs it.
                         "draft_timeout_s": 120})
    args["unit"]["engine"]["target"]["device"] = "cpu"  # fake GPUs: the placement would say cuda
    args["ingress_node_resource"] = "specserve_head"
    yield from deployed_one("split", args)


def test_split_placement_serves_with_its_draft(split_app, tiny_models):
    model = Path(tiny_models[0]).name
    prompt = "a b c d a b c d"
    r = httpx.post(split_app + "/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": 30, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.headers["x-speculation"].startswith("on; reason=default; method=draft_model")
    assert r.json()["usage"]["speculation"]["num_draft_tokens"] > 0
    ids = encode_prompt(make_tiny_tokenizer(), prompt)
    assert r.json()["choices"][0]["text"] == target_only_text(tiny_models[2], ids, 30)

    # The unit's placement group: [coordinator, target rank], each with a sliver of the
    # target-node resource; no draft bundle.
    tables = [t for t in ray.util.placement_group_table().values()
              if t["state"] == "CREATED"
              and any("specserve_target" in b for b in t["bundles"].values())]
    assert tables, "no placement group asks for the target-node resource"
    bundles = list(tables[-1]["bundles"].values())
    assert len(bundles) == 2 and all(b["specserve_target"] > 0 for b in bundles)
    assert not any("specserve_draft" in b for t in tables for b in t["bundles"].values())


@pytest.mark.parametrize(("accelerator", "device", "placed", "backend"), [
    ("gpu", "auto", "cuda", "nccl"), ("cpu", "auto", "cpu", "gloo"),
    ("gpu", "cpu", "cpu", "gloo"), ("gpu", "cuda:1", "cuda:1", "nccl")])
def test_the_placement_decides_every_ranks_device_and_backend(accelerator, device, placed, backend):
    """One decision for the whole target group, made by the coordinator from the unit's
    placement and sent to every rank: a rank never picks NCCL or gloo from its own view of
    CUDA (ranks that saw different things would form no group and hang)."""
    cfg = UnitConfig.model_validate({"engine": {"target": {"source": "embedded", "device": device}},
                                     "accelerator": accelerator, "tensor_parallel_size": 2})
    assert (target_device(cfg), process_group_backend(cfg)) == (placed, backend)

