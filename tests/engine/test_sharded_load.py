"""Sharded weight loading (``engine/shard_loader.py``): each tensor-parallel rank reads only
its shard of every weight from the safetensors files.

At world size 1 the sharded read gives the old full load (``transformers`` model, then
``build_runtime``) bit for bit. At TP = 2 (two spawned processes, gloo on 127.0.0.1) each
rank holds half of the per-layer weights and all of the replicated ones, its peak resident
memory while loading is its shard plus about one tensor, not the model, and rank 0's logits
equal TP = 1's. The memory numbers come from ``/proc/self/status`` in a fresh process, so the
test runs where that exists (Linux).
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from specserve.config import ModelConfig
from specserve.engine.loader import load_hf_model, load_model, resolve
from specserve.engine.runtime.forward_batch import ForwardBatch
from specserve.engine.runtime.model import build_runtime
from specserve.engine.runtime.tp import Split, apply_tp, split_of
from specserve.engine.shard_loader import INDEX_FILE, load_sharded
from transformers import LlamaConfig, LlamaForCausalLM

from tests.models import TINY_CONFIGS, random_sequences, runtime_of, tiny_hf_model
from tests.net import free_port
from tests.serve.conftest import save_tiny
from tests.tiny import make_tiny_tokenizer

# Large enough that a rank's shard (about 180 MiB of 365) stands well clear of allocator and
# import noise, small enough to write and load in a few seconds: per-layer weights are 99%
# of it, so halving them halves the model.
BIG = dict(vocab_size=512, hidden_size=1024, intermediate_size=4096, num_hidden_layers=6,
           num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=256,
           bos_token_id=1, eos_token_id=2, pad_token_id=0)
# TP = 2 also checks these against apply_tp on the full model: a tied LM head with biases on
# every linear (row-parallel ones added by rank 0 only), and Qwen2's q/k/v biases.
TINY_TP = ("llama-mha", "qwen2-bias")
BATCH = random_sequences((5, 12, 3), seed=7)
NUM_LOGITS = [2, 1, 3]


def tiny_model(kind: str, seed: int):
    """A tiny model whose biases and norms are random too (initialised to zeros and ones, a
    bias added twice or a norm read for another would not show)."""
    model = tiny_hf_model(kind, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def forward(runtime) -> torch.Tensor:
    """``[sum(NUM_LOGITS), vocab]`` logits of one ragged batch from empty slots."""
    cache = runtime.make_cache(num_slots=len(BATCH), max_seq_len=64)
    return runtime(cache, ForwardBatch(list(range(len(BATCH))), BATCH, NUM_LOGITS)).logits


def same_params(a, b) -> bool:
    """The same parameter names with bit-identical values."""
    ours, theirs = dict(a.named_parameters()), dict(b.named_parameters())
    return ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)


def layer_bytes(runtime) -> dict[str, int]:
    """Bytes of this rank's parameters: the split per-layer linears, and the rest."""
    out = {"sharded": 0, "replicated": 0}
    for name, p in runtime.named_parameters():
        out["replicated" if split_of(name) is Split.REPLICATE else "sharded"] += p.nbytes
    return out


