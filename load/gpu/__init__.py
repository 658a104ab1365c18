"""``make gpu-check``'s steps (``load/gpu_check.py`` runs them; docs/GPU.md says how and what passes).

A lent GPU machine is brief and returns only what a command leaves in one folder, so every
step is a module of its own that writes its one file as soon as it has something to say:

- ``runner.py``: a step as a subprocess under its own timeout, its output into the log, and
  ``summary.json`` rewritten after each step;
- ``preflight.py``: what each step imports, and whether CUDA is there, checked in seconds;
- ``output.py``: JSON and text written whole (a killed step leaves its last good file);
- ``runtime.py``: a runtime's kernels chosen across both signatures of ``use_kernels``;
- ``env.py`` (``env.json``), ``identity.py`` (``identity.json``), ``memory.py``
  (``memory.json``), ``profiling.py`` (``profile.txt``), ``step.py`` (``step.json``: whole
  requests through the engine, phase ``step``); ``load/bench_gpu.py`` writes ``bench.json``,
  and pytest ``tests.xml``.
"""
