"""Before any step: is everything the steps import here, and is there a GPU? In seconds.

The lent machine has torch, transformers and pytest but not pydantic or llguidance (nor Ray,
which nothing here needs); those are carried as wheels (``make gpu-wheels``, docs/GPU.md).
A missing module is found here, named in one line with the fix, and only the steps that need
it are skipped: the others still run.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess

# The wheels the GPU machine lacks, and the one command that carries them (docs/GPU.md).
CARRIED = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "llguidance")
FIX = ("carry the wheels: `make gpu-wheels` here, run with carry=['.whl'], and on the machine "
       "`python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
       "--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site` (docs/GPU.md)")


def missing(modules) -> list[str]:
    """The modules of ``modules`` that cannot be found, in order, each once. Found, not
    imported: importing torch here would cost seconds and a CUDA context the steps need."""
    gone: list[str] = []
    for name in modules:
        if name not in gone and importlib.util.find_spec(name) is None:
            gone.append(name)
    return gone


def missing_line(gone: list[str], blocked: list[str]) -> str:
    """The one line that names what is missing, what it blocks and the fix."""
    how = FIX if set(gone) <= set(CARRIED) else "install them, or " + FIX
    return (f"preflight: missing {', '.join(gone)}: skipping {', '.join(blocked) or 'nothing'}; "
            f"{how}")


CUDA_PROBE = ("import json, torch; ok = torch.cuda.is_available(); print(json.dumps({"
              "'available': ok, 'torch': torch.__version__, 'cuda': torch.version.cuda, "
              "'devices': torch.cuda.device_count() if ok else 0, "
              "'name': torch.cuda.get_device_name(0) if ok else None}))")


def cuda(python: str, env: dict[str, str], timeout_s: float = 60.0) -> dict:
    """What torch sees, asked in a subprocess so that this process holds no CUDA context
    (it would take memory from every step's measurements). ``error`` where torch fails."""
    try:
        proc = subprocess.run([python, "-c", CUDA_PROBE], env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"available": False, "error": f"torch did not answer in {timeout_s:.0f} s"}
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"available": False, "error": tail}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def no_cuda_line(seen: dict) -> str:
    why = seen.get("error") or (f"torch {seen.get('torch')} (CUDA {seen.get('cuda')}) sees no GPU")
    return (f"preflight: no CUDA device: {why}; nothing to check here (--dry-run rehearses the "
            "steps on the CPU)")
