"""Peers measured in the same run, on the same model and requests. Chapter 08.

- Hugging Face transformers `generate` in static batches (workload order, nothing sorted). A static batch runs
  until its longest request is done and pads every prompt to the longest one, so it computes tokens nobody
  asked for; only the requested tokens count (the padding waste is the point of the comparison).
- vLLM and nano-vllm, when importable and CUDA is available (both need a GPU); otherwise the result says
  why they were skipped.

Every peer returns a dict with "peer" and either the measured numbers or "skipped"/"error".
"""

from __future__ import annotations

import gc
import importlib.util
import time
from pathlib import Path
from typing import Any

import torch

from nanoengine.bench.metrics import throughput
from nanoengine.bench.workload import Workload

PEERS = ("hf", "vllm", "nano-vllm")


def load_hf_model(model_path: Path, dtype: torch.dtype, device: str, quiet: bool = True):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if quiet:
        hf_logging.disable_progress_bar()  # the "Loading weights" bar
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()


def hf_static_batches(model_path: Path, workload: Workload, batch_size: int, dtype: torch.dtype,
                      device: str = "cpu", seed: int = 0, greedy: bool = False, quiet: bool = True,
                      model: Any = None) -> dict[str, Any]:
    """transformers generate over the workload in batches of `batch_size`, left-padded, ignore_eos."""
    import transformers
    from tqdm.auto import tqdm

    if model is None:
        model = load_hf_model(model_path, dtype, device, quiet)
    model.generation_config.eos_token_id = None  # ignore_eos: every request runs to its length
    sampling = (dict(do_sample=False) if greedy else
                dict(do_sample=True, temperature=workload.temperature, top_k=0, top_p=1.0))
    pad = 0

    def generate(prompts: list[list[int]], n_new: int) -> None:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # [B, width]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=device)  # [B, width]
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n_new, pad_token_id=pad, **sampling)

    generate([[1, 2, 3]], 2)  # warm-up
    torch.manual_seed(seed)
    batches = range(0, len(workload), batch_size)
    computed_positions = 0
    start = time.perf_counter()
    for i in tqdm(batches, desc=f"transformers batch {batch_size}", disable=quiet, dynamic_ncols=True):
        prompts = workload.prompts[i:i + batch_size]
        n_new = max(workload.output_lens[i:i + batch_size])
        generate(prompts, n_new)
        computed_positions += len(prompts) * (max(len(p) for p in prompts) + n_new - 1)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    useful = sum(len(p) + o - 1 for p, o in zip(workload.prompts, workload.output_lens))
    return {"peer": "hf", "name": f"transformers bs={batch_size}", "batch_size": batch_size,
            "sampling": "greedy" if greedy else f"do_sample, temperature {workload.temperature}, top_k off, "
                                                "top_p 1",
            "transformers": transformers.__version__,
            **throughput(workload.num_prompt_tokens, workload.num_output_tokens, seconds),
            "computed_positions": computed_positions, "useful_positions": useful,
            "padding_waste": 1 - useful / computed_positions}


def unavailable(peer: str, module: str) -> str | None:
    """Why `peer` cannot run here (None when it can)."""
    if importlib.util.find_spec(module) is None:
        return "not installed"
    if not torch.cuda.is_available():
        return "needs a GPU"
    return None


def vllm_peer(model_path: Path, workload: Workload, seed: int = 0) -> dict[str, Any]:
    """vLLM's offline LLM on the same token ids and sampling (temperature, ignore_eos, max_tokens)."""
    from vllm import LLM, SamplingParams

    llm = LLM(str(model_path), enforce_eager=False, max_model_len=4096, seed=seed)
    params = [SamplingParams(temperature=workload.temperature, ignore_eos=True, max_tokens=n)
              for n in workload.output_lens]
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    import vllm

    del llm
    return {"peer": "vllm", "name": "vLLM", "vllm": vllm.__version__,
            **throughput(workload.num_prompt_tokens, workload.num_output_tokens, seconds)}


def nano_vllm_peer(model_path: Path, workload: Workload) -> dict[str, Any]:
    """nano-vllm, exactly as its bench.py drives it."""
    from nanovllm import LLM, SamplingParams

    llm = LLM(str(model_path), enforce_eager=False, max_model_len=4096)
    params = [SamplingParams(temperature=workload.temperature, ignore_eos=True, max_tokens=n)
              for n in workload.output_lens]
    llm.generate(["Benchmark: "], SamplingParams())  # warm-up, as in bench.py
    start = time.perf_counter()
    llm.generate(workload.prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    exit_fn = getattr(llm, "exit", None)
    if exit_fn is not None:
        exit_fn()
    del llm
    return {"peer": "nano-vllm", "name": "nano-vllm",
            **throughput(workload.num_prompt_tokens, workload.num_output_tokens, seconds)}


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_peers(peers: list[str], model_path: Path, workload: Workload, batch_sizes: list[int],
              dtype: torch.dtype, device: str, seed: int = 0, quiet: bool = True) -> list[dict[str, Any]]:
    """Every requested peer in turn; one that fails is recorded with its error, not raised."""
    results: list[dict[str, Any]] = []
    for peer in peers:
        if peer == "hf":
            if not batch_sizes:
                results.append({"peer": "hf", "name": "transformers", "skipped": "no --peer-batches"})
            model = None
            for b in batch_sizes:
                try:
                    if model is None:  # loaded once for all batch sizes
                        model = load_hf_model(model_path, dtype, device, quiet)
                    results.append(hf_static_batches(model_path, workload, b, dtype, device, seed,
                                                     quiet=quiet, model=model))
                except Exception as e:  # a peer's failure is a result, not a crash
                    results.append({"peer": "hf", "name": f"transformers bs={b}", "error": repr(e)})
            del model
            free_device_memory()
            continue
        module = {"vllm": "vllm", "nano-vllm": "nanovllm"}[peer]
        why = unavailable(peer, module)
        if why:
            results.append({"peer": peer, "name": peer, "skipped": why})
            continue
        try:
            if peer == "vllm":
                results.append(vllm_peer(model_path, workload, seed))
            else:
                results.append(nano_vllm_peer(model_path, workload))
        except Exception as e:
            results.append({"peer": peer, "name": peer, "error": repr(e)})
        free_device_memory()
    return results


def parse_peers(text: str | None) -> list[str]:
    """'hf,vllm,nano-vllm' -> a checked list (empty string or 'none': no peers)."""
    if text is None:
        return list(PEERS)
    names = [p.strip() for p in text.split(",") if p.strip() and p.strip() != "none"]
    bad = [p for p in names if p not in PEERS]
    if bad:
        raise ValueError(f"unknown peer(s) {', '.join(bad)}; "
                         f"use a comma-separated subset of {','.join(PEERS)}")
    return names
