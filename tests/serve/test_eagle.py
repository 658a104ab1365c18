"""An EAGLE draft served over real HTTP: a draft directory from ``save_draft`` (the format
``train-draft`` writes), the draft actor reading only the target's embeddings from its files,
features travelling from target rank 0 through the coordinator to the draft actor every step,
prompt lookup in front (``ngram_first``). And a published EAGLE-3 head (the ``speculators``
format; the other formats' loaders are tested in-process in
``tests/engine/drafts/test_published_drafts.py``): the target group returns the layers it names.
The other published layouts (the EAGLE authors' EAGLE-3 and EAGLE-1, SpecForge's) run through
the real groups a unit starts, without the ingress and coordinator processes an app adds:
over HTTP they would take the path the speculators head takes (issue 50: four fewer
processes to start per layout, on the suite's slowest setup)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import torch
from specserve.config import SamplingParams
from specserve.engine.drafts.draft_head import save_draft
from specserve.engine.tokenizer import encode_prompt

from tests.engine.drafts.test_published_drafts import (
    eagle1_tensors,
    head_tensors,
    layer_config,
    write_checkpoint,
)
from tests.engine.test_spec_decode import make_engine
from tests.models import eagle_head_of, tiny_hf_model, write_agreeing_eagle3_head
from tests.serve.conftest import deployed, save_tiny, unit_args
from tests.serve.test_fallback import unit_stats
from tests.serve.test_http import (  # noqa: F401
    PROMPTS,
    complete,
    greedy_equals_target_only,
    model_name,
    read_sse,
)
from tests.serve.test_wire import Unit
from tests.tiny import make_tiny_tokenizer

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def apps(ray_cluster, tiny_models, tmp_path_factory) -> dict[str, str]:
    """Both apps of the module, deployed side by side on one draft directory:

    - ``eagle``: chains, prompt lookup in front, paged KV caches;
    - ``eagle-tree``: the EAGLE head drafting token trees (issue 20): its options travel to
      the draft actor, the cost model chooses the node budget (up to 6) per step;
    - ``eagle3`` and ``eagle3-tree``: a published EAGLE-3 head (issue 37) in chains and trees,
      on an MHA target of its own (``write_agreeing_eagle3_head``).
    """
    draft = tmp_path_factory.mktemp("eagle") / "draft"
    save_draft(eagle_head_of(tiny_models[2]), draft, target_name="tiny", tokenizer=make_tiny_tokenizer(),
               extra={})
    chain = unit_args(tiny_models[0], max_num_seqs=4, speculative={
        "method": "eagle", "num_speculative_tokens": 3, "ngram_first": True,
        "draft": {"source": str(draft)}, "adaptive": {"enabled": False}})
    # Paged: the rank follows the coordinator's block tables, and the draft actor's EAGLE
    # head pages its own cache (EngineConfig.draft_kv_cache). One rank (issue 35): EAGLE at
    # TP = 2 runs through the groups in test_wire.py and paged TP = 2 in test_tp.py; over
    # Serve, TP changes nothing but one more process to start.
    chain["unit"]["engine"]["kv_cache"] = {"layout": "paged", "block_size": 16}
    tree = unit_args(tiny_models[0], max_num_seqs=4, speculative={
        "method": "eagle", "num_speculative_tokens": 6, "draft": {"source": str(draft)},
        "eagle": {"tree": True, "tree_topk": 3, "tree_depth": 4},
        "adaptive": {"warmup_steps": 4, "probe_interval_steps": 4}})
    mha = tiny_hf_model("llama-mha", seed=0, logit_scale=3.0)
    mha_dir = save_tiny(tmp_path_factory.mktemp("tiny-mha"), mha)
    head = tmp_path_factory.mktemp("eagle3") / "head"
    write_agreeing_eagle3_head(mha, head)
    eagle3 = {tree: unit_args(mha_dir, max_num_seqs=4, speculative={
        "method": "eagle", "num_speculative_tokens": 3, "draft": {"source": str(head)},
        "eagle": {"tree": tree}, "adaptive": {"enabled": False}}) for tree in (False, True)}
    eagle3[False]["unit"]["engine"]["kv_cache"] = {"layout": "paged", "block_size": 16}
    # A draft step takes milliseconds; the default 10 s limit could still call a draft that a
    # busy machine delayed dead, and these tests need it drafting.
    for args in (chain, tree, *eagle3.values()):
        args["unit"]["draft_timeout_s"] = 120
    apps = {"eagle": ("/eagle", chain), "eagle-tree": ("/eagle-tree", tree),
            "eagle3": ("/eagle3", eagle3[False]), "eagle3-tree": ("/eagle3-tree", eagle3[True])}
    for urls in deployed(apps):
        yield {**urls, "mha": (mha, Path(mha_dir).name)}


@pytest.fixture(scope="module")
def eagle_app(apps) -> str:
    return apps["eagle"]


@pytest.fixture(scope="module")
def eagle_tree_app(apps) -> str:
    return apps["eagle-tree"]


def test_eagle_greedy_output_equals_target_only(eagle_app, tiny_models, model_name):  # noqa: F811
    bodies = greedy_equals_target_only(eagle_app, model_name, tiny_models[2], PROMPTS[:4], MAX_TOKENS,
                                       "eagle")
    assert sum(b["usage"]["speculation"]["num_accepted_tokens"] for b in bodies) > 0


def test_eagle_streams_and_seeded_sampling_repeats(eagle_app, model_name):  # noqa: F811
    body = {"model": model_name, "prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0.8,
            "seed": 7, "stream": True}
    texts = []
    for _ in range(2):
        with httpx.stream("POST", eagle_app + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            events = read_sse(r)
        texts.append("".join(e["choices"][0]["text"] for e in events if e["choices"]))
        assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length") or not events[-1]["choices"]
    assert texts[0] == texts[1] and texts[0]


def test_eagle_unit_frees_every_slot(eagle_app, model_name):  # noqa: F811
    for prompt in PROMPTS[4:]:
        assert complete(eagle_app, model_name, prompt, 8).status_code == 200
    stats = unit_stats(eagle_app)
    assert stats["draft_available"] and stats["running"] == 0 and stats["waiting"] == 0
    assert stats["free_slots"] == stats["num_slots"] == 4
    assert stats["spec"]["num_accepted_tokens"] > 0


def test_eagle_trees_through_serve(eagle_tree_app, tiny_models, model_name):  # noqa: F811
    """Greedy output equals target-only's; the unit verified trees, counted them by size,
    accepted depth and sibling rank, and exports them on /metrics."""
    greedy_equals_target_only(eagle_tree_app, model_name, tiny_models[2], PROMPTS[:4], MAX_TOKENS, "eagle")
    stats = unit_stats(eagle_tree_app)
    spec = stats["spec"]
    assert stats["spec_tree_drafts"] > 0 and spec["num_accepted_tokens"] > 0
    assert sum(spec["tree_sizes"].values()) == sum(spec["tree_accepted_depths"].values())
    assert stats["free_slots"] == stats["num_slots"] == 4
    deadline = time.monotonic() + 60  # the unit reports to the metrics hub every second
    while True:
        counts = [float(line.split()[-1]) for line in
                  httpx.get(eagle_tree_app + "/metrics", timeout=60).text.splitlines()
                  if line.startswith("specserve:spec_decode_tree_size_count")]
        if any(counts) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert any(counts), "no tree on /metrics"


@pytest.mark.parametrize("app", ["eagle3", "eagle3-tree"])
def test_a_published_eagle3_head_serves_greedy_output_identical_to_target_only(apps, app):
    """Chains and trees: the target rank returns the residual stream entering the layers the
    head names, the coordinator carries it to the draft actor, which fuses it with ``fc``."""
    mha, name = apps["mha"]
    bodies = greedy_equals_target_only(apps[app], name, mha, PROMPTS[:4], MAX_TOKENS, "eagle")
    assert sum(b["usage"]["speculation"]["num_accepted_tokens"] for b in bodies) > 0
    stats = unit_stats(apps[app])
    assert stats["draft_available"] and stats["free_slots"] == stats["num_slots"] == 4
    if app == "eagle3-tree":
        assert stats["spec_tree_drafts"] > 0


@pytest.fixture(scope="module")
def tall(tmp_path_factory):
    """An 8-layer target (EAGLE-3's default layers 2, 4, 5; SpecForge's config names 1, 4, 6)
    and each other published layout's head for it (random heads: they draft and are verified,
    and rarely accepted): ``(target_hf, target_dir, {layout: (head_dir, tree)})``."""
    target = tiny_hf_model("llama-gqa", seed=0, logit_scale=3.0, num_hidden_layers=8)
    target_dir = save_tiny(tmp_path_factory.mktemp("tiny-tall"), target)
    authors = tmp_path_factory.mktemp("eagle3-authors") / "head"
    eagle1 = tmp_path_factory.mktemp("eagle1") / "head"
    specforge = tmp_path_factory.mktemp("eagle3-specforge") / "head"
    write_checkpoint(authors, "eagle", head_tensors())
    write_checkpoint(specforge, "specforge", head_tensors())
    eagle1.mkdir()
    torch.save(eagle1_tensors(), eagle1 / "pytorch_model.bin")
    (eagle1 / "config.json").write_text(json.dumps(layer_config()))
    heads = {"eagle3-authors": (authors, False), "eagle3-specforge": (specforge, True),
             "eagle1-tree": (eagle1, True)}
    return target, target_dir, heads


@pytest.mark.parametrize("layout", ["eagle3-authors", "eagle3-specforge", "eagle1-tree"])
def test_the_other_published_layouts_through_the_groups_keep_greedy_output(local_ray, tall, layout):
    """The EAGLE authors' EAGLE-3 (``midlayer.``, ``pytorch_model.bin``, default layers) in
    chains, SpecForge's (its own layer ids) and their EAGLE-1 (the target's final state and
    LM head) in trees: the draft group loads them on the target's files, the target group
    returns what they read, and the greedy output is the target's own."""
    target, target_dir, heads = tall
    head, tree = heads[layout]
    draft = {"method": "eagle", "draft": {"source": str(head)}, "eagle": {"tree": tree}}
    tok = make_tiny_tokenizer()
    batch = [encode_prompt(tok, p) for p in PROMPTS[:3]]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    expected = make_engine(target, None, slots=4).generate(batch, greedy)
    unit = Unit(target_dir, draft, tp=1, slots=4)
    try:
        done = unit.engine.generate(batch, greedy)
        assert unit.engine.counters.spec.num_drafts > 0
        assert [c.output_token_ids for c in done] == [c.output_token_ids for c in expected]
        assert unit.target.num_free_slots == unit.target.num_slots == 4
    finally:
        unit.close()
