"""Chapter 06's checks of CUDA graphs and torch.compile, in one run; writes graphs_check.md and .json
into --out.

- ops: each compiled op against its eager self (RMSNorm with residual, SiLU-and-mul, rotary at Qwen3-0.6B's
  shapes for 1, 32 and 256 tokens; the sampler's distribution at batch 32 over Qwen3's vocabulary), median
  time per call on this device (CPU or CUDA);
- tokens (CUDA): greedy tokens of graphs == eager and graphs + compiled ops == eager, on tiny-qwen3 and
  smollm2, float32 and bfloat16, through batch changes;
- decode (CUDA): one decode step (forward + logits) eager vs graphs at batch 1, 8, 32, 128 (context 512) on
  qwen3-0.6b-shape in bfloat16.
Usage: python scripts/graphs_check.py --out DIR [--only ops,tokens,decode] [--smoke: on CPU, tokens and
decode on tiny-qwen3 through the graphs' stand-in, to check the script itself]. The nano-vllm workload
with graphs is `nanoengine bench` (graphs are the default on CUDA); scripts/gpu_check.sh runs both.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from nanoengine import LLM, SamplingParams
from nanoengine.attention import AttentionMetadata
from nanoengine.engine.inputs import ModelInput

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog. " * 4, "1, 2, 3,", "Once upon a time",
           "A paged KV cache", "x " * 30]


def median_ms(fn, args: tuple, device: torch.device, iters: int = 30, warmup: int = 3) -> float:
    """Median milliseconds of fn(*args)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    for _ in range(warmup):
        fn(*args)
    times = []
    for _ in range(iters):
        sync()
        t = time.perf_counter()
        fn(*args)
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def check_ops(device: torch.device) -> list[dict]:
    from nanoengine.kernels.compiled import CompiledOps, add_rms_norm, rotary_by_position
    from nanoengine.layers.activation import silu_and_mul
    from nanoengine.layers.rotary import RotaryEmbedding
    from nanoengine.layers.sampler import sampling_cdf

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ops = CompiledOps()
    hidden, inter, heads, head_dim = 1024, 3072, 16, 128  # Qwen3-0.6B
    rot = RotaryEmbedding(head_dim, 4096, 1e6).to(device)
    w = torch.ones(hidden, dtype=dtype, device=device)
    rows = []
    with torch.inference_mode():
        for n in (1, 32, 256):
            x, res = (torch.randn(n, hidden, dtype=dtype, device=device) for _ in range(2))
            gate_up = torch.randn(n, 2 * inter, dtype=dtype, device=device)
            q = torch.randn(n, heads, head_dim, dtype=dtype, device=device)
            pos = torch.randint(0, 4096, (n,), device=device)
            cases = {"rms_norm + residual": (add_rms_norm, ops.rms_norm, (x, res, w, 1e-6)),
                     "silu_and_mul": (silu_and_mul, ops.silu_and_mul, (gate_up,)),
                     "rotary": (rotary_by_position, ops.rotary, (q, pos, rot.cos, rot.sin))}
            for name, (eager, compiled, args) in cases.items():
                e, c = median_ms(eager, args, device), median_ms(compiled, args, device)
                rows.append({"op": name, "tokens": n, "dtype": str(dtype), "eager_ms": e, "compiled_ms": c})
        logits = torch.randn(32, 151936, device=device)
        temps = torch.full((32,), 0.8, device=device)
        top_ps = torch.full((32,), 0.9, device=device)
        compiled_cdf = torch.compile(sampling_cdf, dynamic=True)
        args = (logits, temps, None, top_ps, None)
        e, c = (median_ms(sampling_cdf, args, device, iters=10),
                median_ms(compiled_cdf, args, device, iters=10))
        rows.append({"op": "sampler cdf (top-p)", "tokens": 32, "dtype": "torch.float32", "eager_ms": e,
                     "compiled_ms": c})
    return rows


# engine options per mode; on CPU (--smoke) the graphs are the stand-in and the torch backend is compiled
MODES = {"cuda": {"eager": {"enforce_eager": True, "torch_compile": False},
                  "graphs": {"torch_compile": False}, "compiled": {"torch_compile": True}},
         "cpu": {"eager": {"attention_backend": "torch"},
                 "graphs": {"attention_backend": "torch", "graph_stand_in": True},
                 "compiled": {"attention_backend": "torch", "graph_stand_in": True, "torch_compile": True}}}


def greedy(model: str, dtype: str, device: str, **options) -> tuple[list, LLM]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 5, 17, 9, 33, 12)]
    llm = LLM(model, device=device, dtype=dtype, max_num_seqs=8, num_kvcache_blocks=256, **options)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)], llm


def agreement(a: list, b: list) -> float:
    same = sum(x == y for s, t in zip(a, b) for x, y in zip(s, t))
    return same / max(1, sum(map(len, a)))


