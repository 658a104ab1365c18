"""One local Ray cluster and Serve instance for the whole test session (on 127.0.0.1); under
`make test`, a second Ray cluster where the tests that use no session app run on the other
worker (``local_ray``; tests/conftest.py's ``worker_group``).

Ray gets 8 *fake* GPUs (the draft and split apps take 2 each, the TP test 3) so the units' placement
groups are the cluster's (``{"GPU": 1}`` bundles, actors pinned to bundles); torch sees no
CUDA, so ranks run on CPU with gloo. A real GPU, NCCL and a Kubernetes cluster cannot be had
on these machines.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest

from tests.models import perturbed, tiny_hf_model
from tests.tiny import make_tiny_tokenizer

# Ports of their own for each xdist worker (`make test`): the Ray group's worker and, where
# the Ray-actor tests run beside it, theirs each start a local Ray cluster (tests/conftest.py).
WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
PORT = int(os.environ.get("SPECSERVE_TEST_PORT", "18321")) + 10 * WORKER
RAY_METRICS_PORT = PORT + 1
BASE = f"http://127.0.0.1:{PORT}"


def save_tiny(path, model) -> str:
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """``(target_dir, draft_dir, target_hf)``: a tiny target and a close draft of it."""
    target = tiny_hf_model("llama-gqa", seed=0, logit_scale=3.0)
    target_dir = save_tiny(tmp_path_factory.mktemp("tiny-target"), target)
    draft_dir = save_tiny(tmp_path_factory.mktemp("tiny-draft"), perturbed(target, scale=0.3))
    return target_dir, draft_dir, target


@pytest.fixture(scope="session")
def local_ray():
    """The local Ray cluster alone: what tests of Ray actors without Serve need."""
    import ray
    from specserve.serve.local import start_local_ray

    # The node also advertises the resources the Helm chart's worker groups do, so a unit
    # configured for a cluster (target and draft on separate groups) can be placed here.
    start_local_ray(num_cpus=8, num_gpus=8, metrics_export_port=RAY_METRICS_PORT,
                    resources={"specserve_head": 1000, "specserve_target": 1000,
                               "specserve_draft": 1000})
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_cluster(local_ray):
    """The local Ray cluster with Serve on ``PORT``."""
    from ray import serve
    from specserve.serve.local import start_serve

    start_serve("127.0.0.1", PORT)
    yield
    serve.shutdown()


def deploy(name: str, route_prefix: str, args: dict) -> str:
    """Deploy an app and wait until it answers; returns its base URL."""
    return deploy_all({name: (route_prefix, args)})[name]


def deploy_all(apps: dict[str, tuple[str, dict]]) -> dict[str, str]:
    """Deploy ``{name: (route_prefix, args)}`` side by side and wait until each answers;
    their base URLs by name. Serve starts the apps' replicas at once, so a module whose tests
    each need an app of their own waits for about one deploy, not one each."""
    from ray import serve

    from deploy.app import build_app

    serve.run_many([serve.RunTarget(build_app(args), name=name, route_prefix=route_prefix)
                    for name, (route_prefix, args) in apps.items()])
    urls = {name: BASE + route_prefix.rstrip("/") for name, (route_prefix, _) in apps.items()}
    deadline = time.monotonic() + 120
    for name, url in urls.items():
        while not _answers(url):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not come up")
            time.sleep(0.5)
    return urls


def deployed(apps: dict[str, tuple[str, dict]]):
    """For a module fixture (``yield from deployed(...)``): :func:`deploy_all`'s URLs, and
    every app deleted once the module is done with them."""
    from ray import serve

    urls = deploy_all(apps)
    try:
        yield urls
    finally:
        for name in urls:
            serve.delete(name)
            end_hub(name)


def end_hub(app: str) -> None:
    """Kill a deleted app's metrics hub, where its units had replicas of their own: the hub is
    detached (it outlives a replica, so a new one finds the units' reports), so it would idle
    on the shared machine, a Ray worker's 10 ms wake-ups, until the session's end."""
    import ray
    from specserve.serve.metrics import HUB_NAMESPACE, hub_name

    try:
        ray.kill(ray.get_actor(hub_name(app), namespace=HUB_NAMESPACE))
    except ValueError:  # none: its unit ran in the ingress
        pass


def deployed_one(name: str, args: dict):
    """For a module fixture: one app at ``/name``, its URL, deleted once the module is done
    (an idle app costs the shared machine a few percent of a core while it stays)."""
    for urls in deployed({name: ("/" + name, args)}):
        yield urls[name]


def unit_handle(app: str):
    """A handle that reaches ``app``'s unit for its handle-only calls (stall, fault tokens,
    actor names): the units' deployment, or the ingress where the one unit runs in it
    (``unit_in_ingress``, the default for one CPU unit)."""
    from ray import serve

    deployments = serve.status().applications[app].deployments
    name = "SpeculationUnit" if "SpeculationUnit" in deployments else "OpenAIIngress"
    return serve.get_deployment_handle(name, app_name=app)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def target_only_texts(target_hf, prompts: list[str], max_tokens: int) -> dict[str, str]:
    """What the target alone produces for each prompt, greedily, in this process (no Ray, no
    HTTP): one batch, which gives each row the tokens it gets alone (the kernels are
    row-invariant) for the cost of one engine instead of one per prompt."""
    from specserve.config import SamplingParams
    from specserve.engine.tokenizer import encode_prompt

    from tests.engine.test_spec_decode import make_engine

    prompts = list(dict.fromkeys(prompts))
    tok = make_tiny_tokenizer()
    engine = make_engine(target_hf, None, slots=len(prompts), max_len=256)
    done = engine.generate([encode_prompt(tok, p) for p in prompts],
                           SamplingParams(temperature=0, max_tokens=max_tokens))
    return {p: c.text for p, c in zip(prompts, done)}


def unit_args(target_dir: str, **engine) -> dict:
    """A unit on the tiny model. Tests send short outputs and random-weight models accept
    little, so the short-output and low-acceptance rules are off (``test_policy.py`` and
    ``test_router.py`` test them). Prompts whole (``chunked_prefill_size`` None): bursts of
    many requests start in one step, as the tests' timings were made for; chunking is tested
    in the engine (``tests/engine/kv/test_prefix_cache.py``) and over HTTP on ``ngram_app``."""
    return {"unit": {"engine": {"target": {"source": target_dir}, "max_model_len": 256,
                                "max_num_seqs": 8, "chunked_prefill_size": None, **engine},
                     "max_queue_len": 16,
                     "router": {"short_output_tokens": 0, "low_acceptance_threshold": 0.0}},
            "max_tokens_cap": 200, "auth": {"enabled": False}}


@pytest.fixture(scope="session")
def ngram_app(ray_cluster, tiny_models) -> str:
    """The app most API tests use, on the paged KV cache with prefix caching and chunks of 32
    tokens: every test that compares its outputs with the target alone's checks both too."""
    return deploy("ngram", "/", unit_args(tiny_models[0],
                                          speculative={"method": "ngram", "num_speculative_tokens": 4},
                                          kv_cache={"layout": "paged", "block_size": 16},
                                          chunked_prefill_size=32))


@pytest.fixture(scope="session")
def draft_app(ray_cluster, tiny_models) -> str:
    """A unit with a draft group, placed on fake GPU bundles like on a cluster, the draft on
    a GPU bundle of its own (``draft_placement: own``; test_draft_faults.py runs the shared
    default)."""
    args = unit_args(tiny_models[0], speculative={
        "method": "draft_model", "num_speculative_tokens": 3,
        "draft": {"source": tiny_models[1]}})
    args["unit"]["accelerator"] = "gpu"
    args["unit"]["draft_placement"] = "own"
    args["unit"]["engine"]["target"]["device"] = "cpu"  # fake GPUs: the placement would say cuda
    args["unit"]["draft_retry_s"] = 0.2
    # Only a real fault may take the draft away: a busy machine must not time a step out.
    args["unit"]["draft_timeout_s"] = 120.0
    # The tiny draft costs as much as the tiny target, so the cost model would rightly stop
    # drafting; these tests need drafts to kill the draft actor under.
    args["unit"]["engine"]["speculative"]["adaptive"] = {"enabled": False}
    return deploy("draft", "/draft", args)
