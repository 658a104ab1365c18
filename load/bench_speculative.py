"""Speculation length sweep in-process (like SGLang's ``bench_speculative``): K x method.

On the embedded default (SmolLM2-135M-Instruct), batch 1, greedy, EOS on, at most
``--max-tokens`` new tokens, over ``--num-prompts`` prompts of ``--prompts`` (default
``rewrite``, the input-repeating set; ``chat`` is the low-acceptance case), for every K in
``--k`` (default 1..8) and every method in ``--methods``:

- ``ngram``: prompt lookup;
- ``draft_model``: ``--draft PATH``, or, when none is given, a truncated self-draft (the
  target's first ``--draft-layers`` layers, see ``load/truncated_draft.py``; a weak baseline);

plus a target-only baseline (num_speculative_tokens 0). For each prompt and K the baseline and the methods
run back to back, their order rotated, so machine drift hits them alike; the baseline is
pooled over all its runs (the plot's horizontal line), and each setting's measured speedup is
against the baseline runs of the same K (paired).

Per setting: tokens/s (tokens / wall seconds, prefill included: what a client sees; the
plot and the choice of the best setting use it), the decode-only speedup (every step after
the prefill step), acceptance rate, mean acceptance length, tokens per decode step, and the
cost model's prediction (:func:`specserve.engine.step.cost_model.expected_speedup`) with
α = the measured acceptance rate, γ = K, c = (propose time per step / K) / T and
v = (verify time per step) / T, where T is the baseline's decode wall time per token and the
step times are ``engine.counters.times`` deltas over each run's decode steps, and s = the
share of those steps that drafted (n-gram drafts only where the context repeats; the others
emit one token each: ``cost_model``'s ``share``). The prediction sits next
to the measured decode speedup; the gap is what the model leaves out: the accept phase
(rejection sampler, detokenizer, stop checks), the Python step loop, drafts shorter than K
(an n-gram match that ends early, the end of ``max_tokens``), and acceptance that is not
i.i.d. The best setting is the one with the highest tokens/s (not the longest acceptance).

    make bench-spec                    # or: python load/bench_speculative.py --help

Writes ``results/bench_speculative.csv`` and ``results/bench_speculative.png``; prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `load` as a namespace package, run as a script or imported

from load.common import cpu_seconds, format_table, rotated, write_csv  # noqa: E402

BASELINE = "target-only"
METHODS = ("ngram", "draft_model")
RESULTS = ROOT / "results"
WARMUP_TOKENS = 8
NOISY = 0.05  # warn when other processes took more than this share of the CPU
CSV_COLUMNS = (
    "method", "k", "runs", "tokens", "seconds", "tokens_per_s", "baseline_tokens_per_s",
    "speedup", "decode_tokens_per_s", "decode_speedup", "predicted_speedup", "acceptance_rate",
    "mean_acceptance_length", "tokens_per_step", "predicted_tokens_per_step", "c", "v",
    "draft_share", "propose_ms_per_step", "verify_ms_per_step", "accept_ms_per_step", "other_load", "best",
)


# -- tallies (pure) -------------------------------------------------------------------------------
@dataclass
class Tally:
    """One setting (method, K) summed over its runs. ``tokens`` / ``seconds``: whole requests
    (prefill included). ``decode_*``, ``steps`` and the phase times: the steps after the first
    one (the prefill step), which is what the cost model describes."""

    runs: int = 0
    tokens: int = 0
    seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    steps: int = 0
    propose_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    other_cpu_s: float = 0.0

    def add(self, other: Tally) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def tokens_per_s(self) -> float:
        return _div(self.tokens, self.seconds)

    @property
    def decode_tokens_per_s(self) -> float:
        return _div(self.decode_tokens, self.decode_seconds)

    @property
    def acceptance_rate(self) -> float:
        return _div(self.accepted_tokens, self.draft_tokens)

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + _div(self.accepted_tokens, self.drafts)

    @property
    def other_load(self) -> float:
        return _div(self.other_cpu_s, self.seconds * (os.cpu_count() or 1))

    def per_step_ms(self, seconds: float) -> float:
        return 1e3 * _div(seconds, self.steps)


def _div(num: float, den: float) -> float:
    return num / den if den else math.nan


def pooled(tallies: list[Tally]) -> Tally:
    total = Tally()
    for t in tallies:
        total.add(t)
    return total


def cost_terms(setting: Tally, baseline: Tally, k: int) -> tuple[float, float]:
    """(c, v) of the cost model: per decode step, propose time / K and verify time, each over
    T = the baseline's decode seconds per token."""
    per_token = _div(baseline.decode_seconds, baseline.decode_tokens)
    c = _div(_div(setting.propose_s, setting.steps) / k, per_token)
    v = _div(_div(setting.verify_s, setting.steps), per_token)
    return c, v


