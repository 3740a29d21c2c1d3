"""The peer: Hugging Face transformers `generate` in static batches on the same model and workload.
Chapter 08.

A static batch runs until its longest request is done (ignore_eos: every request gets exactly its output
length), so the useful tokens are the requested ones; padding waste is the point of the comparison.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from nanoengine.bench.workload import Workload


def hf_static_batches(model_path: Path, workload: Workload, batch_size: int, dtype: torch.dtype,
                      device: str = "cpu") -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # ignore_eos
    pad = 0
    start = time.perf_counter()
    for i in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[i:i + batch_size]
        n_new = max(workload.output_lens[i:i + batch_size])
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                           do_sample=False, pad_token_id=pad)
    seconds = time.perf_counter() - start
    return {"peer": f"transformers generate, static batches of {batch_size}", "batch_size": batch_size,
            "seconds": seconds, "output_tokens": workload.num_output_tokens,
            "output_tokens_per_s": workload.num_output_tokens / seconds}
