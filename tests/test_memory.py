"""The GPU memory estimate (``specserve.memory``) against the tensors the runtime really holds.

No network and no GPU: tiny seeded models are saved and loaded on the CPU through
``load_model`` (the serving loader), at TP 1 and, with the rank faked, as each rank of TP 2;
their parameters, rope tables and ``SlotKVCache`` tensors must be exactly the estimate's
weight and KV bytes, so the estimate cannot drift from the code. The one test that measures
the workspace needs CUDA and is skipped without it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from specserve.cli import main
from specserve.config import EngineConfig, ModelConfig
from specserve.engine.kv.kv_cache import SlotKVCache
from specserve.engine.loader import load_model
from specserve.engine.runtime import tp
from specserve.engine.runtime.forward_batch import ForwardBatch
from specserve.engine.runtime.kernels import KV_BLOCK
from specserve.engine.runtime.model import default_kernels
from specserve.engine.worker import ModelWorker
from specserve.errors import ConfigError
from specserve.memory import (
    GIB,
    MAX_UTILIZATION,
    ModelShape,
    Workload,
    check_fits,
    compiled,
    estimate,
    estimate_memory,
    format_estimate,
    forward_workspace,
    kv_cache_bytes,
    largest_kv_blocks,
    largest_num_seqs,
    workspace_bytes,
)
from specserve.model_configs import PUBLISHED

from tests.models import TINY_CONFIGS, tiny_hf_model
from tests.tiny import make_tiny_tokenizer

# Public config.json numbers (huggingface.co/meta-llama/*/blob/main/config.json).
LLAMA_31_70B = PUBLISHED["meta-llama/Llama-3.1-70B-Instruct"]
LLAMA_32_1B = PUBLISHED["meta-llama/Llama-3.2-1B-Instruct"]
GPU_80GB = 79 * GIB  # an "80 GB" H100 / A100 as CUDA counts it
MAX_LEN = 100        # not a whole number of KV blocks: the cache rounds it up to 128


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """kind -> a saved tiny model directory (config.json, safetensors, tokenizer), made on use."""
    made: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in made:
            path = tmp_path_factory.mktemp(kind)
            model = tiny_hf_model(kind, seed=1)
            model.generation_config.eos_token_id = 2
            model.save_pretrained(path)
            make_tiny_tokenizer().save_pretrained(path)
            made[kind] = str(path)
        return made[kind]

    return get


def _load(path: str, dtype: str, world: int, rank: int, monkeypatch):
    """This rank's runtime as ``load_model`` builds it (the rank and world faked under TP)."""
    group = None
    if world > 1:
        monkeypatch.setattr(tp, "tp_rank_world", lambda group=None: (rank, world))
        group = object()  # never used for a collective while loading
    cfg = ModelConfig(source=path, dtype=dtype, device="cpu", kernels="invariant")
    return load_model(cfg, max_model_len=MAX_LEN, tp_group=group).runtime


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("world, rank", [(1, 0), (2, 0), (2, 1)])
@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_weights_and_kv_cache_are_the_runtimes_bytes(tiny_dirs, monkeypatch, kind, world, rank, dtype):
    """Every architecture variant of the tiny fixtures (GQA, MHA with biases and a tied head,
    Qwen2's q/k/v biases, llama3 rope, a sliding window), whole and as each TP 2 rank."""
    path = tiny_dirs(kind)
    config = json.loads(Path(path, "config.json").read_text())  # what `memory-estimate` reads
    load = Workload(max_model_len=MAX_LEN, max_num_seqs=3, num_speculative_tokens=4, tp=world, dtype=dtype)
    if config["num_key_value_heads"] % world:
        with pytest.raises(ConfigError, match="num_key_value_heads"):
            estimate_memory(config, **vars(load))
        with pytest.raises(ConfigError, match="num_key_value_heads"):
            _load(path, dtype, world, rank, monkeypatch)
        return
    est = estimate_memory(config, **vars(load))
    runtime = _load(path, dtype, world, rank, monkeypatch)
    params = dict(runtime.named_parameters())  # a tied LM head is listed once, as the embedding
    sharded = sum(p.nbytes for name, p in params.items()
                  if tp.split_of(name) in (tp.Split.COLUMN, tp.Split.ROW))
    whole = sum(p.nbytes for p in params.values()) + sum(b.nbytes for b in runtime.buffers())
    assert (est.sharded_weights, est.weights) == (sharded, whole)
    worker = ModelWorker(runtime, num_slots=3, max_seq_len=MAX_LEN)
    assert est.kv_cache == sum(t.nbytes for t in worker.cache.k + worker.cache.v)
    assert worker.cache.k[0].shape[2] == 128  # the rounding the estimate models


