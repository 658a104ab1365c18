"""Every shipped values file fits the GPUs it asks for, by the GPU memory estimate.

No network, no GPU, no cluster: the chart is rendered with the real ``helm template``; what a
rank will run is read from the rendered RayService (the app's tensor_parallel_size,
max_model_len, max_num_seqs, K and dtype; each worker group's GPUs per pod and its
``specserve.io/gpu-memory-gib`` annotation), and the models' architectures are their public
``config.json`` numbers (``specserve.model_configs``). ``specserve.memory`` itself is checked against a
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
    shared_gpu,
)
from specserve.model_configs import PUBLISHED

from tests.helm.test_chart import CHART, CI_VALUES, app_args, groups, render

FLAGSHIP = CHART / "ci" / "tp4-draft-values.yaml"
NODE_GPUS = 8  # the flagship's node (nodeSelector nvidia.com/gpu.count: "8")

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
    shape = ModelShape.from_config(PUBLISHED[model.source])
    load = Workload.of(engine, tp=1 if draft else pod.gpus, draft=draft)
    return estimate(shape, load), shape, load


def _why(est, pod: Pod, shape, load) -> str:
    return (f"\n{format_estimate(est, gpu_memory_bytes=pod.gpu_memory_bytes)}\n  largest max_num_seqs "
            f"that fits: {largest_num_seqs(shape, load, pod.gpu_memory_bytes)}")


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda p: p.stem if p else "defaults")
def test_every_rank_fits_its_gpu(values):
    """The target's ranks, and a draft model within MAX_UTILIZATION of the GPU memory each
    group was sized for: with ``draft_placement`` shared, target rank 0 and the draft together
    on one GPU, and shared wherever the two fit (the default); own only where they do not.
    A head trained here and kept on the model-cache volume has no published config and is not
    estimated."""
    app, by_group = rendered(values)
    target = by_group["target"]
    assert target.gpus == app.unit.tensor_parallel_size
    est, shape, load = fit(app, target, draft=False)
    assert est.fits(target.gpu_memory_bytes), _why(est, target, shape, load)
    if app.unit.has_draft_group and app.unit.engine.speculative.draft.source in PUBLISHED:
        both = shared_gpu(fit(app, target, draft=False)[1:], fit(app, target, draft=True)[1:],
                          target.gpu_memory_bytes)
        assert app.unit.draft_shares_gpu == both.fits, both.line()
        if not both.fits:
            assert by_group["draft"].gpus == 1
            est, shape, load = fit(app, by_group["draft"], draft=True)
            assert est.fits(by_group["draft"].gpu_memory_bytes), _why(est, by_group["draft"], shape, load)


def test_flagship_is_two_tp4_70b_units_with_1b_drafts_on_one_8_gpu_node():
    app, by_group = rendered(FLAGSHIP)
    engine = app.unit.engine
    assert engine.target.source == "meta-llama/Llama-3.1-70B-Instruct" and engine.target.dtype == "auto"
    assert engine.speculative.draft.source == "meta-llama/Llama-3.2-1B-Instruct"
    assert app.unit.draft_shares_gpu and set(by_group) == {"target"} and by_group["target"].gpus == 4
    assert app.num_units * by_group["target"].gpus == NODE_GPUS
    assert by_group["target"].gpu_memory_bytes == 79 * GIB


def test_flagship_comments_state_the_estimate():
    """The values file's comment carries the numbers the estimate gives now."""
    app, by_group = rendered(FLAGSHIP)
    text = FLAGSHIP.read_text()
    gpu = by_group["target"].gpu_memory_bytes
    for draft in (False, True):
        est, *_ = fit(app, by_group["target"], draft=draft)
        total = f"= {est.total / GIB:.1f} GiB, {est.total / gpu:.0%} of 79 GiB"
        assert re.search(re.escape(total), text), (draft, total)
        assert f"{est.kv_cache / GIB:.1f} GiB KV cache" in text, draft
    both = shared_gpu(fit(app, by_group["target"], draft=False)[1:],
                      fit(app, by_group["target"], draft=True)[1:], gpu)
    assert f"rank 0 + draft:   {both.total / GIB:.1f} GiB, {both.total / gpu:.0%} of 79 GiB" in text


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
