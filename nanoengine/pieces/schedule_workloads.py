"""Chapter 05's check workloads: a fake model over a simulated paged KV cache, and the seeded workloads the
scheduling checks run (nanoengine/pieces/schedule_checks.py). No torch: a step's tokens are a function of
what each sequence reads back through its block table, so a wrong read changes them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from nanoengine.book import see
from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.scheduler import Scheduler, SchedulerOutput
from nanoengine.engine.sequence import Sequence
from nanoengine.sampling_params import SamplingParams

EOS = 7


def where(exercise: str) -> str:
    return see(exercise, "05a_admission.ipynb")


# ------------------------------------------------------------------------------------------ the fake model
def next_digest(digest: int, token: int) -> int:
    """The record of a prefix extended by one token (Python's tuple hash of ints: the same in every run)."""
    return hash((digest, token))


def fake_token(digest: int, eos_every: int = 11) -> int:
    """The fake model's next token after a prefix: EOS about once in `eos_every`, else one of 10..999."""
    x = (digest * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    return EOS if (x >> 7) % eos_every == 0 else 10 + (x >> 17) % 990


def prefix_digests(tokens: list[int]) -> list[int]:
    out, d = [], 0
    for t in tokens:
        d = next_digest(d, t)
        out.append(d)
    return out


def alone(prompt: list[int], params: SamplingParams, max_len: int) -> list[int]:
    """The oracle: the fake model's tokens for one prompt run by itself, with the engine's stop rules."""
    tokens, d = list(prompt), prefix_digests(prompt)[-1]
    while True:
        t = fake_token(d)
        tokens.append(t)
        d = next_digest(d, t)
        n_out = len(tokens) - len(prompt)
        if (not params.ignore_eos and t == EOS) or n_out >= params.max_tokens or len(tokens) >= max_len:
            return tokens[len(prompt):]


class FakeModel:
    """The model's stand-in over a simulated paged KV cache (see the module's docstring)."""

    def __init__(self, block_size: int, exercise: str) -> None:
        self.block_size = block_size
        self.exercise = exercise
        # (block, offset) -> (position, prefix record)
        self.slots: dict[tuple[int, int], tuple[int, int]] = {}
        self.digests: dict[int, list[int]] = {}  # seq_id -> prefix records of its known tokens

    def _digests(self, seq: Sequence) -> list[int]:
        have = self.digests.setdefault(seq.seq_id, [])
        d = have[-1] if have else 0
        for t in seq.token_ids[len(have):]:
            d = next_digest(d, t)
            have.append(d)
        return have

    def step(self, out: SchedulerOutput, step: int) -> list[int]:
        """Write every scheduled position's K/V, then let each scheduled sequence attend over all its
        positions; one token per sequence of `out.sampled`."""
        bs = self.block_size
        for s in out.scheduled:  # every layer stores the whole batch's K/V before anyone attends
            seq, digests = s.seq, self._digests(s.seq)
            for pos in range(max(s.start, seq.num_cached_tokens), s.start + s.num_new_tokens):
                self.slots[(seq.block_table[pos // bs], pos % bs)] = (pos, digests[pos])
        read: dict[int, int] = {}
        for s in out.scheduled:
            seq, digests = s.seq, self._digests(s.seq)
            end = s.start + s.num_new_tokens
            for pos in range(end):
                slot = (seq.block_table[pos // bs], pos % bs)
                found = self.slots.get(slot)
                if found != (pos, digests[pos]):
                    what = ("nothing: no step ever computed that position" if found is None else
                            f"the K/V of position {found[0]} of another token sequence" if found[0] != pos
                            else
                            "the K/V of the same position in a sequence with other tokens before it")
                    cached = pos < seq.num_cached_tokens
                    raise AssertionError(
                        f"step {step}: sequence {seq.seq_id} attends over its positions 0..{end - 1} and "
                        f"reads "
                        f"position {pos} from block {slot[0]} (its table {seq.block_table}), which holds "
                        f"{what}. "
                        + ("That position was counted as a prefix-cache hit (num_cached_tokens="
                           f"{seq.num_cached_tokens}) that is not one. " if cached else
                           f"The step starts at {s.start}: the positions before it must have been computed "
                           "into these blocks by earlier steps (a preempted sequence must start over from 0 "
                           "computed tokens; a block may be shared only through the prefix cache). ")
                        + where(self.exercise))
            read[seq.seq_id] = digests[end - 1]
        return [fake_token(read[seq.seq_id]) for seq in out.sampled]


# ------------------------------------------------------------------------------------------ workloads
@dataclass
class Arrival:
    step: int
    prompt: list[int]
    params: SamplingParams


@dataclass
class Workload:
    name: str
    num_blocks: int
    block_size: int
    budget: int
    max_seqs: int
    arrivals: list[Arrival]
    max_model_len: int = 256

    def scheduler(self, cls: type[Scheduler] = Scheduler) -> Scheduler:
        return cls(BlockManager(self.num_blocks, self.block_size), {EOS}, max_num_batched_tokens=self.budget,
                   max_num_seqs=self.max_seqs, max_model_len=self.max_model_len)


def make_workload(name: str, seed: int, num_blocks: int, bs: int, budget: int, max_seqs: int,
                  num_requests: int, max_prompt: int, max_new: int) -> Workload:
    """Requests arriving over the first steps: prompts sharing prefixes, some repeated whole (a hit up to the
    last token), a pair of identical prompts arriving together, prompts longer than the budget (a step that
    prefills only the middle of one), some with n = 2 (siblings wait for the first one's prefill, as
    LLMEngine sets them up; honouring that is optional)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 1000) for _ in range(rng.randint(bs, 3 * bs))] for _ in range(3)]
    # first, two identical prompts arriving (and admitted) in the same step
    twin = [rng.randrange(10, 1000) for _ in range(min(budget // 2, 2 * bs + 1))]
    arrivals = [Arrival(0, twin, SamplingParams(max_tokens=max_new, ignore_eos=True)),
                Arrival(0, list(twin), SamplingParams(max_tokens=max_new // 2 + 1))]
    seen: list[list[int]] = [twin]
    step = 0
    while len(arrivals) < num_requests:
        if seen and rng.random() < 0.15:
            ids = list(rng.choice(seen))
        else:
            head = list(rng.choice(prefixes)) if rng.random() < 0.6 else []
            ids = (head + [rng.randrange(10, 1000) for _ in range(rng.randint(1, max_prompt))])[:max_prompt]
            if rng.random() < 0.3 and len(ids) >= bs:  # a whole number of blocks
                ids = ids[: len(ids) // bs * bs]
        seen.append(ids)
        params = SamplingParams(n=2 if rng.random() < 0.15 else 1, max_tokens=rng.randint(1, max_new),
                                ignore_eos=rng.random() < 0.4)
        arrivals.append(Arrival(step, ids, params))
        step += rng.choice([0, 0, 1, 2, 3])
    return Workload(name, num_blocks, bs, budget, max_seqs, arrivals)


WORKLOADS = [
    # roomy pool: chunked prefill, prefix hits, siblings, identical prompts in one step
    dict(name="roomy", seed=51, num_blocks=200, bs=4, budget=24, max_seqs=6, num_requests=18, max_prompt=40,
         max_new=12),
    # small pool: preemption, admission stopped at a request that does not fit
    dict(name="tight", seed=52, num_blocks=14, bs=4, budget=16, max_seqs=4, num_requests=16, max_prompt=26,
         max_new=16),
    # many short requests in a tiny pool: a step that preempts while the queue's head would fit
    dict(name="crowded", seed=56, num_blocks=10, bs=4, budget=16, max_seqs=4, num_requests=16, max_prompt=10,
         max_new=16),
    dict(name="long prompts", seed=53, num_blocks=24, bs=8, budget=32, max_seqs=5, num_requests=12,
         max_prompt=60, max_new=24),
]


def workloads() -> list[Workload]:
    return [make_workload(**w) for w in WORKLOADS]


def add_arrivals(sched: Scheduler, wl: Workload, step: int, requests: list) -> None:
    for a in wl.arrivals:
        if a.step == step:
            seqs = [Sequence(list(a.prompt), a.params, wl.block_size) for _ in range(a.params.n)]
            for i, s in enumerate(seqs):
                s.index = i
                if i:
                    s.wait_for = seqs[0]
                sched.add(s)
            requests.extend((s, a) for s in seqs)


# ------------------------------------------------------------------------------------------ the books
def chained_hashes(tokens: list[int], bs: int, num_blocks: int) -> list[int]:
    """The chained-hash convention (chapter 04): block i's hash is xxh64 over block i-1's hash and block i's
    tokens, so equal hashes mean equal whole prefixes."""
    return BlockManager.hash_blocks([tokens[i * bs:(i + 1) * bs] for i in range(num_blocks)])
