"""Synthetic benchmark workloads, seeded: random prompt token ids and output lengths. Chapter 08.

- `nano-vllm`: exactly the draw of nano-vllm's `bench.py` (256 requests, prompt and output lengths uniform
  in 100..1024, token ids uniform in 0..10000, `random.seed(0)`), so our numbers sit next to its headline.
- `cpu-small`: the same draw with 32 requests and lengths in 64..512 (minutes on a laptop CPU).
- `shared-prefix`: one long seeded system prompt shared by every request plus a short unique suffix; shows
  the prefix cache (chapter 04). `multi-prefix`: four such system prompts, each request on one of them (the
  data-parallel router's workload, `bench/routing.py`).
- `smoke`: a handful of tiny requests for tests.
- `single-stream`: one request, 256 prompt tokens and 256 generated (one learner chatting);
  `uniform-32`: 32 such requests at once.

`--num-requests N` takes the first N requests of the workload's seeded draw (drawn with max(N, default)
requests, so request i is the same whatever N is). `poisson_arrivals` gives seeded arrival times for the
online mode (exponential inter-arrival times at a given rate).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

TOKEN_ID_MAX = 10_000  # nano-vllm draws randint(0, 10000): inclusive, so 10000 itself can appear


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]  # token ids, one list per request
    output_lens: list[int]  # tokens each request asks for (ignore_eos: exactly this many)
    spec: dict[str, Any] = field(default_factory=dict)  # how it was drawn (lengths, seed, ...) for the JSON
    temperature: float = 0.6
    arrival_times: list[float] | None = None  # seconds after the start (online mode)

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.output_lens):
            raise ValueError(f"workload {self.name!r}: {len(self.prompts)} prompts but "
                             f"{len(self.output_lens)} output lengths")
        if not self.prompts:
            raise ValueError(f"workload {self.name!r} has no requests; ask for at least one")

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def head(self, n: int) -> Workload:
        """The first n requests (same spec, with num_requests = n)."""
        arrivals = None if self.arrival_times is None else self.arrival_times[:n]
        return Workload(self.name, self.prompts[:n], self.output_lens[:n], {**self.spec, "num_requests": n},
                        self.temperature, arrivals)


def nano_vllm_draw(num_seqs: int, input_len: tuple[int, int], output_len: tuple[int, int],
                   seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """nano-vllm bench.py's draw, in its order: every prompt first (its length, then its ids), then every
    output length. `random.randint` is inclusive at both ends, as in the seed's code (ids in 0..10000)."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, TOKEN_ID_MAX) for _ in range(rng.randint(*input_len))]
               for _ in range(num_seqs)]
    output_lens = [rng.randint(*output_len) for _ in range(num_seqs)]
    return prompts, output_lens


def random_workload(name: str, num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int],
                    seed: int = 0, temperature: float = 0.6) -> Workload:
    """A nano-vllm-style workload with any count and length ranges (the draw of `nano_vllm_draw`)."""
    check_range("input_len", input_len)
    check_range("output_len", output_len)
    prompts, outs = nano_vllm_draw(num_requests, input_len, output_len, seed)
    spec = {"kind": "random", "num_requests": num_requests, "input_len": list(input_len),
            "output_len": list(output_len), "token_ids": [0, TOKEN_ID_MAX], "seed": seed,
            "temperature": temperature, "ignore_eos": True}
    return Workload(name, prompts, outs, spec, temperature)


