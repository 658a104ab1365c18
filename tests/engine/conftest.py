"""What the engine tests share across modules: the C kernels' other builds, compiled once a
session (test_kernels.py and test_quantized.py run on each)."""

from __future__ import annotations

import ctypes
import shutil

import pytest
from specserve.engine.runtime import native

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
