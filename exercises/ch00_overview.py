# Your exercises for book/00_overview.ipynb -- this file is yours to edit.
# Replace each `raise NotImplementedError(...)` with your code, then run the chapter's check cell
# (`check("ch00")`, from nanoengine.check) or: pytest tests/exercises/test_ch00_overview.py
# Generated from solutions/ch00_overview.py by scripts/make_exercises.py (maintainers: edit the solution, regenerate).
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
    raise NotImplementedError("Exercise 0.1: the engine's greedy answer to one user question - see book/00_overview.ipynb")


@torch.inference_mode()
def greedy_generate(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Exercise 0.2: greedy generation without a cache.

    `model` is a transformers causal LM: `model(input_ids).logits` has shape [1, seq_len, vocab] for
    `input_ids` of shape [1, seq_len]. Each step, run the model on the whole sequence so far (prompt +
    generated tokens), append the argmax of the last position's logits, and repeat `max_new_tokens`
    times. Return only the generated token ids.
    """
    raise NotImplementedError("Exercise 0.2: greedy generation without a cache - see book/00_overview.ipynb")


@torch.inference_mode()
def greedy_generate_cached(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Exercise 0.3: greedy generation with a KV cache (same tokens as Exercise 0.2, far less work).

    Call the model once on the whole prompt with `use_cache=True` (prefill); the output's `.cache` holds
    every layer's keys and values. Then, for each further token, call it on that one token only, passing
    `cache=<the cache>` (decode). That is exactly `max_new_tokens` model calls: the prompt, then one
    token at a time. Return only the generated token ids.
    """
    raise NotImplementedError("Exercise 0.3: greedy generation with a KV cache (same tokens as Exercise 0.2, far less work) - see book/00_overview.ipynb")
