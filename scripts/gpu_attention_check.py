"""The attention backends on a GPU in one short run (scripts/gpu_check.sh calls it). Chapters 06 and 08.

1. correctness: greedy tokens of `triton` and `flash_attn` against `torch`, on tiny-qwen3 and smollm2-135m,
   in float32 and bfloat16 (flash-attn has no float32), with chunked prefill and a prefix hit in the mix;
   the share of continuations equal to torch's token for token.
2. speed: decode attention alone, per backend, at batch 1, 32 and 256 with contexts 512 and 4096, in
   Qwen3-0.6B's attention shape (16 query heads, 8 KV heads, head_dim 128, bf16): microseconds per call, GB/s
   of K/V read, and that as a fraction of the copy bandwidth measured on the spot (the HBM ceiling). Triton
   runs twice: split-K as the engine picks it, and one program per (sequence, kv head), to show the split.
Writes attention_check.json and attention_check.md into --out. `--smoke` runs the same code tiny, on CPU
with Triton's interpreter (set TRITON_INTERPRET=1), as the test of this script.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from nanoengine import LLM, SamplingParams
from nanoengine.attention import flash_attn_backend
from nanoengine.attention import torch_backend as tb
from nanoengine.bench.hardware import memory_bandwidth_gbs
from nanoengine.kernels import triton_support

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog. " * 12, "1, 2, 3,", "Once upon a time",
           # the last hits the 2nd's prefix
           "The quick brown fox jumps over the lazy dog. " * 12 + "And then"]


def available(backend: str, device: str) -> str | None:
    """None when the backend can run here, else why not."""
    if backend == "triton":
        return triton_support.problem(device)
    if backend == "flash_attn":
        return "needs CUDA" if device != "cuda" else flash_attn_backend.problem()
    return None


def correctness(device: str, models: list[str], max_tokens: int) -> list[dict]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for model in models:
        for dtype in ("float32", "bfloat16"):
            want = None
            for backend in ("torch", "triton", "flash_attn"):
                row = {"model": model, "dtype": dtype, "backend": backend}
                why = available(backend, device) or (
                    "flash-attn has no float32" if backend == "flash_attn" and dtype == "float32" else None)
                if why:
                    rows.append({**row, "result": f"skipped: {why}"})
                    continue
                try:
                    llm = LLM(model, device=device, dtype=dtype, attention_backend=backend,
                              max_num_batched_tokens=256, max_num_seqs=16)  # few graph buckets to capture
                    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
                except Exception as e:  # a failing backend is a result, not the end of the run
                    rows.append({**row, "result": f"error: {type(e).__name__}: {str(e)[:300]}"})
                    continue
                if backend == "torch":
                    want = got
                    rows.append({**row, "result": "reference"})
                    continue
                same = sum(g == w for g, w in zip(got, want))
                first_diff = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
                              for g, w in zip(got, want)]
                rows.append({**row, "result": f"{same}/{len(want)} equal", "equal": same, "of": len(want),
                             "first_differing_token": first_diff})
                del llm
    return rows


def timed(fn, device: str, iters: int) -> float:
    """Median seconds per call."""
    fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def decode_inputs(batch: int, context: int, block_size: int, num_kv_heads: int, head_dim: int, num_heads: int,
                  dtype: torch.dtype, device: str, gen: torch.Generator):
    blocks = -(-context // block_size)
    num_blocks = batch * blocks
    table = torch.randperm(num_blocks, generator=gen).view(batch, blocks).to(device)  # scattered blocks
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k = torch.randn(shape, dtype=dtype, device=device)
    v = torch.randn(shape, dtype=dtype, device=device)
    q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=device)
    return q, k, v, table, torch.full((batch,), context, device=device)


HEADS, KV_HEADS, HEAD_DIM, DTYPE = 16, 8, 128, torch.bfloat16  # Qwen3-0.6B's attention


def decode_cases(batch: int, context: int, device: str, gen: torch.Generator) -> dict:
    """One decode call per backend on the same shape (fresh random caches): name -> callable."""
    from nanoengine.kernels.triton_decode import paged_decode

    scale = HEAD_DIM ** -0.5
    q, k, v, table, lens = decode_inputs(batch, context, 16, KV_HEADS, HEAD_DIM, HEADS, DTYPE, device, gen)
    rows, mask = tb.decode_index(table, lens, k.shape)
    cases = {"torch (block 16)": lambda: tb.paged_decode(q, k, v, rows, mask, scale)}
    if available("triton", device) is None:
        cases["triton split-K (block 16)"] = lambda: paged_decode(q, k, v, table, lens, scale)
        cases["triton 1 split (block 16)"] = lambda: paged_decode(q, k, v, table, lens, scale, num_splits=1)
    if available("flash_attn", device) is None:
        from flash_attn import flash_attn_with_kvcache

        fq, fk, fv, ft, fl = decode_inputs(batch, context, 256, KV_HEADS, HEAD_DIM, HEADS, DTYPE, device, gen)
        # [blocks, bs, kvh, d]
        fk, fv = fk.permute(1, 2, 0, 3).contiguous(), fv.permute(1, 2, 0, 3).contiguous()
        ft, fl = ft.int(), fl.int()
        cases["flash_attn (block 256)"] = lambda: flash_attn_with_kvcache(
            fq.unsqueeze(1), fk, fv, cache_seqlens=fl, block_table=ft, softmax_scale=scale, causal=True)
    return cases


def speed(device: str, batches: list[int], contexts: list[int], iters: int) -> tuple[list[dict], float]:
    peak = memory_bandwidth_gbs(device)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:
        for context in contexts:
            kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize
            for name, fn in decode_cases(batch, context, device, gen).items():
                row = {"backend": name, "batch": batch, "context": context}
                try:
                    s = timed(fn, device, iters)
                    gbs = kv_bytes / s / 1e9
                    rows.append({**row, "us": round(s * 1e6, 1), "kv_GBps": round(gbs, 1),
                                 "fraction_of_copy_bw": round(gbs / peak, 3)})
                except Exception as e:
                    rows.append({**row, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows, peak


def markdown(check: list[dict], bench: list[dict], peak: float, env: dict) -> str:
    lines = [f"# Attention backends: {env.get('gpu', env['device'])}, torch {env['torch']}, "
             f"triton {env.get('triton')}, flash_attn {env.get('flash_attn')}", "",
             "## Greedy tokens against the torch backend", "", "| model | dtype | backend | result |",
             "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['dtype']} | {r['backend']} | {r['result']} |" for r in check]
    lines += ["", "## Decode attention (16 q heads, 8 KV heads, head_dim 128, bf16); copy bandwidth "
              f"{peak:.0f} GB/s",
              "", "| backend | batch | context | us | K/V GB/s | fraction of copy bandwidth |",
              "|---|---|---|---|---|---|"]
    for r in bench:
        if "error" in r:
            lines.append(f"| {r['backend']} | {r['batch']} | {r['context']} | error: {r['error']} | | |")
        else:
            lines.append(f"| {r['backend']} | {r['batch']} | {r['context']} | {r['us']} | {r['kv_GBps']} | "
                         f"{r['fraction_of_copy_bw']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_out")
    ap.add_argument("--smoke", action="store_true", help="tiny, on CPU (needs TRITON_INTERPRET=1)")
    ap.add_argument("--models", default="tiny-qwen3,smollm2-135m",
                    help="comma-separated models for the token check (--smoke: the first only)")
    args = ap.parse_args()
    models = [m for m in args.models.split(",") if m]
    device = "cpu" if args.smoke else "cuda"
    env = {"device": device, "torch": torch.__version__}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    for pkg in ("triton", "flash_attn"):
        try:
            env[pkg] = __import__(pkg).__version__
        except Exception as e:
            env[pkg] = f"not available ({type(e).__name__})"
    if args.smoke:
        check = correctness(device, models[:1], max_tokens=4)
        bench, peak = speed(device, [1, 2], [64], iters=2)
    else:
        check = correctness(device, models, max_tokens=32)
        bench, peak = speed(device, [1, 32, 256], [512, 4096], iters=20)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_check.json").write_text(json.dumps(
        {"env": env, "correctness": check, "decode_speed": bench, "copy_bandwidth_GBps": peak}, indent=1))
    table = markdown(check, bench, peak, env)
    (out / "attention_check.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
