"""Sharded weight loading: each tensor-parallel rank reads only its shard of every weight.

Loading a whole ``transformers`` model and slicing it afterwards (``tp.apply_tp``) costs every
rank the full model in host memory, about twice over (the fp32 model, then the fused copy):
some 280 GB per rank for a 70B model. Here the :class:`LlamaRuntime` is built on the meta
device and each parameter is filled from the checkpoint's safetensors files one at a time:
for each of its parts (q, k and v are fused into ``qkv``, gate and up into ``gate_up``) this
rank's rows or columns are read through ``safe_open(...).get_slice(name)[index]``, with the
split and index of :mod:`specserve.engine.runtime.tp`, and copied straight into a tensor of the
serving dtype on the serving device. Peak host memory per rank is then what the rank keeps on
the host (nothing beyond rope tables on a GPU; its shard on a CPU) plus one tensor
(``docs/LOADING.md`` has the measured numbers).

Why the file is opened once per tensor: ``safe_open`` maps the file into memory and a slice
is a view of that mapping. Every page a read touches counts in the process's resident set
until the mapping goes away, and a row-parallel slice (columns of every row) touches nearly
all pages of its tensor; held open, the whole file would count. Reopening costs a header
parse (microseconds to milliseconds); the data itself is in the page cache either way.

The checkpoint is found as ``transformers`` finds it: ``model.safetensors.index.json``
(several shard files) if present, else ``model.safetensors``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from specserve.engine.runtime import tp
from specserve.engine.runtime.arch import ModelArch
from specserve.engine.runtime.model import LlamaRuntime, checkpoint_names, rope_tables
from specserve.errors import ConfigError, ModelNotFoundError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def weight_files(folder: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file that holds it."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise ModelNotFoundError(f"{folder} has neither {INDEX_FILE} nor {SINGLE_FILE} "
                                 "(only safetensors checkpoints are loaded)")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def read_shard(files: dict[str, Path], sources: tuple[str, ...], split: tp.Split,
               out: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Fill ``out`` (this rank's shard of one parameter, any dtype and device) with this
    rank's slice of each checkpoint tensor in ``sources``, stacked on dim 0. Reads nothing
    for a row-parallel bias off rank 0 (zeros: rank 0 adds it once)."""
    from safetensors import safe_open

    if split is tp.Split.RANK0 and rank != 0:
        return out.zero_()
    row = 0
    for name in sources:
        with safe_open(str(files[name]), framework="pt") as f:  # see the module docstring
            part = f.get_slice(name)  # [rows, cols] or [rows], nothing read yet
            view = part[tp.shard_index(split, part.get_shape(), rank, world)]  # a view of the file
            dest = out[row: row + view.shape[0]]  # this part's rows of the fused shard
            if dest.shape != view.shape:
                raise ConfigError(f"checkpoint tensor {name} has shape {part.get_shape()}; "
                                  f"its shard {tuple(view.shape)} does not fit the model's "
                                  f"{tuple(out.shape)} at row {row}")
            dest.copy_(view)  # converts dtype and moves to the device, no intermediate copy
            row += view.shape[0]
            del view, part
    if row != out.shape[0]:
        raise ConfigError(f"{', '.join(sources)}: {row} rows for a shard of {out.shape[0]}")
    return out


def load_sharded(folder: Path, hf_config, *, max_len: int | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 group: dist.ProcessGroup | None = None, desc: str = "loading",
                 progress: bool | None = None) -> LlamaRuntime:
    """This rank's shard of the checkpoint in ``folder`` as a :class:`LlamaRuntime`, sharded
    over ``group`` (None: not sharded, the whole model). The result is what
    ``tp.apply_tp(build_runtime(...), group)`` gives, bit for bit (``tests/engine/
    test_sharded_load.py``). ``progress``: a tqdm bar over this rank's bytes on stderr;
    None: the bar on a terminal, elsewhere (a Ray actor's log, streamed to the driver with
    the actor's name) a line at every quarter (:class:`_QuarterLines`); False: nothing."""
    from tqdm.auto import tqdm

    rank, world = tp.tp_rank_world(group) if group is not None else (0, 1)
    arch = ModelArch.from_hf_config(hf_config)
    tp.check_divisible(arch, world)
    files, sources = weight_files(folder), checkpoint_names(arch)
    missing = sorted({n for names in sources.values() for n in names} - files.keys())
    if missing:
        raise ModelNotFoundError(f"the checkpoint in {folder} lacks {len(missing)} tensors "
                                 f"this architecture needs, e.g. {missing[0]}")
    cos, sin = rope_tables(hf_config, min(max_len or arch.max_position_embeddings,
                                          arch.max_position_embeddings))
    with torch.device("meta"):
        model = LlamaRuntime(arch, torch.empty_like(cos), torch.empty_like(sin))
    # named_parameters lists a tied LM head once, as the embedding it is
    plan = [(name, tp.split_of(name), tp.local_shape(tp.split_of(name), p.shape, world))
            for name, p in model.named_parameters()]
    total = sum(torch.Size(shape).numel() for _, _, shape in plan) * dtype.itemsize
    if world > 1:
        desc = f"rank {rank}/{world} {desc}"
    terminal = sys.stderr.isatty()
    bar = (tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not (progress or (progress is None and terminal)))
           if progress or terminal else _QuarterLines(total, desc, enabled=progress is None))
    with bar:
        for name, split, shape in plan:
            out = torch.empty(shape, dtype=dtype, device=device)
            tp.set_param(model, name, read_shard(files, sources[name], split, out, rank, world))
            bar.update(out.nbytes)
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.rope_cos = cos.to(device=device, dtype=dtype)
    model.rope_sin = sin.to(device=device, dtype=dtype)
    return tp.localize(model, world, group).eval()


class _QuarterLines:
    """tqdm's ``update`` / context protocol for a log that is not a terminal: one line on
    stderr as each quarter of the bytes is read (a bar's carriage returns would pile up into
    one line there)."""

    def __init__(self, total: int, desc: str, *, enabled: bool) -> None:
        self.total, self.desc, self.enabled = max(total, 1), desc, enabled
        self.done, self.quarter = 0, 0

    def __enter__(self) -> _QuarterLines:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def update(self, n: int) -> None:
        self.done += n
        quarter = min(4, 4 * self.done // self.total)
        if self.enabled and quarter > self.quarter:
            self.quarter = quarter
            size = (f"{self.total / 2**30:.1f} GiB" if self.total >= 2**30
                    else f"{self.total / 2**20:.1f} MiB")
            print(f"{self.desc}: {25 * quarter}% of {size}", file=sys.stderr, flush=True)
