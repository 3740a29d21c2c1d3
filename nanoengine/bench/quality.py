"""What quantization costs in quality: greedy agreement and perplexity, quantized vs not. Chapter 08.

`python -m nanoengine.bench.quality [--model smollm2-135m] [--max-tokens 64] [--quantization int8]` builds
the engine twice, without and with quantization, and reports
- greedy agreement on a fixed set of prompts: per prompt the first position where the two greedy
  continuations differ (None: identical), and the share of identical continuations;
- the perplexity of a fixed text under both: exp(-mean log p(token | the tokens before)), every position
  scored by one prefill (`sequence_logprobs`, through the engine's `prompt_logits`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

import torch

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "To make a cup of tea, first",
    "import numpy as np\n\ndef softmax(x):",
    "The largest planet in the solar system is",
    "Water boils at a temperature of",
)
TEXT = (
    "The history of computing is a story of machines that became smaller, faster and cheaper, and of the "
    "people who learned to program them. Early computers filled whole rooms and were programmed by plugging "
    "cables into boards. The invention of the transistor made it possible to build machines that were far "
    "more reliable, and the integrated circuit put thousands and then billions of transistors on a single "
    "chip. As hardware improved, programming languages made it easier to describe what a computer should "
    "do, and operating systems let many programs share one machine. Today a phone in a pocket is more "
    "powerful than the largest computers of the nineteen sixties, and the same ideas, memory, a processor "
    "that follows instructions, and software that tells it what to do, are still at the heart of every "
    "computer we use."
)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's length if one is a prefix of the
    other), None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy_agreement(base: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Per prompt the first diverging token position (None: identical), and the share of identical ones."""
    first = [first_difference(a, b) for a, b in zip(base, other)]
    return {"first_difference": first, "identical_share": sum(f is None for f in first) / len(first)}


def sequence_logprobs(llm: Any, ids: Sequence[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i = 1 .. len(ids) - 1, float64 [len(ids) - 1], from one prefill of the
    whole text (the engine's `prompt_logits`)."""
    logits = llm.engine.prompt_logits(list(ids))[:-1]  # [n - 1, vocab]: row i predicts token i + 1
    logp = torch.log_softmax(logits.double(), dim=-1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)  # [n - 1]


def perplexity(llm: Any, text: str = TEXT) -> float:
    """exp(-mean log-likelihood per token) of `text` under the engine's model."""
    ids = llm.tokenizer.encode(text)
    return math.exp(-sequence_logprobs(llm, ids).mean().item())


def compare(model: str, quantization: str, max_tokens: int = 64, prompts: Sequence[str] = PROMPTS,
            text: str = TEXT, **options: Any) -> dict[str, Any]:
    """Greedy continuations and the text's perplexity without and with `quantization` (see the module
    docstring); options go to both engines."""
    from nanoengine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens, ppl = {}, {}
    for q in (None, quantization):
        llm = LLM(model, quantization=q, **options)
        tokens[q] = [o.outputs[0].token_ids for o in llm.generate(list(prompts), params, use_tqdm=False)]
        ppl[q] = perplexity(llm, text)
        del llm
    return {"model": model, "quantization": quantization, "max_tokens": max_tokens,
            **greedy_agreement(tokens[None], tokens[quantization]),
            "perplexity": {"none": ppl[None], quantization: ppl[quantization]},
            "perplexity_increase": ppl[quantization] / ppl[None] - 1}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanoengine.bench.quality",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quantization", default="int8")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--engine-options", default=None, help='JSON, e.g. \'{"dtype": "float32"}\'')
    args = p.parse_args(argv)
    options = json.loads(args.engine_options) if args.engine_options else {}
    result = compare(args.model, args.quantization, args.max_tokens, **options)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