def test_the_spare_slot_and_the_block_size_are_the_caches():
    """``kernels: compiled`` adds a padding slot; the block size is the kernels' own."""
    shape = ModelShape.from_config(LLAMA_32_1B)
    cache = SlotKVCache(num_layers=2, num_slots=3, num_kv_heads=8, max_seq_len=MAX_LEN, head_dim=64,
                        dtype=torch.bfloat16, block=KV_BLOCK, spare=True)
    two_layers = ModelShape(**{**vars(shape), "num_layers": 2})
    load = Workload(max_model_len=MAX_LEN, max_num_seqs=3, dtype="bfloat16", spare_slot=True)
    assert kv_cache_bytes(two_layers, load) == sum(t.nbytes for t in cache.k + cache.v)
    from specserve import memory

    assert memory.KV_BLOCK == KV_BLOCK


def test_flagship_target_per_rank_by_hand():
    """Llama-3.1-70B at TP 4, bf16, 8192 x 24, worked out from the public numbers: per layer
    q/k/v (64 + 2 x 8) x 128 x 8192, o 8192 x 8192, gate/up 2 x 28672 x 8192, down
    28672 x 8192 = 855,638,016 parameters, a quarter of them per rank; the embeddings and LM
    head (2 x 128256 x 8192), 161 norms and the rope tables whole on every rank; the KV
    cache 2 x 80 layers x 24 slots x 2 kv heads x 8192 x 128 x 2 bytes."""
    est = estimate_memory(LLAMA_31_70B, tp=4, max_model_len=8192, max_num_seqs=24, num_speculative_tokens=4)
    assert est.sharded_weights == 80 * 855_638_016 // 4 * 2
    assert est.replicated_weights == (2 * 128256 * 8192 + 161 * 8192 + 2 * 8192 * 128) * 2
    assert est.kv_cache == 2 * 80 * 24 * 2 * 8192 * 128 * 2 == 15 * GIB
    assert est.fits(GPU_80GB) and est.total < 0.87 * GPU_80GB


def test_the_old_flagship_does_not_fit():
    """64 slots at 8192 need 40 GiB of KV cache per rank beside 35.8 GiB of weights."""
    old = estimate_memory(LLAMA_31_70B, tp=4, max_model_len=8192, max_num_seqs=64, num_speculative_tokens=4)
    assert old.kv_cache == 40 * GIB and not old.fits(GPU_80GB)
    assert old.total > GPU_80GB  # not even with no headroom at all


def test_the_draft_fits_its_own_gpu():
    est = estimate_memory(LLAMA_32_1B, max_model_len=8192, max_num_seqs=24, num_speculative_tokens=4,
                          draft=True)
    assert est.replicated_weights < 0.5 * GIB  # tied: the LM head is the embedding
    assert est.kv_cache == 6 * GIB and est.overhead == 1 * GIB and est.fits(GPU_80GB)


def test_workspace_grows_with_the_context_not_its_square():
    """FlexAttention keeps no scores: a prefill's transient tensors are per token (the SDPA
    math backend the estimate modelled before issue 52 made them quadratic)."""
    shape = ModelShape.from_config(LLAMA_32_1B)
    short, long = (workspace_bytes(shape, Workload(max_model_len=n, max_num_seqs=1)) for n in (4096, 8192))
    assert 1.9 < long / short < 2.1


# The Llama-3-8B shape of `make gpu-check`'s memory step, and what an H100 measured there
# (docs/gpu-runs/2026-11-26-h100/memory.json, 8192 x 16, K = 4, bfloat16): each forward's peak
# above the static allocation, library and compiled kernels.
LLAMA_3_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336,
              "vocab_size": 128256, "tie_word_embeddings": False, "max_position_embeddings": 8192}