def setting_row(method: str, k: int, tally: Tally, paired: Tally, baseline: Tally) -> dict:
    """One table row: measured numbers, and the cost model's prediction from them."""
    from specserve.engine.step.cost_model import expected_speedup, expected_tokens_per_step

    c, v = cost_terms(tally, baseline, k)
    alpha = 0.0 if math.isnan(tally.acceptance_rate) else tally.acceptance_rate
    share = min(_div(tally.drafts, tally.steps), 1.0) if tally.drafts else 0.0  # steps that drafted
    # c: propose time per step (drafting or not) / K, so a drafting step's is c / share
    predicted = (expected_speedup(alpha, k, c / share if share else 0.0, v, share)
                 if v > 0 else math.nan)  # NaN if v is
    return {
        "method": method, "k": k, "runs": tally.runs, "tokens": tally.tokens,
        "seconds": tally.seconds, "tokens_per_s": tally.tokens_per_s,
        "baseline_tokens_per_s": baseline.tokens_per_s,
        "speedup": _div(tally.tokens_per_s, paired.tokens_per_s),
        "decode_tokens_per_s": tally.decode_tokens_per_s,
        "decode_speedup": _div(tally.decode_tokens_per_s, paired.decode_tokens_per_s),
        "predicted_speedup": predicted,
        "acceptance_rate": tally.acceptance_rate,
        "mean_acceptance_length": tally.mean_acceptance_length,
        "tokens_per_step": _div(tally.decode_tokens, tally.steps),
        "predicted_tokens_per_step": expected_tokens_per_step(alpha, k, share), "c": c, "v": v,
        "draft_share": share,
        "propose_ms_per_step": tally.per_step_ms(tally.propose_s),
        "verify_ms_per_step": tally.per_step_ms(tally.verify_s),
        "accept_ms_per_step": tally.per_step_ms(tally.accept_s),
        "other_load": tally.other_load, "best": False,
    }


def baseline_row(baseline: Tally) -> dict:
    row = dict.fromkeys(CSV_COLUMNS, math.nan)
    row.update(method=BASELINE, k=0, runs=baseline.runs, tokens=baseline.tokens,
               seconds=baseline.seconds, tokens_per_s=baseline.tokens_per_s,
               baseline_tokens_per_s=baseline.tokens_per_s, speedup=1.0,
               decode_tokens_per_s=baseline.decode_tokens_per_s, decode_speedup=1.0,
               tokens_per_step=_div(baseline.decode_tokens, baseline.steps),
               propose_ms_per_step=baseline.per_step_ms(baseline.propose_s),
               verify_ms_per_step=baseline.per_step_ms(baseline.verify_s),
               accept_ms_per_step=baseline.per_step_ms(baseline.accept_s),
               other_load=baseline.other_load, best=False)
    return row


def to_rows(tallies: dict[tuple[str, int], Tally]) -> list[dict]:
    """Rows for every measured setting plus the pooled baseline; the fastest setting marked."""
    base_by_k = {k: t for (m, k), t in tallies.items() if m == BASELINE and t.runs}
    baseline = pooled(list(base_by_k.values()))
    rows = [baseline_row(baseline)]
    for (method, k), tally in tallies.items():
        if method != BASELINE and tally.runs:
            rows.append(setting_row(method, k, tally, base_by_k.get(k, baseline), baseline))
    mark_best(rows)
    return rows


