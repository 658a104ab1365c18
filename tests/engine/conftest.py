"""What the engine tests share across modules: the tiny target most of them run (and a
close draft of it), made once per module that asks; the C kernels' other builds, compiled
once a session (test_kernels.py and test_quantized.py run on each)."""

from __future__ import annotations

import ctypes
import shutil

import pytest
from specserve.engine.runtime import native

from tests.models import perturbed, tiny_hf_model


@pytest.fixture(scope="module")
def target_hf():
    """The tiny Llama (GQA) target, its logits scaled so greedy choices are clear."""
    return tiny_hf_model("llama-gqa", seed=0, logit_scale=3.0)


@pytest.fixture(scope="module")
def close_draft_hf(target_hf):
    """Agrees with the target most of the time: long accepted runs and some rejections."""
    return perturbed(target_hf, scale=0.3)


# The C builds besides this CPU's own: the portable one always, the AVX2 code where the CPU
# would otherwise build AVX512 (on an AVX2 machine the native build is that code).
OTHER_BUILDS = {"portable": native.PORTABLE_FLAGS}
if "avx512f" in native._cpu():
    OTHER_BUILDS["avx2"] = native.FLAGS + ["-mno-avx512f"]


@pytest.fixture(scope="session")
def other_builds(tmp_path_factory):
    """Each build of OTHER_BUILDS, compiled once a session into a temporary cache (a compile
    is seconds on 2 cores)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "the suite runs with a C compiler"
    cache = tmp_path_factory.mktemp("kernels")
    libs = {}
    for name, flags in OTHER_BUILDS.items():
        path = cache / f"kernels-{name}.so"
        native._compile(compiler, flags, path)
        libs[name] = native.declare(ctypes.CDLL(str(path)))
    return libs
