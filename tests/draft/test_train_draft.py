"""``specserve train-draft`` end to end on a tiny random target: data, training, saving,
loading, evaluation; resumable training; bad input. (The real default draft and its figures:
``make draft``, ``docs/BENCHMARKS.md``.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from specserve.cli import main
from specserve.config import ModelConfig
from specserve.draft.data import PROMPTS_DIR, SHIPPED, Sample, greedy_with_features, read_prompts
from specserve.draft.evaluate import acceptance_table, matched_lengths
from specserve.draft.train import TrainConfig, Trainer
from specserve.engine.draft_head import new_draft_head
from specserve.engine.loader import load_model
from specserve.engine.proposers.eagle import EagleProposer
from specserve.engine.worker import ModelWorker

from tests.models import tiny_hf_model
from tests.serve.conftest import save_tiny
from tests.tiny import CORPUS

ROOT = Path(__file__).resolve().parents[2]
WORDS = " ".join(CORPUS).split()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target directory, 120 training prompts and 12 held-out ones (JSONL files)."""
    base = tmp_path_factory.mktemp("train-draft")
    target = save_tiny(base / "target", tiny_hf_model("llama-gqa", seed=0, logit_scale=3.0))
    train, held = base / "train.jsonl", base / "held.jsonl"
    train.write_text("".join(json.dumps({"prompt": " ".join(WORDS[i:i + 3 + i % 5])}) + "\n"
                             for i in range(120)))
    held.write_text("".join(json.dumps({"messages": [{"role": "user", "content": " ".join(WORDS[i:i + 4])}]})
                            + "\n" for i in range(200, 212)))
    return target, train, held, base


def _args(target, train, held, out, *extra) -> list[str]:
    return ["train-draft", "--target", target, "--out", str(out), "--prompts", str(train),
            "--eval-prompts", str(held), "--max-new-tokens", "32", "--eval-max-tokens", "32",
            "--max-model-len", "256", "--max-prompt-tokens", "64", "--draft-vocab", "384",
            "--epochs", "20", "--lr", "3e-3", "--batch-tokens", "1024", "--no-progress", "--json",
            *extra]


def _samples(folder: Path) -> list[Sample]:
    return [Sample(**s) for f in sorted(folder.glob("shard-*.pt")) for s in torch.load(f)]


def test_pipeline_trains_a_draft_that_beats_an_untrained_one(tiny, capsys):
    target, train, held, base = tiny
    out = base / "draft"
    assert main(_args(target, train, held, out)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads((out / "eval.json").read_text())
    assert {"draft.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert (out / "work" / "checkpoints" / "last.pt").is_file()
    assert report["data"]["sequences"] == 120 and report["data"]["held_out_sequences"] == 12
    assert report["kind"] == "eagle" and set(report["greedy_acceptance"]) == {str(k) for k in range(1, 9)}
    e2e = report["end_to_end"]
    assert e2e["outputs_identical"] and e2e["prompts"] == 12 and e2e["output_tokens"] > 0

    # The same evaluation for a draft that was never trained (same initialisation).
    loaded = load_model(ModelConfig(source=target), max_model_len=256)
    vocab = load_file(str(out / "model.safetensors"))["draft_vocab"]  # the trained one's
    untrained = new_draft_head(loaded.runtime, kind="eagle", num_layers=1,
                               draft_vocab=vocab).requires_grad_(False)
    held_samples = _samples(out / "work" / "eval-data")
    table = acceptance_table(matched_lengths(
        EagleProposer(ModelWorker(untrained, num_slots=1, max_seq_len=256)), held_samples, progress=False))
    trained_rate = report["greedy_acceptance"]["1"]["acceptance_rate"]
    assert trained_rate > 2 * table[1]["acceptance_rate"] + 0.02, (trained_rate, table[1])

    # A rerun resumes: the data and the trained draft are reused, not made again.
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert main(_args(target, train, held, out, "--skip-end-to-end")) == 0
    again = json.loads(capsys.readouterr().out)
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    assert again["training"] == report["training"] and "end_to_end" not in again


def test_interrupted_training_resumes_to_the_same_weights(tiny, tmp_path):
    """Stopped after step 7 (checkpoint at step 5), a fresh trainer resumes from the checkpoint
    and ends on exactly the weights of an uninterrupted run."""
    target = tiny[0]
    loaded = load_model(ModelConfig(source=target), max_model_len=256)
    worker = ModelWorker(loaded.runtime, num_slots=40, max_seq_len=256)
    prompts = [loaded.tokenizer(" ".join(WORDS[i:i + 5]))["input_ids"] for i in range(40)]
    samples = greedy_with_features(worker, prompts, max_new_tokens=24, eos_token_ids=frozenset({2}))
    vocab = torch.arange(512)
    cfg = TrainConfig(epochs=2, batch_tokens=160, checkpoint_every=5, warmup_steps=2)

    def trainer(work: Path) -> Trainer:
        head = new_draft_head(loaded.runtime, kind="eagle", num_layers=1, draft_vocab=vocab)
        return Trainer(head, loaded.runtime.lm_head.weight, cfg, work)

    whole = trainer(tmp_path / "whole")
    whole.fit(samples, progress=False)

    interrupted = trainer(tmp_path / "cut")
    real_step = interrupted._train_step

    def stop_after_7(batch, total):
        if interrupted.step == 7:
            raise KeyboardInterrupt
        return real_step(batch, total)

    interrupted._train_step = stop_after_7
    with pytest.raises(KeyboardInterrupt):
        interrupted.fit(samples, progress=False)
    resumed = trainer(tmp_path / "cut")
    resumed.fit(samples, progress=False)
    assert resumed.step == whole.step > 7
    for (name, a), b in zip(whole.head.state_dict().items(), resumed.head.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_shipped_prompt_sets_exclude_the_held_out_ones():
    held = {json.dumps(m) for m in read_prompts("eval-chat")}
    for name in SHIPPED:
        train = read_prompts(name)
        assert len(train) >= 200 and not held & {json.dumps(m) for m in train}, name
    bench = {json.dumps(json.loads(line)["messages"])
             for line in (ROOT / "load" / "prompts" / "chat.jsonl").read_text().splitlines()}
    assert bench <= held  # the benchmark's chat prompts are held out too
    assert (PROMPTS_DIR / "eval-chat.jsonl").is_file()


@pytest.mark.parametrize("extra, message", [
    (["--eval-k", "9"], "--eval-k must be in [1, 8]"),
    (["--epochs", "0"], "--epochs must be at least 1"),
    (["--max-new-tokens", "250"], "exceed --max-model-len"),
])
def test_bad_flags_get_one_line(tiny, tmp_path, capsys, extra, message):
    target, train, held, _ = tiny
    assert main(_args(target, train, held, tmp_path / "d", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err
    assert not (tmp_path / "d").exists()  # refused before anything was written


def test_bad_prompt_files_get_one_line(tiny, tmp_path, capsys):
    target, train, held, _ = tiny
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "fine"}\n{"nothing": 1}\n')
    for prompts, message in ((str(tmp_path / "missing.jsonl"), "no such shipped set"),
                             (str(broken), "broken.jsonl:2: expected")):
        args = _args(target, train, held, tmp_path / "d")
        args[args.index("--prompts") + 1] = prompts
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err, err