def mark_best(rows: list[dict]) -> None:
    settings = [r for r in rows if r["method"] != BASELINE]
    if settings:
        max(settings, key=lambda r: r["tokens_per_s"])["best"] = True


# -- output ---------------------------------------------------------------------------------------
TABLE = (("method", "method", 12, 0), ("K", "k", 2, 0), ("tok/s", "tokens_per_s", 7, 1),
         ("speedup", "speedup", 7, 2), ("decode x", "decode_speedup", 8, 2),
         ("predicted", "predicted_speedup", 9, 2),
         ("accept", "acceptance_rate", 6, 2), ("mean len", "mean_acceptance_length", 8, 2),
         ("tok/step", "tokens_per_step", 8, 2), ("pred", "predicted_tokens_per_step", 5, 2),
         ("c", "c", 5, 3), ("v", "v", 5, 2), ("accept ms", "accept_ms_per_step", 9, 2),
         ("others", "other_load", 6, 2), ("best", "best", 4, 0))


def make_figure(rows: list[dict], title: str):
    """Left: tokens/s vs K per method, the target-only baseline as a horizontal line, the best
    setting starred. Right: mean acceptance length vs K (with the K + 1 ceiling)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 5), layout="constrained")
    speed, length = fig.subplots(1, 2)
    settings = [r for r in rows if r["method"] != BASELINE]
    ks = sorted({r["k"] for r in settings})
    for method in dict.fromkeys(r["method"] for r in settings):
        pts = sorted((r["k"], r) for r in settings if r["method"] == method)
        xs = [k for k, _ in pts]
        speed.plot(xs, [r["tokens_per_s"] for _, r in pts], marker="o", label=method)
        length.plot(xs, [r["mean_acceptance_length"] for _, r in pts], marker="o", label=method)
    for r in rows:
        if r["method"] == BASELINE:
            speed.axhline(r["tokens_per_s"], color="gray", linestyle="--",
                          label=f"{BASELINE} ({r['tokens_per_s']:.1f} tok/s)")
        elif r["best"]:
            speed.plot([r["k"]], [r["tokens_per_s"]], marker="*", markersize=16, color="gold",
                       markeredgecolor="black", linestyle="none",
                       label=f"best: {r['method']} K={r['k']}")
    length.plot(ks, [k + 1 for k in ks], color="gray", linestyle=":", label="ceiling (K + 1)")
    for ax, label in ((speed, "output throughput (tokens/s, prefill included)"),
                      (length, "mean acceptance length (tokens per step)")):
        ax.set_xticks(ks)
        ax.set_xlabel("K (draft tokens per step)")
        ax.set_ylabel(label)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.08)  # room for the star
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    return fig


def save_plot(rows: list[dict], title: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    make_figure(rows, title).savefig(path, dpi=120)


# -- measuring ------------------------------------------------------------------------------------



def _phases(engine) -> tuple[int, float, float, float]:
    t = engine.counters.times
    return t.steps, t.propose_s, t.verify_s, t.accept_s


def _run_steps(engine, seq_id: int, max_steps: int):
    """Step the engine until ``seq_id`` finishes; yields (its outputs of that step, time)."""
    for _ in range(max_steps):
        outs = [o for o in engine.step() if o.seq_id == seq_id]
        yield outs, time.perf_counter()
        if outs and outs[-1].finish_reason is not None:
            return
    raise RuntimeError(f"the request did not finish within {max_steps} steps")


def measure(engine, prompt: list[int], max_tokens: int, num_speculative_tokens: int) -> Tally:
    """One greedy request on an otherwise idle engine: wall time, the decode part (every step
    after the prefill step) with its ``engine.counters.times`` deltas, and the request's stats."""
    from specserve.config import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    busy, mine = cpu_seconds()
    start = time.perf_counter()
    seq_id = engine.add_request(prompt, params, num_speculative_tokens=num_speculative_tokens)
    tokens, first, last = 0, None, None
    for outs, now in _run_steps(engine, seq_id, max_tokens + 2):  # a step emits >= 1 token
        tokens += sum(len(o.new_token_ids) for o in outs)
        last = outs[-1] if outs else last
        if first is None:
            first = (now, tokens, _phases(engine))
    end = time.perf_counter()
    busy_after, mine_after = cpu_seconds()
    after = _phases(engine)
    steps, propose, verify, accept = (a - b for a, b in zip(after, first[2]))
    return Tally(runs=1, tokens=tokens, seconds=end - start, decode_tokens=tokens - first[1],
                 decode_seconds=end - first[0], steps=steps, propose_s=propose, verify_s=verify,
                 accept_s=accept, drafts=last.stats.num_drafts,
                 draft_tokens=last.stats.num_draft_tokens,
                 accepted_tokens=last.stats.num_accepted_tokens,
                 other_cpu_s=max(0.0, (busy_after - busy) - (mine_after - mine)))


