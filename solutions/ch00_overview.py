"""Chapter 00, book/00_overview.ipynb: what an inference engine does.

Exercise 0.1: ask the engine one question through its chat API.
Exercise 0.2: the simplest generation loop: greedy, re-running the whole sequence every step.
Exercise 0.3: the same loop with a KV cache: the prompt once (prefill), then one token per step (decode).
"""

from __future__ import annotations

from typing import Any

import torch

from nanoengine import SamplingParams


def chat_answer(llm: Any, question: str, max_tokens: int = 32) -> str:
    """Exercise 0.1: the engine's greedy answer to one user question.

    Send `question` as a single user message through `llm.chat`, with greedy sampling (temperature 0)
    and at most `max_tokens` new tokens, and return the answer's text.
    """
    # BEGIN SOLUTION
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outputs = llm.chat([{"role": "user", "content": question}], params, use_tqdm=False)
    return outputs[0].outputs[0].text
    # END SOLUTION


@torch.inference_mode()
def greedy_generate(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Exercise 0.2: greedy generation without a cache.

    `model` is a transformers causal LM: `model(input_ids).logits` has shape [1, seq_len, vocab] for
    `input_ids` of shape [1, seq_len]. Each step, run the model on the whole sequence so far (prompt +
    generated tokens), append the argmax of the last position's logits, and repeat `max_new_tokens`
    times. Return only the generated token ids.
    """
    # BEGIN SOLUTION
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits  # [1, len(ids), vocab]
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt_ids):]
    # END SOLUTION


@torch.inference_mode()
def greedy_generate_cached(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Exercise 0.3: greedy generation with a KV cache (same tokens as Exercise 0.2, far less work).

    Call the model once on the whole prompt with `use_cache=True` (prefill); the output's `.cache` holds
    every layer's keys and values. Then, for each further token, call it on that one token only, passing
    `cache=<the cache>` (decode). That is exactly `max_new_tokens` model calls: the prompt, then one
    token at a time. Return only the generated token ids.
    """
    # BEGIN SOLUTION
    out = model(torch.tensor([prompt_ids]), use_cache=True)  # logits [1, len(prompt), vocab]
    new: list[int] = []
    while True:
        token = int(out.logits[0, -1].argmax())
        new.append(token)
        if len(new) == max_new_tokens:
            return new
        out = model(torch.tensor([[token]]), cache=out.cache, use_cache=True)  # logits [1, 1, vocab]
    # END SOLUTION
