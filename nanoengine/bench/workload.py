"""Synthetic workloads: random prompts and output lengths, seeded (as in nano-vllm's bench). Chapter 08."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]  # token ids
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(name: str, num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int],
                  vocab_size: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    top = min(vocab_size, 10_000)
    prompts = [[rng.randrange(top) for _ in range(rng.randint(*input_len))] for _ in range(num_requests)]
    outs = [rng.randint(*output_len) for _ in range(num_requests)]
    return Workload(name, prompts, outs)


WORKLOADS = {
    # CPU: 32 requests, prompt and output lengths uniform in 64..512
    "cpu-small": dict(num_requests=32, input_len=(64, 512), output_len=(64, 512)),
    # the book's GPU benchmark: 256 requests, lengths uniform in 100..1024
    "gpu-256": dict(num_requests=256, input_len=(100, 1024), output_len=(100, 1024)),
    "smoke": dict(num_requests=4, input_len=(8, 32), output_len=(4, 16)),
}