def schedule(num_prompts: int, ks: list[int], methods: list[str]) -> list[tuple[int, int, str]]:
    """(prompt index, K, method or target-only) in run order: per prompt and K, the baseline
    and every method back to back, rotated so none always runs first."""
    order, i = [], 0
    for p in range(num_prompts):
        for k in ks:
            order += [(p, k, m) for m in rotated([BASELINE, *methods], i)]
            i += 1
    return order


def run_schedule(engines: dict, prompts: list[list[int]], args, bar) -> dict[tuple[str, int], Tally]:
    """Run every scheduled setting once; stops early (with a warning) at ``--max-seconds``."""
    tallies: dict[tuple[str, int], Tally] = {}
    deadline = time.monotonic() + args.max_seconds
    for p, k, method in schedule(len(prompts), args.k, args.methods):
        if time.monotonic() > deadline:
            print(f"WARNING: --max-seconds {args.max_seconds} reached; the rest is skipped",
                  file=sys.stderr)
            break
        bar.set_description(f"prompt {p} K={k} {method}")
        engine = engines[args.methods[0] if method == BASELINE else method]
        num_speculative_tokens = 0 if method == BASELINE else k
        tallies.setdefault((method, k), Tally()).add(measure(engine, prompts[p], args.max_tokens,
                                                             num_speculative_tokens))
        bar.update()
    return tallies


# -- engines --------------------------------------------------------------------------------------
def engine_config(method: str, args, draft_path: Path | None):
    from specserve.config import EngineConfig, ModelConfig, SpeculativeConfig

    model = lambda source: ModelConfig(source=source, dtype=args.dtype, device="cpu")  # noqa: E731
    spec = SpeculativeConfig(method=method, num_speculative_tokens=max(args.k),
                             draft=model(str(draft_path)) if method == "draft_model" else None)
    return EngineConfig(target=model(args.target), speculative=spec,
                        max_model_len=args.max_model_len, max_num_seqs=1,
                        kv_cache={"prefix_caching": False})  # every method runs the same prompts


def draft_path(args) -> Path | None:
    """``--draft``, or the truncated self-draft (built once); None without draft_model."""
    if "draft_model" not in args.methods:
        return None
    if args.draft:
        return Path(args.draft)
    from load.truncated_draft import truncated_draft

    return truncated_draft(args.target, args.draft_layers)


def build_engines(args, draft: Path | None) -> tuple[dict, object]:
    """One engine per method (the first one also runs the baseline) and the loaded target."""
    from specserve.engine.builder import build_engine

    engines, target = {}, None
    for method in args.methods:
        engines[method], target = build_engine(engine_config(method, args, draft))
    return engines, target


def encode(tokenizer, name: str, n: int) -> list[list[int]]:
    from specserve.engine.tokenizer import encode_chat

    from load.prompts import load_prompts

    return [encode_chat(tokenizer, p["messages"]) for p in load_prompts(name)[:n]]


