"""Build ``load/prompts/revise.jsonl``: multi-turn chats whose last turn revises an earlier answer.

Each prompt is ``[user question, assistant answer, user revision request]``, where the answer is
the embedded model's (SmolLM2-135M-Instruct) own greedy reply to the question, so the reply to
the revision request realistically copies the model's own earlier text: the traffic where
suffix decoding / prompt lookup speculation should pay.

The questions and revision requests are in ``SEEDS`` below. The answers are generated greedily
(temperature 0) on the CPU in float32 with the batch-invariant kernels, so a rerun writes the
same file. An answer cut off by ``--max-tokens`` is trimmed back to its last complete line or
sentence (a chat user would not have seen a half sentence get revised), an answer stuck in a
loop is cut before a line or sentence comes for the third time, and a code block left open is
dropped (``clean_answer``).

    python load/make_revise_prompts.py            # writes load/prompts/revise.jsonl
    python load/make_revise_prompts.py --print    # also prints every answer
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "prompts" / "revise.jsonl"

# (category, first question, revision request). The requests were written after reading the
# model's answers (the answers are deterministic), so they refer to what the answers say.
# Questions that the greedy model answers with a pure loop ("Dear [Name]" twenty times) were
# replaced, and so were topics that the draft's training prompts cover many times
# (services/specserve/training/prompts: photosynthesis, the water cycle), so that a trained
# draft is not measured on its training data.
SEEDS: list[tuple[str, str, str]] = [
    # shorten
    ("shorten", "Explain what a hash table is and when to use one.",
     "That's too long. Make it shorter: three sentences at most, and keep your own wording where "
     "you can."),
    ("shorten", "What are the benefits of regular exercise?",
     "Shorten it to half the length. Keep the first two sentences exactly as they are."),
    ("shorten", "Explain the difference between a list and a tuple in Python.",
     "Make it shorter: keep your first sentence, then one sentence about lists and one about "
     "tuples."),
    ("shorten", "Explain what a REST API is.",
     "Too long. Keep the first paragraph and the list of key features, and drop the rest."),
    # rename
    ("rename", "Write a short story about a girl named Lily who finds a lost puppy in the park.",
     "Change the name Lily to Maya everywhere and return the whole story otherwise unchanged."),
    ("rename", "Write a Python function called calculate_average that returns the average of a "
               "list of numbers.",
     "Rename the function calculate_average to mean_of and return the whole answer again with "
     "the new name."),
    ("rename", "Write a birthday message for my friend Tom.",
     "Change Tom to Alex and send me the full message again."),
    ("rename", "Write a short cover letter for John Smith applying for a junior data analyst job at "
               "Acme Corp.",
     "You used the wrong name. Change Emily Johnson to John Smith and Acme Corp to Globex Inc., "
     "and keep everything else exactly the same."),
    # add a point
    ("add_point", "List the steps to make a cup of tea.",
     "Add a step about warming the cup first. Keep the other steps exactly as they are."),
    ("add_point", "Give me three tips for better sleep.",
     "Keep all three tips as they are and add a fourth one about screens before bed."),
    ("add_point", "What are some tips for saving money on groceries?",
     "Keep your tips and add one about using a shopping list. Return the full list."),
    # fix a step
    ("fix_step", "How do I change a flat tire? Give numbered steps.",
     "Step 1 is wrong: you have to loosen the lug nuts and jack the car up before the tire can "
     "come off. Fix it and return all the steps, keeping the others word for word."),
    ("fix_step", "Explain how to make a git commit, step by step.",
     "Step 2 is wrong: the command is git commit -m \"your message\" after git add. Fix the "
     "mistake in step 2 and repeat the other steps unchanged."),
    ("fix_step", "How do I plant a tomato seedling? Give numbered steps.",
     "Step 3 is wrong: a seedling is already a small plant, not a seed. Correct step 3 and give "
     "me the whole list again."),
    ("fix_step", "How do I reset my home Wi-Fi router? Give numbered steps.",
     "There is a mistake in step 1: the reset is done by holding the reset button on the back "
     "for ten seconds. Fix step 1 and keep the rest of the list."),
    # tone
    ("tone", "Write a message to a customer telling them their refund request was denied.",
     "Rewrite it in a friendlier, warmer tone, but keep the same information."),
    ("tone", "Write a short message to a coworker asking them to review my report by Thursday.",
     "Rewrite it in a more casual, friendly tone. Keep the same points and the sign-off."),
    ("tone", "Write a product description for a reusable water bottle.",
     "Rewrite it in a more playful tone, keeping every point you made."),
    # keep everything but ...
    ("keep_but", "Why does bread dough rise?",
     "Keep everything but add a short title at the top."),
    ("keep_but", "What causes thunder and lightning?",
     "Keep everything but split it into two paragraphs, one about thunder and one about lightning."),
    ("keep_but", "What ingredients do I need for chocolate chip cookies, and how do I bake them?",
     "Keep everything but halve all the quantities."),
    ("keep_but", "Write a short story about a boy named Sam and his robot friend.",
     "Keep everything but set it in a snowy mountain village instead of New Haven."),
]

_SENTENCE_END = re.compile(r"[.!?:)\]`\"]\s")
# A line, or a sentence inside one: the units a looping answer repeats.
_UNIT = re.compile(r"[^\n]+?(?:[.!?](?=\s)|(?=\n)|$)")


def cut_loop(text: str, max_repeats: int = 2) -> str:
    """``text`` cut before the first line or sentence (over 12 characters) that occurs for the
    ``max_repeats + 1``-th time: a 135M model at temperature 0 often loops until max_tokens,
    and a chat user would have stopped it there. A short stub left of the cut on its line
    (a list number, "P.S.") goes too."""
    seen: dict[str, int] = {}
    for m in _UNIT.finditer(text):
        unit = m.group().strip()
        if len(unit) <= 12:
            continue
        seen[unit] = seen.get(unit, 0) + 1
        if seen[unit] > max_repeats:
            cut = m.start()
            line_start = text.rfind("\n", 0, cut) + 1
            if len(text[line_start:cut].strip()) <= 12:
                cut = line_start
            return text[:cut].rstrip()
    return text


def trim_unfinished(text: str) -> str:
    """``text`` cut back to its last complete line (or else sentence), for a truncated answer."""
    text = text.rstrip()
    cut = text.rfind("\n")
    if cut >= len(text) // 2:
        return text[:cut].rstrip()
    ends = list(_SENTENCE_END.finditer(text + " "))
    if ends and ends[-1].start() + 1 >= len(text) // 2:
        return text[:ends[-1].start() + 1].rstrip()
    return text


def clean_answer(text: str, truncated: bool) -> str:
    """The answer as the chat shows it: loop cut off (``cut_loop``), else a truncated answer
    cut back to a complete line (``trim_unfinished``); a code block left open by the cut is
    dropped, with a line introducing it ("Here's an example:")."""
    text = text.strip()
    looped = cut_loop(text)
    if looped != text:
        text = looped
    elif truncated:
        text = trim_unfinished(text)
    if text.count("```") % 2:
        text = text[:text.rfind("```")].rstrip()
        head, _, last = text.rpartition("\n")
        if last.rstrip().endswith(":") and head:
            text = head.rstrip()
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT, help="the JSONL file to write")
    p.add_argument("--max-tokens", type=int, default=200, help="most tokens of a first answer")
    p.add_argument("--print", action="store_true", dest="show", help="print every answer")
    args = p.parse_args(argv)

    from specserve.config import EngineConfig, SamplingParams
    from specserve.engine.builder import build_engine
    from specserve.engine.tokenizer import encode_chat

    # CPU, float32, batch-invariant kernels: the greedy answers are the same on every run.
    config = EngineConfig.model_validate({
        "target": {"source": "embedded", "dtype": "float32", "device": "cpu", "kernels": "invariant"},
        "speculative": {"method": None}, "max_num_seqs": 1})
    engine, target = build_engine(config)
    tok = target.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    lines = []
    for i, (category, question, revision) in enumerate(SEEDS):
        t0 = time.perf_counter()
        [done] = engine.generate([encode_chat(tok, [{"role": "user", "content": question}])], params)
        answer = clean_answer(done.text, truncated=done.finish_reason == "length")
        messages = [{"role": "user", "content": question},
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": revision}]
        n_tokens = len(encode_chat(tok, messages))
        print(f"[{i + 1}/{len(SEEDS)}] {category}: {len(done.output_token_ids)} tokens "
              f"({done.finish_reason}), prompt {n_tokens} tokens, {time.perf_counter() - t0:.1f}s",
              file=sys.stderr)
        if args.show:
            print(f"--- {question}\n{answer}\n", file=sys.stderr)
        lines.append(json.dumps({"messages": messages, "category": category}, ensure_ascii=False))
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} prompts to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
