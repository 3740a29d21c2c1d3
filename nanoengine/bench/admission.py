"""Admission policies side by side: one long prompt behind a stream of short ones. Chapter 05.

The engine's Scheduler and BlockManager run alone (no model: every sequence that reaches its last token gets
a token, as a forward would give it), so a run is deterministic and takes milliseconds. Times are in steps.
A short request arrives every `arrive_every` steps (about what the pool serves); the long prompt arrives
once, early, and needs more free blocks than the stream leaves while short requests keep being admitted:

- "skip_ahead" admits a short request whenever it fits, so the free blocks never add up to the long
  prompt's need: it waits until the stream stops (starvation);
- "fcfs" (vLLM v1's rule, the engine's default) stops admitting at the long prompt: the running requests
  finish, their blocks add up, and it starts; the short requests behind it wait those steps.
"""

from __future__ import annotations

import random
import statistics
from typing import Any

from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.scheduler import Scheduler
from nanoengine.engine.sequence import Sequence
from nanoengine.sampling_params import SamplingParams


def long_prompt_behind_short_ones(policy: str, *, num_blocks: int = 64, block_size: int = 16,
                                  budget: int = 256, short_prompt: int = 48, short_output: int = 32,
                                  long_prompt: int = 700, long_arrives: int = 20, stream_steps: int = 400,
                                  arrive_every: int = 3,
                                  seed: int = 0) -> dict[str, Any]:
    """Run the stream under `policy`; the steps the long prompt waited for its first token, the short
    requests' median and worst wait, and tokens computed per step."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(bm, set(), max_num_batched_tokens=budget, max_num_seqs=256,
                      max_model_len=num_blocks * block_size, policy=policy)
    arrived: dict[int, int] = {}  # seq_id -> step it arrived
    first_token: dict[int, int] = {}  # seq_id -> step its first token came
    long_id, tokens, step = None, 0, 0

    def add(prompt_len: int, output_len: int) -> int:
        ids = [rng.randrange(1000, 100_000) for _ in range(prompt_len)]  # distinct: no prefix hits
        seq = Sequence(ids, SamplingParams(max_tokens=output_len, ignore_eos=True), block_size)
        sched.add(seq)
        arrived[seq.seq_id] = step
        return seq.seq_id

    while step < stream_steps or sched.has_unfinished():
        if step < stream_steps and step % arrive_every == 0:
            add(short_prompt, short_output)
        if step == long_arrives:
            long_id = add(long_prompt, 4)
        out = sched.schedule()
        tokens += out.num_batched_tokens
        for seq in out.sampled:
            first_token.setdefault(seq.seq_id, step)
        sched.update(out, [1] * len(out.sampled))
        step += 1
    waits = {sid: first_token[sid] - arrived[sid] for sid in arrived}
    short = [w for sid, w in waits.items() if sid != long_id]
    return {"policy": policy, "long_prompt_wait_steps": waits[long_id],
            "short_median_wait_steps": statistics.median(short), "short_max_wait_steps": max(short),
            "steps": step, "tokens_per_step": tokens / step, "stream_steps": stream_steps}
