"""The unit's engine loop in this process (no Ray): what the engine thread hands the event
loop. A step's outputs reach their streams in one hand-over (one wake-up of the loop) however
many sequences the step ran, and each stream gets exactly its own tokens."""

from __future__ import annotations

import asyncio

from specserve.config import SamplingParams
from specserve.engine.request import EngineRequest
from specserve.serve import engine_loop
from specserve.serve.engine_loop import EngineLoop

from tests.engine.test_spec_decode import make_engine
from tests.models import tiny_hf_model

PROMPTS = [[5, 9, 14, 3], [7, 7, 21], [30, 11, 4, 4, 19]]


def test_a_step_is_one_hand_over_to_the_event_loop_for_all_its_sequences():
    target = tiny_hf_model(seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [c.output_token_ids for c in make_engine(target, None, slots=4).generate(PROMPTS, greedy)]
    engine = make_engine(target, None, slots=4)
    loop = EngineLoop(engine, max_queue_len=4)
    steps, handovers = [], []
    step = engine.step
    engine.step = lambda: steps.append(1) or step()

    async def run() -> list[list[int]]:
        running = asyncio.get_running_loop()
        real = running.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            if callback is engine_loop._put_all:
                handovers.append(len(args[0]))
            return real(callback, *args, **kwargs)

        running.call_soon_threadsafe = counted

        async def one(prompt: list[int]) -> list[int]:
            with loop.admission():
                return [t for out in [o async for o in loop.generate(
                    EngineRequest(prompt, greedy), num_speculative_tokens=None)] for t in out.new_token_ids]

        return await asyncio.gather(*(one(p) for p in PROMPTS))

    try:
        got = asyncio.run(run())
    finally:
        loop.shutdown()
    assert got == expected
    assert len(handovers) <= len(steps) and max(handovers) == len(PROMPTS), (handovers, len(steps))
