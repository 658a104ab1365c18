"""What structured outputs cost per step, against the step itself, on the embedded model.

The grammar layer (``engine/grammar.py``, llguidance) over SmolLM2-135M's tokenizer, the
schema below, and a document that follows it, tokenized (what a model would generate). In
one run, the operations interleaved round by round (the order rotating, so machine drift hits
them alike), medians:

- **fill**: the mask at the current state (``Matcher.fill_mask``), per token of the document;
- **advance**: moving past one token (``Matcher.advance``: validate, then consume);
- **walk K**: a verify's masks over K drafts (``Matcher.walk``: K + 1 fills, K advances, the
  rollback), at every position of the document;
- **apply_mask** on ``[K + 1, V]`` float32 logits with a verify's masks, and the plain way
  to do the same (unpack the bits to booleans, ``masked_fill_``: what ``apply_mask``'s bit
  arithmetic replaces), on those masks and on random ones (``masked_fill_`` branches per
  element, so its time depends on the mask; ``apply_mask``'s does not);
- the baselines: the sampler's ``softmax`` of ``[K + 1, V]``, and one forward of the target
  over K + 1 tokens at batch 1 after a chat prompt (a verify step's forward).

Compile times (the schema, and ``json_object``; a fresh ``description`` each time defeats the
compiler's cache) and the compiler's one-off setup (its first compile reads the vocabulary)
are printed above the table.

**End to end** (``--engine``, on by default): the engine generating greedily for 16 chat
prompts at once, target-only, with a JSON schema (the person schema of
``tests/engine/test_structured_embedded.py``), against the same prompts free, each run to
exactly the number of tokens its constrained run emitted (``ignore_eos``): the same tokens
per row, so the difference per token is what the grammar costs a step (its masks, the cut,
the matchers' advances). Rounds alternate the two.

    python load/bench_grammar.py           # --help

Prints the table with the CPU flags and writes ``results/bench-grammar.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from specserve.config import EngineConfig
from specserve.engine.grammar import GrammarCompiler, GrammarSpec, apply_mask
from specserve.engine.loader import load_model
from specserve.engine.runtime.forward_batch import ForwardBatch
from specserve.engine.tokenizer import encode_chat
from specserve.engine.worker import ModelWorker
from specserve.machine import cpu_flags, machine_label

sys.path.insert(0, str(Path(__file__).resolve().parent))  # load/ is not a package
from common import rotated  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "additionalProperties": False, "required": ["street", "city"],
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
DOC = {"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "engines"],
       "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
       "active": True, "score": 9.5}
PROMPT = "Describe Ada Lovelace as a JSON object."


def compile_ms(compiler: GrammarCompiler, schema: dict, repeats: int) -> float:
    """Median milliseconds of compiling ``schema`` anew (a fresh description each time)."""
    times = []
    for i in range(repeats):
        spec = GrammarSpec.json_schema({**schema, "description": f"run {time.time_ns()} {i}"})
        t0 = time.perf_counter()
        compiler.compile(spec)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def per_token(compiled, doc: list[int], k: int) -> dict[str, list[float]]:
    """Seconds of fill, advance and walk(K) at every position of one pass over ``doc``."""
    matcher = compiled.matcher()
    bitmask = torch.zeros(1, (compiled.vocab_size + 31) // 32, dtype=torch.int32)
    out: dict[str, list[float]] = {"fill": [], "advance": [], f"walk K={k}": []}
    for i, token in enumerate(doc):
        t0 = time.perf_counter()
        matcher.fill_mask(bitmask, 0)
        t1 = time.perf_counter()
        matcher.walk(doc[i:i + k])
        t2 = time.perf_counter()
        matcher.advance(token)
        t3 = time.perf_counter()
        out["fill"].append(t1 - t0)
        out["advance"].append(t3 - t2)
        if i + k <= len(doc):  # a full K drafts
            out[f"walk K={k}"].append(t2 - t1)
    return out


def masked_fill_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """``apply_mask`` the plain way: unpack the bits to booleans, then ``masked_fill_``."""
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    disallowed = (((bitmask[:, :, None] >> shifts) & 1) == 0).flatten(1)[:, :logits.shape[1]]
    logits.masked_fill_(disallowed, float("-inf"))


def repeat(fn, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", type=int, default=4, help="drafts per verify")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=50, help="per round, of the tensor operations")
    ap.add_argument("--out", type=Path, default=Path("results/bench-grammar.json"))
    ap.add_argument("--no-engine", dest="engine", action="store_false",
                    help="skip the end-to-end comparison (docstring)")
    args = ap.parse_args(argv)

    cfg = EngineConfig.model_validate({"speculative": {"method": None}, "max_num_seqs": 1,
                                       "max_model_len": 512})
    target = load_model(cfg.target, max_model_len=cfg.max_model_len)
    worker = ModelWorker(target.runtime, num_slots=1, max_seq_len=cfg.max_model_len)
    vocab = worker.vocab_size
    t0 = time.perf_counter()
    compiler = GrammarCompiler(target.tokenizer, vocab, target.eos_token_ids)
    compiler.compile(GrammarSpec("regex", "a"))  # the first compile reads the vocabulary
    setup_s = time.perf_counter() - t0
    compiles = {"schema": compile_ms(compiler, SCHEMA, 20),
                "json_object": compile_ms(compiler, {"type": "object"}, 20)}

    compiled = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    doc = target.tokenizer.encode(json.dumps(DOC), add_special_tokens=False)
    masks, num_allowed = compiled.matcher().walk(doc[:args.k])
    assert num_allowed == args.k, "the document does not follow the schema"
    logits = torch.randn(args.k + 1, vocab)                        # [K + 1, V]
    noise = torch.randint(-2**31, 2**31 - 1, masks.shape, dtype=torch.int32)  # [K + 1, W]

    slot = worker.allocate()
    prompt = encode_chat(target.tokenizer, [{"role": "user", "content": PROMPT}])
    worker.forward(ForwardBatch([slot], [prompt], [1]))
    verify_tokens = (doc * 2)[:args.k + 1]

    def forward() -> None:
        worker.forward(ForwardBatch([slot], [verify_tokens], [args.k + 1]))
        worker.rollback(slot, len(prompt))

    tensor_ops = {
        f"apply_mask [{args.k + 1}, V]": lambda: apply_mask(logits, masks),
        "  on random masks": lambda: apply_mask(logits, noise),
        "unpack + masked_fill_": lambda: masked_fill_apply(logits, masks),
        "  on random masks ": lambda: masked_fill_apply(logits, noise),
        f"softmax [{args.k + 1}, V]": lambda: torch.softmax(logits, dim=-1),
        f"forward {args.k + 1} tokens": forward,
    }
    samples: dict[str, list[float]] = {}
    names = ["grammar walk", *tensor_ops]
    for r in range(args.rounds):
        for name in rotated(names, r):
            if name == "grammar walk":
                for key, times in per_token(compiled, doc, args.k).items():
                    samples.setdefault(key, []).extend(times)
            else:
                samples.setdefault(name, []).extend(repeat(tensor_ops[name], args.repeats))
    worker.free(slot)

    medians = {name: statistics.median(times) for name, times in samples.items()}
    step = medians[f"forward {args.k + 1} tokens"]
    print(f"\nbench-grammar: {machine_label()}; torch threads {torch.get_num_threads()}; "
          f"{' '.join(cpu_flags())}; {datetime.date.today()}")
    print(f"embedded model (V = {vocab}), K = {args.k}, a {len(doc)}-token document, "
          f"{args.rounds} rounds; compiler setup {setup_s:.2f} s (once per server); compile "
          f"schema {compiles['schema']:.1f} ms, json_object {compiles['json_object']:.1f} ms")
    print(f"{'operation':<24}{'median us':>11}{'/ forward':>11}")
    for name, seconds in medians.items():
        print(f"{name:<24}{1e6 * seconds:>11.1f}{100 * seconds / step:>10.2f}%")
    overhead = medians[f"walk K={args.k}"] + medians[f"apply_mask [{args.k + 1}, V]"]
    print(f"grammar per verify step (walk K={args.k} + apply_mask): {1e6 * overhead:.0f} us, "
          f"{100 * overhead / step:.1f}% of the forward")
    end_to_end = engine_overhead(args.rounds) if args.engine else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": machine_label(), "cpu_flags": cpu_flags(), "date": str(datetime.date.today()),
        "torch_threads": torch.get_num_threads(), "vocab": vocab, "k": args.k,
        "doc_tokens": len(doc), "compiler_setup_s": setup_s, "compile_ms": compiles,
        "median_us": {name: 1e6 * s for name, s in medians.items()},
        "end_to_end": end_to_end}, indent=2) + "\n")
    return 0


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "city", "age"], "additionalProperties": False}
PEOPLE = [f"Describe a person named {n} who lives in {c} as JSON with keys name, city and age."
          for n, c in zip(["Kofi", "Lena", "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa"] * 2,
                          ["Accra", "Bern", "Cusco", "Dakar", "Essen", "Faro", "Graz", "Hue"] * 2)]


def engine_overhead(rounds: int) -> dict:
    """Per-token time of constrained vs free greedy decoding, the same tokens per row."""
    from specserve.config import SamplingParams
    from specserve.engine.builder import build_engine

    cfg = EngineConfig.model_validate({"speculative": {"method": None}, "max_num_seqs": 16,
                                       "max_model_len": 1024, "kv_cache": {"prefix_caching": False}})
    engine, loaded = build_engine(cfg)
    grammar = GrammarCompiler(loaded.tokenizer, engine.target.vocab_size,
                              loaded.eos_token_ids).compile(GrammarSpec.json_schema(PERSON))
    prompts = [encode_chat(loaded.tokenizer, [{"role": "user", "content": p}]) for p in PEOPLE]
    greedy = SamplingParams(temperature=0, max_tokens=96)
    lengths = [len(c.output_token_ids) for c in engine.generate(prompts, greedy, grammar=grammar)]
    free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    times: dict[str, list[float]] = {"constrained": [], "free": []}
    for r in range(rounds):
        for name in rotated(list(times), r):
            t0 = time.perf_counter()
            done = (engine.generate(prompts, greedy, grammar=grammar) if name == "constrained"
                    else engine.generate(prompts, free))
            times[name].append(time.perf_counter() - t0)
            assert [len(c.output_token_ids) for c in done] == lengths
    tokens = sum(lengths)
    per_token = {name: statistics.median(t) / tokens for name, t in times.items()}
    overhead = per_token["constrained"] / per_token["free"] - 1
    print(f"end to end: 16 rows, greedy, target-only, {tokens} tokens per run, {rounds} rounds: "
          f"free {1e3 * per_token['free']:.2f} ms/token, JSON schema "
          f"{1e3 * per_token['constrained']:.2f} ms/token: the grammar costs {100 * overhead:+.1f}%")
    return {"rows": len(prompts), "tokens": tokens, "ms_per_token": {
        name: 1e3 * s for name, s in per_token.items()}, "overhead": overhead}


if __name__ == "__main__":
    sys.exit(main())
