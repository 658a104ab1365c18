"""Every shipped values file fits the GPUs it asks for, by the GPU memory estimate.

No network, no GPU, no cluster: the chart is rendered with the real ``helm template``; what a
rank will run is read from the rendered RayService (the app's tensor_parallel_size,
max_model_len, max_num_seqs, K and dtype; each worker group's GPUs per pod and its
``specserve.io/gpu-memory-gib`` annotation), and the models' architectures are their public
``config.json`` numbers, written out below. ``specserve.memory`` itself is checked against a
real runtime's tensors in ``tests/test_memory.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
from specserve.app_config import AppConfig
from specserve.memory import (
    GIB,
    MAX_UTILIZATION,
    ModelShape,
    Workload,
    estimate,
    format_estimate,
    largest_num_seqs,
)

from tests.helm.test_chart import CHART, CI_VALUES, app_args, groups, render
from tests.test_memory import LLAMA_31_70B, LLAMA_32_1B

FLAGSHIP = CHART / "ci" / "tp4-draft-values.yaml"
NODE_GPUS = 8  # the flagship's node (nodeSelector nvidia.com/gpu.count: "8")

# Public config.json numbers of the other models the values files name (huggingface.co).
MODELS = {
    "meta-llama/Llama-3.1-70B-Instruct": LLAMA_31_70B,
    "meta-llama/Llama-3.1-8B-Instruct": {
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
        "tie_word_embeddings": False, "max_position_embeddings": 131072},
    "meta-llama/Llama-3.2-1B-Instruct": LLAMA_32_1B,
    "Qwen/Qwen2.5-14B-Instruct": {
        "model_type": "qwen2", "hidden_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 40,
        "num_key_value_heads": 8, "intermediate_size": 13824, "vocab_size": 152064,
        "tie_word_embeddings": False, "max_position_embeddings": 32768},
    "HuggingFaceTB/SmolLM2-1.7B-Instruct": {
        "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32,
        "num_key_value_heads": 32, "intermediate_size": 8192, "vocab_size": 49152,
        "tie_word_embeddings": True, "max_position_embeddings": 8192},
}


@dataclass(frozen=True)
class Pod:
    """A worker group as rendered: what one of its pods asks for and was sized for."""

    gpus: int
    gpu_memory_bytes: float


def pods(docs: list[dict]) -> dict[str, Pod]:
    out = {}
    for name, group in groups(docs).items():
        template = group["template"]
        [container] = template["spec"]["containers"]
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus == int(
            group["rayStartParams"]["num-gpus"])
        annotations = template["metadata"].get("annotations", {})
        gib = float(annotations.get("specserve.io/gpu-memory-gib", 80e9 / GIB))  # 80 GB unless said
        out[name] = Pod(gpus, gib * GIB)
    return out


def rendered(values=None, sets: tuple[str, ...] = ()) -> tuple[AppConfig, dict[str, Pod]]:
    docs = render(*([values] if values else []), sets=sets)
    return AppConfig.model_validate(app_args(docs)), pods(docs)


def fit(app: AppConfig, pod: Pod, *, draft: bool):
    """``(estimate, shape, workload)`` of the target's rank or the draft, as rendered."""
    engine = app.unit.engine
    model = engine.speculative.draft if draft else engine.target
    shape = ModelShape.from_config(MODELS[model.source])
    load = Workload.of(engine, tp=pod.gpus, draft=draft)
    return estimate(shape, load), shape, load


def _why(est, pod: Pod, shape, load) -> str:
    return (f"\n{format_estimate(est, gpu_memory_bytes=pod.gpu_memory_bytes)}\n  largest max_num_seqs "
            f"that fits: {largest_num_seqs(shape, load, pod.gpu_memory_bytes)}")


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda p: p.stem if p else "defaults")
def test_every_rank_fits_its_gpu(values):
    """The target's ranks, and a draft model's GPU (an EAGLE head is not estimated), within
    MAX_UTILIZATION of the GPU memory each group was sized for."""
    app, by_group = rendered(values)
    target = by_group["target"]
    assert target.gpus == app.unit.tensor_parallel_size
    est, shape, load = fit(app, target, draft=False)
    assert est.fits(target.gpu_memory_bytes), _why(est, target, shape, load)
    if app.unit.engine.speculative.method == "draft_model":
        assert by_group["draft"].gpus == 1
        est, shape, load = fit(app, by_group["draft"], draft=True)
        assert est.fits(by_group["draft"].gpu_memory_bytes), _why(est, by_group["draft"], shape, load)


def test_flagship_is_a_tp4_70b_and_a_1b_draft_on_one_8_gpu_node():
    app, by_group = rendered(FLAGSHIP)
    engine = app.unit.engine
    assert engine.target.source == "meta-llama/Llama-3.1-70B-Instruct" and engine.target.dtype == "auto"
    assert engine.speculative.draft.source == "meta-llama/Llama-3.2-1B-Instruct"
    assert (by_group["target"].gpus, by_group["draft"].gpus) == (4, 1)
    assert app.num_units * (by_group["target"].gpus + by_group["draft"].gpus) <= NODE_GPUS
    assert by_group["target"].gpu_memory_bytes == by_group["draft"].gpu_memory_bytes == 79 * GIB


def test_flagship_comments_state_the_estimate():
    """The values file's comment carries the numbers the estimate gives now."""
    app, by_group = rendered(FLAGSHIP)
    text = FLAGSHIP.read_text()
    for draft, group in ((False, "target"), (True, "draft")):
        est, *_ = fit(app, by_group[group], draft=draft)
        share = est.total / by_group[group].gpu_memory_bytes
        total = f"= {est.total / GIB:.1f} GiB, {share:.0%} of 79 GiB"
        assert re.search(re.escape(total), text), (group, total)
        assert f"{est.kv_cache / GIB:.1f} GiB KV cache" in text, group


def test_the_previous_flagship_would_not_start():
    """The check can fail: 64 slots at 8192 tokens, as the flagship had, do not fit a rank."""
    app, by_group = rendered(FLAGSHIP, sets=("specserve.unit.engine.max_num_seqs=64",))
    est, *_ = fit(app, by_group["target"], draft=False)
    assert not est.fits(by_group["target"].gpu_memory_bytes)
    assert est.total > MAX_UTILIZATION * 79 * GIB


def test_smaller_gpus_in_the_values_are_checked():
    """The gpu-memory annotation is what the test compares with: a 40 GB A100 cannot hold
    a 70B rank at TP 4."""
    app, by_group = rendered(FLAGSHIP, sets=("target.gpuMemoryGiB=39",))
    assert by_group["target"].gpu_memory_bytes == 39 * GIB
    est, *_ = fit(app, by_group["target"], draft=False)
    assert not est.fits(by_group["target"].gpu_memory_bytes)