def shared_prefix_workload(name: str, num_requests: int, prefix_len: int, suffix_len: tuple[int, int],
                           output_len: tuple[int, int], seed: int = 0, temperature: float = 0.6,
                           num_prefixes: int = 1) -> Workload:
    """Every prompt = one of `num_prefixes` shared system prompts of `prefix_len` seeded ids + a unique
    suffix. Draw order: the prefixes, then each suffix (length, then ids), then every output length, then
    (with several prefixes) each request's prefix, uniform: so one prefix draws as it always did."""
    check_range("suffix_len", suffix_len)
    check_range("output_len", output_len)
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    rng = random.Random(seed)
    prefixes = [[rng.randint(0, TOKEN_ID_MAX) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    suffixes = [[rng.randint(0, TOKEN_ID_MAX) for _ in range(rng.randint(*suffix_len))]
                for _ in range(num_requests)]
    outs = [rng.randint(*output_len) for _ in range(num_requests)]
    which = [rng.randrange(num_prefixes) if num_prefixes > 1 else 0 for _ in range(num_requests)]
    spec = {"kind": "shared-prefix", "num_requests": num_requests, "prefix_len": prefix_len,
            "num_prefixes": num_prefixes, "suffix_len": list(suffix_len), "output_len": list(output_len),
            "token_ids": [0, TOKEN_ID_MAX], "seed": seed, "temperature": temperature, "ignore_eos": True}
    return Workload(name, [prefixes[p] + s for p, s in zip(which, suffixes)], outs, spec, temperature)


def check_range(what: str, lo_hi: tuple[int, int]) -> None:
    lo, hi = lo_hi
    if not 1 <= lo <= hi:
        raise ValueError(f"{what} must be (lo, hi) with 1 <= lo <= hi, got {tuple(lo_hi)}")


WORKLOADS: dict[str, dict[str, Any]] = {
    # nano-vllm's bench.py: 256 requests, prompt and output lengths uniform in 100..1024 (its GPU headline)
    "nano-vllm": dict(kind="random", num_requests=256, input_len=(100, 1024), output_len=(100, 1024)),
    # the CPU version: 32 requests, lengths uniform in 64..512
    "cpu-small": dict(kind="random", num_requests=32, input_len=(64, 512), output_len=(64, 512)),
    # 64 requests sharing a ~1024-token system prompt, unique suffixes of 32..128, outputs 32..128
    "shared-prefix": dict(kind="shared-prefix", num_requests=64, prefix_len=1024, suffix_len=(32, 128),
                          output_len=(32, 128)),
    # 4 system prompts of 1024 tokens, 16 questions each in a seeded order (data-parallel routing,
    # bench/routing.py): suffixes of 16..64, outputs 16..32
    "multi-prefix": dict(kind="shared-prefix", num_requests=64, prefix_len=1024, num_prefixes=4,
                         suffix_len=(16, 64), output_len=(16, 32)),
    "smoke": dict(kind="random", num_requests=4, input_len=(8, 32), output_len=(4, 16)),
    # one learner chatting: one request of 256 prompt tokens and 256 generated
    # (the decode speed of one stream)
    "single-stream": dict(kind="random", num_requests=1, input_len=(256, 256), output_len=(256, 256)),
    # 32 concurrent requests of 256 + 256 tokens each (llama.cpp's parallel decoding comparison)
    "uniform-32": dict(kind="random", num_requests=32, input_len=(256, 256), output_len=(256, 256)),
}


def make_workload(name: str, num_requests: int | None = None, vocab_size: int | None = None,
                  seed: int = 0) -> Workload:
    """The named workload (see WORKLOADS), its first `num_requests` requests when given."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; use one of {', '.join(WORKLOADS)}")
    if num_requests is not None and (isinstance(num_requests, bool) or not isinstance(num_requests, int)
                                     or num_requests < 1):
        raise ValueError(f"--num-requests must be an integer >= 1, got {num_requests!r}")
    if vocab_size is not None and vocab_size <= TOKEN_ID_MAX:
        raise ValueError(f"workload {name!r} draws token ids in 0..{TOKEN_ID_MAX} (inclusive, as nano-vllm's "
                         f"bench.py), but the model's vocabulary has only {vocab_size} ids; use a model with "
                         f"more than {TOKEN_ID_MAX + 1} tokens")
    spec = dict(WORKLOADS[name])
    kind, default_n = spec.pop("kind"), spec.pop("num_requests")
    n = default_n if num_requests is None else num_requests
    draw_n = max(n, default_n)  # draw the full seeded workload, then take the first n
    if kind == "shared-prefix":
        wl = shared_prefix_workload(name, draw_n, seed=seed, **spec)
    else:
        wl = random_workload(name, draw_n, seed=seed, **spec)
    return wl.head(n)


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (s) of a Poisson process at `rate` requests/s: cumulative seeded exponential gaps,
    the first request arriving after the first gap."""
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 requests/s, got {rate}")
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        times.append(t)
    return times
