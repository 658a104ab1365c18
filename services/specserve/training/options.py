"""The ``train-draft`` flags and training settings: no torch here, so building the CLI's
parser stays fast (``specserve --help`` must not load the engine)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from specserve.errors import ConfigError
from specserve.methods import DRAFT_KINDS

MAX_K = 8  # the evaluation measures acceptance for K = 1..MAX_K


@dataclass
class TrainConfig:
    epochs: int = 3
    batch_tokens: int = 4096
    max_len: int = 512
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 30
    feature_noise: float = 0.1   # eagle: Gaussian noise, times each feature dimension's std
    reg_weight: float = 1.0      # eagle: weight of the feature regression
    unroll: int = 2              # eagle: passes (2: the second reads the first's predictions)
    prompt_weight: float = 0.1   # loss weight of positions that predict prompt tokens (answers: 1)
    train_lm_head: bool = False  # False: keep the target's LM head rows frozen (as EAGLE does)
    checkpoint_every: int = 100
    seed: int = 0



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="embedded",
                   help="the target: 'embedded', a .gguf file, a HF directory or a hub id")
    p.add_argument("--out", required=True,
                   help="directory the draft is written to (embedded-eagle: the shipped default's)")
    p.add_argument("--work-dir", help="data and checkpoints (default: <out>/work)")
    p.add_argument("--kind", default="eagle", choices=(*DRAFT_KINDS, "eagle3"),
                   help="eagle: a head on the target's features (serve with method eagle); "
                        "eagle3: an EAGLE-3 head on three of its layers, saved in the speculators "
                        "format vLLM reads (method eagle); decoder: a small separate decoder "
                        "(method draft_model)")
    p.add_argument("--target-layers",
                   help="eagle3: the target layers the head reads, comma-separated (the residual "
                        "stream entering each; default 2, L/2, L-3 of its L layers)")
    p.add_argument("--prompts", default="chat,code,summarize",
                   help="comma-separated shipped sets (chat, code, summarize), JSONL/TXT files and/or "
                        "self:N (N user prompts the target writes itself, from its chat template)")
    p.add_argument("--num-prompts", type=int,
                   help="use this many of the sets' and files' prompts (seeded shuffle; default all)")
    p.add_argument("--eval-prompts", default="eval-chat",
                   help="held-out prompts (default: the shipped eval-chat set, hand-written)")
    p.add_argument("--eval-num-prompts", type=int, help="use this many held-out prompts")
    p.add_argument("--max-new-tokens", type=int, default=192, help="answer length cap, training data")
    p.add_argument("--eval-max-tokens", type=int, default=128, help="answer length cap, evaluation")
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--gen-batch-size", type=int, default=64, help="sequences generated together")
    p.add_argument("--num-layers", type=int, default=1, help="draft decoder layers")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="draft LM head size: the most frequent answer tokens (0: the whole vocabulary)")
    p.add_argument("--epochs", type=int, default=TrainConfig.epochs)
    p.add_argument("--batch-tokens", type=int, default=TrainConfig.batch_tokens)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--unroll", type=int, default=TrainConfig.unroll, choices=[1, 2, 3],
                   help="eagle: training passes over predicted features")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-k", type=int, help="K of the end-to-end run (default: best predicted)")
    p.add_argument("--skip-end-to-end", action="store_true", help="skip the timed engine runs")
    p.add_argument("--retrain", action="store_true", help="train again even if --out has a draft")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def check(args) -> None:
    for name in ("num_prompts", "eval_num_prompts", "max_new_tokens", "eval_max_tokens",
                 "gen_batch_size", "num_layers", "epochs", "batch_tokens", "max_prompt_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if args.draft_vocab < 0 or args.lr <= 0:
        raise ConfigError("--draft-vocab must be >= 0 and --lr > 0")
    if args.eval_k is not None and not 1 <= args.eval_k <= MAX_K:
        raise ConfigError(f"--eval-k must be in [1, {MAX_K}]")
    if args.max_prompt_tokens + args.max_new_tokens > args.max_model_len:
        raise ConfigError("--max-prompt-tokens + --max-new-tokens exceed --max-model-len")
    if args.target_layers is not None:
        if args.kind != "eagle3":
            raise ConfigError("--target-layers is for --kind eagle3")
        parts = [part.strip() for part in args.target_layers.split(",")]
        if not parts or not all(part.isdigit() for part in parts):
            raise ConfigError(f"--target-layers {args.target_layers!r}: comma-separated layer numbers")