def check_tokens(device: str, models=("tiny-qwen3", "smollm2-135m"),
                 dtypes=("float32", "bfloat16")) -> list[dict]:
    rows = []
    mode = MODES[device]
    for model in models:
        for dtype in dtypes:
            row = {"model": model, "dtype": dtype}
            try:  # one failing row (a backend that cannot be captured, say) must not hide the others
                eager, _ = greedy(model, dtype, device, **mode["eager"])
                graphs, llm = greedy(model, dtype, device, **mode["graphs"])
                row.update(backend=llm.plan.attention_backend,
                           replays_by_bucket=dict(llm.engine.executor.runner.graphs.replays))
                del llm
                compiled, _ = greedy(model, dtype, device, **mode["compiled"])
                row.update(graphs_equal=graphs == eager, graphs_agree=agreement(graphs, eager),
                           compiled_equal=compiled == eager, compiled_agree=agreement(compiled, eager))
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
            rows.append(row)
            free_memory()
    return rows


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode_input(runner, batch: int, context: int) -> ModelInput:
    """A decode-only step of `batch` sequences at `context` tokens each, on distinct blocks."""
    bs, dev = runner.block_size, runner.device
    per_seq = -(-context // bs)
    tables = torch.arange(batch * per_seq, device=dev).view(batch, per_seq)  # [batch, per_seq]
    pos = context - 1
    slots = tables[:, pos // bs] * bs + pos % bs  # [batch]
    meta = AttentionMetadata(slot_mapping=slots, num_decode_seqs=batch, decode_block_tables=tables,
                             decode_context_lens=torch.full((batch,), context, device=dev),
                             prefill_query_starts=[], prefill_query_lens=[], prefill_context_lens=[],
                             prefill_block_tables=[], block_size=bs)
    ids = torch.zeros(batch, dtype=torch.int64, device=dev)
    return ModelInput(ids, torch.full((batch,), pos, device=dev), meta, torch.arange(batch, device=dev))


def check_decode(device: str, model: str = "qwen3-0.6b-shape", dtype: str = "bfloat16",
                 batches=(1, 8, 32, 128), context: int = 512) -> list[dict]:
    rows = {b: {"batch": b, "context": context} for b in batches}
    for mode in ("eager", "graphs"):
        options = {k: v for k, v in MODES[device][mode].items() if k != "torch_compile"}
        llm = LLM(model, device=device, dtype=dtype, max_num_seqs=max(batches), max_model_len=4096,
                  kv_cache_memory_gb=12 if device == "cuda" else 0.05, **options)
        runner = llm.engine.executor.runner
        assert (runner.graphs is not None) == (mode == "graphs")
        for b in batches:
            inp = decode_input(runner, b, context)
            rows[b][f"{mode}_ms"] = median_ms(runner.execute, (inp,), runner.device)
        rows[max(batches)][f"{mode}_graph_memory_mb"] = runner.graph_memory_bytes / 2**20
        del llm, runner
        free_memory()
    return list(rows.values())


def table(rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--only", default="ops,tokens,decode", help="comma-separated: ops, tokens, decode")
    ap.add_argument("--models", default="tiny-qwen3,smollm2-135m",
                    help="comma-separated models for the token check on CUDA (--smoke: tiny-qwen3)")
    ap.add_argument("--smoke", action="store_true",
                    help="on CPU: tokens and decode on tiny-qwen3 through the graphs' stand-in "
                         "(checks this script)")
    args = ap.parse_args()
    want = set(args.only.split(","))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run_engines = device.type == "cuda" or args.smoke
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__}
    sections = []
    if "ops" in want:
        result["ops"] = check_ops(device)
        sections.append(f"## compiled vs eager ops ({result['device']})\n\n" + table(result["ops"]))
    if run_engines and "tokens" in want:
        small = (dict(models=("tiny-qwen3",), dtypes=("float32",)) if device.type == "cpu" else
                 dict(models=tuple(m for m in args.models.split(",") if m)))
        result["tokens"] = check_tokens(device.type, **small)
        sections.append("## greedy tokens: graphs and compiled ops vs eager\n\n" + table(result["tokens"]))
    if run_engines and "decode" in want:
        small = dict(model="tiny-qwen3", dtype="float32", batches=(1, 8)) if device.type == "cpu" else {}
        try:
            result["decode"] = check_decode(device.type, **small)
        except Exception as e:  # noqa: BLE001
            result["decode"] = [{"error": f"{type(e).__name__}: {str(e).strip()[:300]}"}]
        sections.append("## decode step (forward + logits), eager vs graphs\n\n" + table(result["decode"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "graphs_check.json").write_text(json.dumps(result, indent=1))
    text = "\n\n".join(sections) + "\n"
    (out / "graphs_check.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
