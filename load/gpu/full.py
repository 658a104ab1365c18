"""``full.json``: issue 52's host and speed lines at the model's real depth (``make gpu-check
PHASE=full``): step.py's entries that measure the host's part of a step and what speculation
gives at acceptance near 1, on the whole Llama-3-8B shape (32 layers) at batch 1.

step.json's model has 4 of the 8B's layers, so its device part of a step (0.9 ms on an H200,
the fourth window) is less than the host's (about 2.4 ms): there the host gap measures the
host, and launching ahead cannot hide it. Here the device's part is the real model's (about
6 ms a decode), so ``host_gap`` says whether launching ahead hides the host (issue 52's aim:
0.3 ms a step), ``launch_ahead_off`` what that buys, ``suffix``'s second pass what
speculation gives where a verify costs about a decode, and ``host_profile`` where the host's
time goes. 4 prompts x 128 tokens in one slot, so the warm-up compiles one decode bucket and
the prompts' prefill shapes (30-40 s each at 32 layers). A dry run: step.py's tiny shape in
one slot.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from load.gpu import step

FILE = "full.json"
GPU = replace(step.GPU, shape="llama3-8b", batch=1, num_prompts=step.HOST_GAP_PROMPTS)
DRY = replace(step.DRY, batch=1)
ENTRIES = (("target_only", step.target_only), ("host_gap", step.host_gap),
           ("launch_ahead_off", step.launch_ahead_off), ("suffix", step.suffix),
           ("host_profile", step.host_profile))


def run(out: Path, dry_run: bool) -> None:
    step.run_entries(out / FILE, DRY if dry_run else GPU, step.build, ENTRIES)