H100_PEAKS = {"prefill": (1_178_936_832, 1_145_382_400), "verify": (569_065_984, 539_856_896)}


def test_the_workspace_is_within_a_quarter_above_the_measured_peaks():
    """Issue 52: the workspace at most 25% above the peak a GPU measured, and never below."""
    shape, nbytes = ModelShape.from_config(LLAMA_3_8B), 2
    forwards = {"prefill": forward_workspace(shape, 1, nbytes, rows=1, new_tokens=8192,
                                             logit_rows=5),
                "verify": forward_workspace(shape, 1, nbytes, rows=16, new_tokens=5, logit_rows=80)}
    for name, peaks in H100_PEAKS.items():
        assert all(peak <= forwards[name] <= 1.25 * peak for peak in peaks), (name, forwards, peaks)
    load = Workload(max_model_len=8192, max_num_seqs=16, num_speculative_tokens=4, dtype="bfloat16")
    assert workspace_bytes(shape, load) == max(forwards.values())


def test_largest_num_seqs_is_the_edge():
    shape = ModelShape.from_config(LLAMA_31_70B)
    load = Workload(max_model_len=8192, max_num_seqs=4096, num_speculative_tokens=4, tp=4)
    most = largest_num_seqs(shape, load, GPU_80GB)
    assert estimate(shape, Workload(8192, most, 4, 4)).fits(GPU_80GB)
    assert not estimate(shape, Workload(8192, most + 1, 4, 4)).fits(GPU_80GB)


def test_check_fits_names_the_fix():
    """What an engine would call at start with ``torch.cuda.mem_get_info()``'s numbers."""
    shape = ModelShape.from_config(LLAMA_31_70B)
    free, total = int(78.5 * GIB), GPU_80GB
    fine = check_fits(shape, Workload(8192, 24, 4, 4), free_bytes=free, total_bytes=total)
    assert fine.total < MAX_UTILIZATION * total
    with pytest.raises(ConfigError, match=r"lower max_num_seqs to 49 or less") as err:
        check_fits(shape, Workload(8192, 64, 4, 4), free_bytes=free, total_bytes=total)
    assert "80.6 GiB" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):  # a GPU someone else uses
        check_fits(shape, Workload(8192, 24, 4, 4), free_bytes=10 * GIB, total_bytes=total)


def test_workload_of_an_engine_config():
    cfg = EngineConfig.model_validate({
        "target": {"source": "t", "dtype": "float16"}, "max_model_len": 4096, "max_num_seqs": 16,
        "speculative": {"method": "draft_model", "num_speculative_tokens": 3,
                        "draft": {"source": "d", "kernels": "compiled"}}})
    # kernels auto: compiled for a target on CUDA (its spare slot), library for a draft
    assert Workload.of(cfg, tp=2) == Workload(4096, 16, 3, 2, "float16", spare_slot=True)
    assert Workload.of(cfg, draft=True) == Workload(4096, 16, 3, 1, "auto", draft=True, spare_slot=True)
    for change in ({"kernels": "library"}, {"device": "cpu"}):
        other = cfg.model_copy(update={"target": cfg.target.model_copy(update=change)})
        assert not Workload.of(other).spare_slot, change
    auto_draft = cfg.speculative.model_copy(update={"draft": cfg.speculative.draft.model_copy(
        update={"kernels": "auto"})})
    assert not Workload.of(cfg.model_copy(update={"speculative": auto_draft}), draft=True).spare_slot
    for device in ("cpu", "cuda"):  # the estimate's rule is the engine's (default_kernels)
        for draft in (False, True):
            expected = default_kernels(device, draft=draft) == "compiled"
            assert compiled(ModelConfig(device=device).kernels, device, draft) == expected, (device, draft)