def warm_up(engines: dict, prompt: list[int], ks: list[int]) -> None:
    for engine in engines.values():
        for num_speculative_tokens in (0, max(ks)):
            measure(engine, prompt, WARMUP_TOKENS, num_speculative_tokens)


# -- main -----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", default="1,2,3,4,5,6,7,8", help="comma-separated K values (1..16)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma list: ngram, draft_model")
    p.add_argument("--draft", default=None, help="draft model for draft_model (default: a "
                   "truncated self-draft of the target)")
    p.add_argument("--draft-layers", type=int, default=6, help="layers of the truncated self-draft")
    p.add_argument("--target", default="embedded", help="target model source")
    p.add_argument("--prompts", default="rewrite", help="prompt set: rewrite, chat, code, summarize")
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="torch threads")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-seconds", type=float, default=3600.0,
                   help="stop starting new runs after this many seconds")
    p.add_argument("--csv", type=Path, default=RESULTS / "bench_speculative.csv")
    p.add_argument("--png", type=Path, default=RESULTS / "bench_speculative.png")
    args = p.parse_args(argv)
    args.k = sorted({int(k) for k in args.k.split(",") if k.strip()})
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not args.k or min(args.k) < 1 or max(args.k) > 16:
        p.error("--k: values in [1, 16]")
    if not args.methods or any(m not in METHODS for m in args.methods):
        p.error(f"--methods: a comma list of {', '.join(METHODS)}")
    if args.num_prompts < 1 or args.max_tokens < 1 or args.draft_layers < 1:
        p.error("--num-prompts, --max-tokens and --draft-layers must be >= 1")
    return args


def title_of(args, model: str) -> str:
    from specserve.machine import machine_label

    parts = [f"prompts: {args.num_prompts} x {args.prompts}", f"max_tokens={args.max_tokens}"]
    if "draft_model" in args.methods:
        parts.append(f"draft = {Path(args.draft).name}" if args.draft
                     else f"draft = first {args.draft_layers} layers of the target")
    parts.append(str(datetime.date.today()))
    return (f"Speculative decoding: {model}, {args.dtype}, batch 1, greedy, on {machine_label()}\n"
            + ", ".join(parts))


def report(args, model: str, draft: Path | None, rows: list[dict]) -> None:
    """Print the table (and a warning if the machine was busy); write the CSV and the plot."""
    print(f"\n{title_of(args, model)}")
    if draft:
        print(f"draft: {draft}")
    print(format_table(rows, TABLE))
    print("\nspeedup: tok/s (prefill included) vs the target-only runs of the same K; decode x: the "
          "same over decode steps only; predicted: the cost model for decode (α = accept, γ = K, "
          "c and v over the target-only decode time per token).\ntok/step: measured decode "
          "tokens per step vs predicted (i.i.d. acceptance). accept ms: per-step time the model "
          "leaves out. others: CPU share other processes took.")
    title = title_of(args, model)
    worst = max(r["other_load"] for r in rows)
    if worst > NOISY:
        print(f"WARNING: other processes took up to {worst:.0%} of the CPU; the numbers are noisy.")
        title += f"\n[NOISY: other processes took up to {worst:.0%} of the CPU]"
    write_csv(rows, args.csv, CSV_COLUMNS, as_int=("best",))
    save_plot(rows, title, args.png)
    print(f"wrote {args.csv} and {args.png}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import transformers
    from tqdm import tqdm

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    draft = draft_path(args)
    engines, target = build_engines(args, draft)
    prompts = encode(target.tokenizer, args.prompts, args.num_prompts)
    args.num_prompts = len(prompts)  # the set may hold fewer
    warm_up(engines, prompts[0], args.k)
    total = len(schedule(len(prompts), args.k, args.methods))
    with tqdm(total=total, unit="run", file=sys.stderr) as bar:
        tallies = run_schedule(engines, prompts, args, bar)
    del engines
    gc.collect()
    report(args, target.name, draft, to_rows(tallies))
    return 0


if __name__ == "__main__":
    sys.exit(main())