def _memory() -> dict[str, int]:
    """This process's resident set now and its peak since the last reset, in bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def _reset_peak() -> None:
    """Start VmHWM again from the current resident set (Linux >= 4.0); where that is refused
    the peak keeps the process's earlier maximum, which only makes the check stricter."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _rank_main(rank: int, world: int, port: int, big: str, tiny: dict[str, str], out: str) -> None:
    """One TP rank: load every checkpoint sharded, report bytes, peak memory and logits."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(minutes=5))
    group = dist.group.WORLD
    report: dict = {"tiny": {}}
    for kind, path in tiny.items():  # first: also warms the imports a load makes
        cfg = ModelConfig(source=path, device="cpu", dtype="float32")
        sharded = load_model(cfg, max_model_len=64, tp_group=group).runtime
        hf = load_hf_model(resolve(path))
        whole = apply_tp(build_runtime(hf.config, hf.state_dict(), max_len=64), group)
        report["tiny"][kind] = {"same_as_apply_tp": same_params(sharded, whole),
                                "logits": forward(sharded),
                                "tied": sharded.lm_head.weight is sharded.embed.weight}
        del sharded, whole, hf
    before = _memory()
    _reset_peak()
    loaded = load_model(ModelConfig(source=big, device="cpu", dtype="float32"), max_model_len=64,
                        tp_group=group)
    report["peak"] = _memory()["VmHWM"] - before["VmRSS"]
    report["bytes"] = layer_bytes(loaded.runtime)
    report["eos"] = loaded.eos_token_ids
    report["logits"] = forward(loaded.runtime)
    torch.save(report, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


# -- world size 1: the sharded read is the full load ------------------------------------------


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_world_1_sharded_load_equals_the_full_load(kind, tmp_path):
    """Every parameter bit for bit, the tied head still tied, and so the same logits; the
    checkpoint is split over several files behind an index."""
    hf = tiny_model(kind, seed=2)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / INDEX_FILE).is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
    full = runtime_of(hf, max_len=64)
    sharded = load_sharded(tmp_path, hf.config, max_len=64).requires_grad_(False)
    assert same_params(sharded, full)
    assert torch.equal(sharded.rope_cos, full.rope_cos) and torch.equal(sharded.rope_sin, full.rope_sin)
    assert (sharded.lm_head.weight is sharded.embed.weight) == hf.config.tie_word_embeddings
    assert not any(p.is_meta or p.requires_grad for p in sharded.parameters())
    assert torch.equal(forward(sharded), forward(full))


def test_load_model_reads_configs_without_the_transformers_model(tmp_path):
    """A single-file checkpoint; EOS ids from the generation config, or without one from
    config.json, as ``from_pretrained`` sets them."""
    hf = tiny_model("qwen2-bias", seed=3)
    save_tiny(tmp_path, hf)
    assert (tmp_path / "model.safetensors").is_file() and not (tmp_path / INDEX_FILE).exists()
    loaded = load_model(ModelConfig(source=str(tmp_path)), max_model_len=64)
    assert loaded.name == tmp_path.name and loaded.eos_token_ids == frozenset({2})
    assert torch.equal(forward(loaded.runtime), forward(runtime_of(hf, max_len=64)))
    (tmp_path / "generation_config.json").unlink()
    assert load_model(ModelConfig(source=str(tmp_path)), max_model_len=64).eos_token_ids == {2}


def test_progress_bar_names_the_model(tmp_path, capsys):
    hf = tiny_hf_model("llama-gqa", seed=4)
    hf.save_pretrained(tmp_path)
    load_sharded(tmp_path, hf.config, max_len=64, desc="loading tiny", progress=True)
    assert "loading tiny" in capsys.readouterr().err


def test_progress_off_a_terminal_is_a_line_per_quarter(tmp_path, capsys):
    """A Ray actor's stderr is a log, not a terminal: four lines, not carriage returns."""
    hf = tiny_hf_model("llama-gqa", seed=4)
    hf.save_pretrained(tmp_path)
    load_sharded(tmp_path, hf.config, max_len=64, desc="rank 1/2 loading tiny")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rank")]
    assert [line.split(": ")[1].split("%")[0] for line in lines] == ["25", "50", "75", "100"]
    assert all(line.startswith("rank 1/2 loading tiny: ") for line in lines)


# -- TP = 2 in two processes -----------------------------------------------------------------


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory) -> tuple[str, int]:
    """A random Llama of about 365 MiB (fp32) in two safetensors files, and its bytes."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**BIG)).eval()
    path = tmp_path_factory.mktemp("big")
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path, max_shard_size="200MB")
    make_tiny_tokenizer().save_pretrained(path)
    return str(path), sum(p.nbytes for p in model.parameters())


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status")
def test_tp2_ranks_read_half_the_weights_and_match_tp1(big_checkpoint, tmp_path):
    """Two ranks load through ``load_model(tp_group=...)``, as ``TargetRank.setup`` does."""
    big, model_bytes = big_checkpoint
    tiny = {kind: save_tiny(tmp_path / kind, tiny_model(kind, seed=5)) for kind in TINY_TP}
    mp.spawn(_rank_main, args=(2, free_port(), big, tiny, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    whole = load_model(ModelConfig(source=big, device="cpu", dtype="float32"), max_model_len=64)
    full = layer_bytes(whole.runtime)
    for report in ranks:
        # (a) half of every split weight, all of every replicated one
        assert report["bytes"]["sharded"] * 2 == full["sharded"]
        assert report["bytes"]["replicated"] == full["replicated"]
        # (b) peak memory while loading: the rank's shard plus about one tensor (16 MiB here),
        # nowhere near the model (the old load peaked above twice the model on every rank)
        own = sum(report["bytes"].values())
        assert report["peak"] < own + model_bytes // 4, (report["peak"], own, model_bytes)
        assert report["peak"] < model_bytes * 3 // 4
        assert report["eos"] == whole.eos_token_ids == {2}
    # (c) the logits every rank computes (rank 0 returns them) are TP = 1's
    assert (ranks[0]["logits"] - forward(whole.runtime)).abs().max() <= 1e-4
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])
    for kind in TINY_TP:
        tp1 = forward(load_model(ModelConfig(source=tiny[kind]), max_model_len=64).runtime)
        for report in ranks:
            assert report["tiny"][kind]["same_as_apply_tp"]
            assert (report["tiny"][kind]["logits"] - tp1).abs().max() <= 1e-4
    assert ranks[0]["tiny"]["llama-mha"]["tied"]