def test_format_is_one_line_per_part():
    est = estimate_memory(LLAMA_31_70B, tp=4, max_model_len=8192, max_num_seqs=24, num_speculative_tokens=4)
    lines = format_estimate(est, gpu_memory_bytes=GPU_80GB).splitlines()
    assert [line.split()[0] for line in lines] == ["sharded", "replicated", "KV", "workspace",
                                                    "overhead", "total"]
    assert lines[-1].endswith("69% of 79.0 GiB: fits (at most 90%)")


@pytest.fixture
def config_files(tmp_path):
    target, draft = tmp_path / "target", tmp_path / "draft.json"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(LLAMA_31_70B))
    draft.write_text(json.dumps(LLAMA_32_1B))
    return str(target), str(draft)


def test_cli_prints_every_part_and_exits_1_when_it_does_not_fit(config_files, capsys):
    target, draft = config_files
    flags = ["memory-estimate", "--config", target, "--draft-config", draft, "--tp", "4",
             "--max-model-len", "8192", "-k", "4", "--gpu-memory-gib", "79"]
    assert main([*flags, "--max-num-seqs", "24"]) == 0
    out = capsys.readouterr().out
    assert out.count("total") == 2 and "KV cache             15.62 GiB" in out  # 24 slots + the padding one
    assert "largest max_num_seqs that fits: 48" in out
    assert out.endswith(  # shared, the default: both on rank 0's GPU
        "target rank 0 + draft on one GPU: 55.06 + 10.01 = 65.07 GiB, 82% of 79.0 GiB: fits (at most "
        "90%); draft_gpu_fraction 0.15\n"
        "  largest max_num_seqs that fits both: 30 (else draft_placement own)\n")
    assert main([*flags, "--max-num-seqs", "40"]) == 1  # each fits alone, not together
    assert "does NOT fit" in capsys.readouterr().out
    assert main([*flags, "--max-num-seqs", "40", "--draft-placement", "own"]) == 0
    assert "on one GPU" not in capsys.readouterr().out
    assert main([*flags, "--max-num-seqs", "64", "--draft-placement", "own"]) == 1
    assert "does NOT fit" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--config", "/nope/config.json"], "cannot read /nope/config.json"),
    (["--max-num-seqs", "0"], "max_num_seqs: Input should be greater than or equal to 1"),
    (["--max-model-len", "200000"], "exceeds the model's max_position_embeddings 131072"),
    (["--bad-json"], "is not JSON"),
    (["--no-heads"], "num_attention_heads must be a positive integer"),
])
def test_cli_bad_input_is_one_line_and_exit_2(config_files, tmp_path, capsys, args, message):
    target, _ = config_files
    if args == ["--bad-json"]:
        (tmp_path / "bad.json").write_text("{")
        args = ["--config", str(tmp_path / "bad.json")]
    if args == ["--no-heads"]:
        (tmp_path / "heads.json").write_text(json.dumps({**LLAMA_31_70B, "num_attention_heads": None}))
        args = ["--config", str(tmp_path / "heads.json")]
    config = [] if "--config" in args else ["--config", target]
    assert main(["memory-estimate", *config, "--tp", "4", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specserve: error: ") and message in err, err


@pytest.mark.gpu  # measures the CUDA caching allocator (make gpu-check)
@pytest.mark.parametrize("phase", ["prefill", "verify"])
def test_workspace_bounds_a_real_forward_on_cuda(phase):
    """The workspace estimate is at least the peak a forward allocates on a GPU (library
    kernels, bf16): a prefill of a full-length prompt, a verify of every slot at full context."""
    from specserve.engine.runtime.model import build_runtime

    length, slots, k = 2048, 4, 4
    hf = tiny_hf_model("llama-gqa", seed=0, max_position_embeddings=length)
    runtime = build_runtime(hf.config, hf.state_dict(), max_len=length, dtype=torch.bfloat16,
                            device="cuda").use_kernels("library")
    worker = ModelWorker(runtime, num_slots=slots, max_seq_len=length)
    for _ in range(slots):
        worker.allocate()
    worker.forward(ForwardBatch([0], [[1, 2, 3]], [1]))  # loads the kernels and cuBLAS's workspace first
    worker.rollback(0, 0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    if phase == "prefill":
        logits = worker.forward(ForwardBatch([0], [[i % 500 for i in range(length)]], [k + 1])).logits
    else:
        for slot in range(slots):
            worker.cache.lengths[slot] = length - k - 1
        logits = worker.forward(ForwardBatch(list(range(slots)), [[7] * (k + 1)] * slots,
                                             [k + 1] * slots)).logits
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del logits
    shape = ModelShape.from_config(hf.config.to_dict())
    assert peak <= workspace_bytes(shape, Workload(length, slots, k, dtype="bfloat16"))


def test_the_doctests_hold():
    import doctest

    from specserve import memory

    assert doctest.testmod(memory).failed == 0


def test_a_paged_pool_is_its_blocks_and_names_its_own_fix(capsys, config_files):
    """Paged (issue 34): the pool's tensors are ``num_blocks x block_size`` positions, whatever
    ``max_num_seqs``; by default the slots' memory; the fix a GPU too small gets is fewer
    blocks, and the CLI prints the blocks and the most that fit."""
    from specserve.engine.kv.kv_cache import PagedKVCache

    shape = ModelShape.from_config(LLAMA_32_1B)
    two_layers = ModelShape(**{**vars(shape), "num_layers": 2})
    cache = PagedKVCache(num_layers=2, num_blocks=10, block_size=16, num_slots=3, num_kv_heads=8,
                         max_seq_len=MAX_LEN, head_dim=64, dtype=torch.bfloat16)
    load = Workload(max_model_len=MAX_LEN, max_num_seqs=3, dtype="bfloat16", paged=True,
                    kv_blocks=10, block_size=16)
    assert kv_cache_bytes(two_layers, load) == sum(t.nbytes for t in cache.k + cache.v)
    assert kv_cache_bytes(two_layers, replace(load, max_num_seqs=300)) == kv_cache_bytes(two_layers, load)
    cfg = EngineConfig.model_validate({"max_model_len": 8192, "max_num_seqs": 24,
                                       "kv_cache": {"layout": "paged"}})
    assert Workload.of(cfg).pool_blocks == 24 * 8192 // 16  # the slots' memory
    seventy = ModelShape.from_config(LLAMA_31_70B)
    default = estimate(seventy, Workload(8192, 24, 4, 4, paged=True))
    assert default.kv_cache == estimate(seventy, Workload(8192, 24, 4, 4)).kv_cache == 15 * GIB
    half = Workload(8192, 64, 4, 4, paged=True, kv_blocks=6144)  # 12 sequences' worth, 64 slots
    assert estimate(seventy, half).kv_cache == 15 * GIB // 2
    most = largest_kv_blocks(seventy, half, GPU_80GB)
    assert estimate(seventy, replace(half, kv_blocks=most)).fits(GPU_80GB)
    assert not estimate(seventy, replace(half, kv_blocks=most + 1)).fits(GPU_80GB)
    with pytest.raises(ConfigError, match=rf"lower kv_cache.num_blocks to {most - 1}|"
                                          rf"lower kv_cache.num_blocks to \d+ or less"):
        check_fits(seventy, replace(half, kv_blocks=4 * most), free_bytes=int(78.5 * GIB),
                   total_bytes=GPU_80GB)
    target, _ = config_files
    assert main(["memory-estimate", "--config", target, "--tp", "4", "--max-model-len", "8192",
                 "--max-num-seqs", "64", "-k", "4", "--kv-layout", "paged", "--kv-blocks", "6144",
                 "--block-size", "16", "--gpu-memory-gib", "79"]) == 0
    out = capsys.readouterr().out
    assert "KV cache              7.50 GiB  6144 blocks of 16: 12.0 x max_model_len" in out
    assert "largest kv_cache.num_blocks that fits: " in out
    assert main(["memory-estimate", "--config", target, "--tp", "4", "--max-model-len", "8192",
                 "--max-num-seqs", "64", "-k", "4", "--kv-layout", "paged", "--kv-blocks", "1536"]) == 0
    out = capsys.readouterr().out  # a GPU's block unless one is given: FlexAttention's 64 (issue 53)
    assert "KV cache              7.50 GiB  1536 blocks of 64: 12.0 x max_model_len" in out
