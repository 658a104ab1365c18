"""``specserve train-draft``: data, training, saving, evaluation, in one resumable run.

1. **Data**: the target answers the training prompts greedily (``data.py``); answers and the
   target's features are kept under ``<work>/data``. Held-out prompts get the same treatment
   under ``<work>/eval-data``; a held-out prompt that is also a training prompt is dropped.
2. **Draft vocabulary**: the ``draft_vocab`` tokens most frequent in the training answers.
3. **Training** (``train.py``), checkpointed under ``<work>/checkpoints``.
4. **Saving** into ``--out`` (``draft.json``, weights, tokenizer; ``--kind eagle3``: the
   ``speculators`` format's ``config.json`` and weights, and ``specserve.json`` with how it was
   made), then loading it back: the evaluation runs on what was saved.
5. **Evaluation** (``evaluate.py``): acceptance per K, costs, predicted and measured speedup,
   printed and written to ``<out>/eval.json``.

A rerun with the same settings reuses the data shards and resumes training from the last
checkpoint; a finished training is not repeated (``--retrain`` forces it).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import fields, replace
from pathlib import Path

import torch

from specserve.config import ModelConfig
from specserve.engine.drafts.draft_head import (
    DRAFT_FILE,
    draft_path,
    is_draft_dir,
    load_draft_head,
    load_draft_vocab,
    new_draft_head,
    read_draft_meta,
    save_draft,
)
from specserve.engine.drafts.draft_model import DraftModelProposer
from specserve.engine.drafts.eagle import EagleProposer
from specserve.engine.drafts.published_drafts import checked_layers, default_target_layers, save_speculators
from specserve.engine.loader import EMBEDDED, load_configs, load_model, local_folder, resolve
from specserve.engine.spec_decode import SpecDecodeEngine
from specserve.engine.worker import ModelWorker
from specserve.errors import ConfigError
from specserve.machine import machine_label
from specserve.training.data import (
    SHARD_SIZE,
    build_dataset,
    encode,
    generation_seconds,
    select_prompts,
    self_prompt_count,
)
from specserve.training.evaluate import (
    acceptance_table,
    end_to_end,
    matched_lengths,
    measure_costs,
    predicted_speedup,
)
from specserve.training.options import MAX_K, TrainConfig, check
from specserve.training.self_prompts import self_prompts
from specserve.training.train import Trainer

log = logging.getLogger(__name__)

MADE_FILE = "specserve.json"  # an eagle3 export: how it was made (the speculators config is vLLM's)
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the embedded default's hub id


def run(args) -> dict:
    check(args)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    if args.no_progress:  # transformers draws its own bar while loading weights
        hf_logging.disable_progress_bar()
    try:
        return _run(args, progress=not args.no_progress)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _run(args, *, progress: bool) -> dict:
    torch.manual_seed(args.seed)
    out = draft_path(args.out)
    work = Path(args.work_dir).expanduser() if args.work_dir else out / "work"
    started = time.perf_counter()
    num_self = self_prompt_count(args.prompts)
    train_msgs = select_prompts(args.prompts, num_prompts=args.num_prompts, seed=args.seed,
                                allow_empty=num_self > 0)
    eval_msgs = select_prompts(args.eval_prompts, num_prompts=None, seed=args.seed)
    target = load_model(ModelConfig(source=args.target, dtype="float32", device="cpu"),
                        max_model_len=args.max_model_len, blocks=False)  # a draft copies its layers
    tok, eos = target.tokenizer, target.eos_token_ids
    # eagle3's data: the layer states it reads, then the final hidden state (the soft labels)
    layers = _target_layers(args, target.runtime.arch.num_layers)
    data_suffix = "-eagle3" if layers else ""
    target.runtime.feature_layers = (*layers, target.runtime.arch.num_layers) if layers else None
    must_train = args.retrain or not is_draft_dir(out)
    gen = ModelWorker(target.runtime, num_slots=args.gen_batch_size, max_seq_len=args.max_model_len)
    own: list[list[dict]] = []
    if must_train and num_self:  # after the files' prompts, so their shards stay reusable
        held_texts = {m["content"] for msgs in eval_msgs for m in msgs if m["role"] == "user"}
        own, own_seconds = self_prompts(SpecDecodeEngine(gen, tok, eos_token_ids=eos), tok, num_self,
                                        work / "self-prompts.jsonl", seed=args.seed,
                                        exclude=held_texts, progress=progress)
        train_msgs += own

    # 1. data
    seen = {json.dumps(m, sort_keys=True) for m in train_msgs}
    held_out = [m for m in eval_msgs if json.dumps(m, sort_keys=True) not in seen]
    if len(held_out) < len(eval_msgs):
        log.warning("dropped %d held-out prompts that are also training prompts",
                    len(eval_msgs) - len(held_out))
    held_out = held_out[:args.eval_num_prompts] if args.eval_num_prompts else held_out
    if not held_out:
        raise ConfigError("no held-out prompts left (every one is also a training prompt)")
    train_ids = [encode(tok, m, args.max_prompt_tokens) for m in train_msgs]
    eval_ids = [encode(tok, m, args.max_prompt_tokens) for m in held_out]
    held = build_dataset(gen, tok, eval_ids, work / f"eval-data{data_suffix}",
                         max_new_tokens=args.eval_max_tokens,
                         eos_token_ids=eos, batch_size=args.gen_batch_size, desc="data (held-out)",
                         progress=progress)
    if must_train:
        t0 = time.perf_counter()
        train = build_dataset(gen, tok, train_ids, work / f"data{data_suffix}",
                              max_new_tokens=args.max_new_tokens,
                              eos_token_ids=eos, batch_size=args.gen_batch_size, desc="data (train)",
                              progress=progress)
        data_info = {"prompts": args.prompts, "sequences": len(train),
                     "tokens": sum(s.num_tokens for s in train),
                     "answer_tokens": sum(s.num_tokens - s.prompt_len for s in train),
                     "held_out_prompts": args.eval_prompts, "held_out_sequences": len(held),
                     "generation_seconds": round(generation_seconds(
                         work / f"data{data_suffix}", -(-len(train) // SHARD_SIZE)), 1),
                     "seconds": round(time.perf_counter() - t0, 1)}
        if num_self:
            data_info["self_prompts"] = {"asked": num_self, "kept": len(own), "seconds": own_seconds}
    del gen
    target.runtime.feature_layers = None

    # 2.-4. vocabulary, training, saving (a draft already in --out is kept: evaluated again)
    if must_train:
        vocab = draft_vocabulary(train, target.runtime.arch.vocab_size, args.draft_vocab, eos)
        head = new_draft_head(target.runtime, kind=args.kind, num_layers=args.num_layers,
                              draft_vocab=vocab, seed=args.seed, target_layers=layers or None)
        cfg = _train_config(args)
        trainer = Trainer(head, target.runtime.lm_head.weight[vocab], cfg, work)
        t0 = time.perf_counter()
        summary = trainer.fit(train, progress=progress)
        extra = {"training": {**summary, "seconds": round(time.perf_counter() - t0, 1)}, "data": data_info}
        if args.kind == "eagle3":
            _save_eagle3(head, out, args.target, target.name, extra)
        else:
            save_draft(head, out, target_name=target.name, tokenizer=tok, extra=extra)
    meta = {**read_draft_meta(out), **_made(out)}

    # 5. evaluation, on the saved draft
    report = evaluate(out, target, held, eval_k=args.eval_k, max_tokens=args.eval_max_tokens,
                      end_to_end_run=not args.skip_end_to_end, progress=progress)
    report = {"draft": str(args.out), "kind": meta["kind"], "target": target.name,
              "machine": f"{machine_label()}, torch {torch.__version__}", "date": time.strftime("%Y-%m-%d"),
              "data": meta["data"], "training": meta["training"],
              "held_out_vocab_coverage": _coverage(held, load_draft_vocab(out)), **report,
              "total_seconds": round(time.perf_counter() - started, 1)}
    (out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _target_layers(args, num_layers: int) -> tuple[int, ...]:
    """``--kind eagle3``'s target layers (``--target-layers``, else the published default);
    () for the other kinds."""
    if args.kind != "eagle3":
        return ()
    if args.target_layers is None:
        layers = default_target_layers(num_layers)
    else:
        layers = tuple(int(part) for part in args.target_layers.split(","))
    return checked_layers(layers, num_layers, "", "--target-layers")


def _save_eagle3(head, out: Path, source: str, name: str, extra: dict) -> None:
    """The head in the ``speculators`` format (what vLLM reads; we load it back as a published
    head), its verifier the target's hub id where it has one, and ``specserve.json``: how it
    was made (what ``draft.json`` holds for the other kinds)."""
    folder = local_folder(resolve(source))
    config = load_configs(folder)[0]
    verifier = EMBEDDED_HUB_ID if source == EMBEDDED else source
    save_speculators(head, out, layer_config=config.to_dict(), verifier=verifier,
                     verifier_architectures=config.architectures or ["LlamaForCausalLM"])
    (out / MADE_FILE).write_text(json.dumps({"kind": "eagle3", "target": {"name": name, "source": source},
                                             **extra}, indent=2) + "\n")


def _made(out: Path) -> dict:
    """How the draft in ``out`` was made: ``draft.json`` or, for an eagle3 export, ``specserve.json``."""
    for name in (DRAFT_FILE, MADE_FILE):
        if (out / name).is_file():
            return {k: v for k, v in json.loads((out / name).read_text()).items() if k != "kind"}
    return {}


def _train_config(args) -> TrainConfig:
    names = {f.name for f in fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in names and v is not None}
    return TrainConfig(**given)


def draft_vocabulary(samples, vocab_size: int, size: int, always: frozenset[int]) -> torch.Tensor:
    """The ``size`` token ids most frequent in the answers (EOS always in), sorted; all ids when
    ``size`` is 0 or covers the vocabulary."""
    if size == 0 or size >= vocab_size:
        return torch.arange(vocab_size)
    counts = Counter()
    for s in samples:
        counts.update(s.token_ids[s.prompt_len:])
    keep = set(always) | {t for t, _ in counts.most_common(size)}
    ranked = [t for t, _ in counts.most_common()] + list(range(vocab_size))
    for t in ranked:  # top up (rare tokens, then any) to exactly ``size``
        if len(keep) >= size:
            break
        keep.add(t)
    return torch.tensor(sorted(keep)[:max(size, len(always))])


def _coverage(samples, vocab: torch.Tensor) -> float:
    """Share of held-out answer tokens the draft vocabulary contains (a ceiling on acceptance)."""
    ids = set(vocab.tolist())
    answer = [t for s in samples for t in s.token_ids[s.prompt_len:]]
    return sum(t in ids for t in answer) / max(1, len(answer))


def evaluate(draft_dir: Path, target, held, *, eval_k: int | None, max_tokens: int,
             end_to_end_run: bool, progress: bool) -> dict:
    head = load_draft_head(draft_dir, target.runtime, max_model_len=target.runtime.max_positions)
    if head.kind == "eagle3":  # the target returns the layer states it reads, the data has them first
        target.runtime.feature_layers = head.target_layers
        held = [replace(s, features=s.features[:, :head.fc.in_features]) for s in held]
    make = lambda slots: (EagleProposer if head.uses_features else DraftModelProposer)(  # noqa: E731
        ModelWorker(head, num_slots=slots, max_seq_len=target.runtime.max_positions))
    table = acceptance_table(matched_lengths(make(1), held, progress=progress))
    context = max(held, key=lambda s: s.num_tokens).token_ids
    target_worker = ModelWorker(target.runtime, num_slots=1, max_seq_len=target.runtime.max_positions)
    costs = measure_costs(target_worker, make(MAX_K), context)
    predicted = predicted_speedup(table, costs)
    k = eval_k or max(predicted, key=predicted.get)
    report = {"greedy_acceptance": {str(k_): row for k_, row in table.items()},
              "costs_s": {"target_forward": {str(n): v for n, v in costs["target_forward_s"].items()},
                          "draft_token": costs["draft_token_s"]},
              "predicted_speedup": {str(k_): v for k_, v in predicted.items()}}
    if end_to_end_run:
        engine = lambda proposer: SpecDecodeEngine(  # noqa: E731
            ModelWorker(target.runtime, num_slots=1, max_seq_len=target.runtime.max_positions),
            target.tokenizer, eos_token_ids=target.eos_token_ids, proposer=proposer,
            num_speculative_tokens=k)
        prompts = [s.token_ids[:s.prompt_len] for s in held]
        runs = end_to_end({"target_only": (engine(None), None), "speculative": (engine(make(1)), k)},
                          prompts, max_tokens=max_tokens, progress=progress)
        spec = runs["speculative"]
        report["end_to_end"] = {**spec, "target_only_s": runs["target_only"]["seconds"],
                                "speculative_s": spec.pop("seconds")}
    return report


def summary_lines(report: dict) -> list[str]:
    """What the CLI prints."""
    lines = [f"draft {report['draft']} ({report['kind']}) for {report['target']}",
             f"data: {report['data']['sequences']} sequences, {report['data']['tokens']} tokens "
             f"({report['data']['answer_tokens']} answer tokens), generated in "
             f"{report['data'].get('generation_seconds')} s; "
             f"training: {report['training']['steps']} steps, {report['training']['seconds']} s",
             f"held-out vocabulary coverage {report['held_out_vocab_coverage']:.3f}",
             "K  acceptance  mean-acc-len  predicted-speedup"]
    for k, row in report["greedy_acceptance"].items():
        lines.append(f"{k:>1}  {row['acceptance_rate']:10.3f}  {row['mean_acceptance_length']:12.2f}  "
                     f"{report['predicted_speedup'][k]:17.2f}")
    e2e = report.get("end_to_end")
    if e2e:
        lines.append(f"end-to-end, batch 1, K={e2e['k']}: speedup {e2e['speedup']:.2f}x "
                     f"(target-only {e2e['target_only_s']:.1f} s, speculative {e2e['speculative_s']:.1f} s), "
                     f"acceptance {e2e['acceptance_rate']:.3f}, mean acceptance length "
                     f"{e2e['mean_acceptance_length']:.2f}, outputs identical: {e2e['outputs_identical']}")
    return lines
