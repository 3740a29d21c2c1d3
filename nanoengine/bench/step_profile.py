"""Single-stream decode speed, and where one decode step's time goes. Chapters 06 and 08.

`single_stream(llm)` runs one request (256 prompt tokens, greedy) twice through the engine:
- plainly, for the decode speed a learner chatting with the model sees: tokens/s = 1 / TPOT (the mean gap
  between its output tokens after the first);
- with timers on the model's modules, for the split of a decode step into
  - linears: every projection, and the LM head (`PackableLinear` modules);
  - attention: the attention backend (K/V store and the decode kernel);
  - other: the rest of the forward and the sampler (embedding, norms, rotary, SwiGLU, logits to float32,
    sampling, and Python between the ops);
  - host: the engine outside the model runner (scheduling, building inputs, postprocess and detokenizing).
The timers are forward hooks (two clock reads per module call), and, where a decode step runs its layers in
one C++ call (`models/fused_decode.py`), that call's own clocks around its linears and attention; the split
comes from the timed run, the tokens/s from the plain one. On CPU every op runs synchronously, so the clock
reads time the ops themselves; on CUDA they would time launches only, so the split is CPU-only.
"""

from __future__ import annotations

import random
import time
from contextlib import contextmanager
from typing import Any

from torch import nn

from nanoengine import LLM, SamplingParams
from nanoengine.attention import AttentionBackend
from nanoengine.layers.linear import PackableLinear

PARTS = ("linears", "attention", "other", "host")


@contextmanager
def module_timers(model: nn.Module):
    """Seconds spent in the model's linears and attention modules while the context is open:
    yields a dict {"linears": s, "attention": s, "calls": n} that fills as the model runs."""
    totals = {"linears": 0.0, "attention": 0.0, "calls": 0}
    handles = []
    for module in model.modules():
        kind = ("linears" if isinstance(module, PackableLinear)
                else "attention" if isinstance(module, AttentionBackend) else None)
        if kind is None:
            continue

        def start(mod, args, kind=kind):
            mod._step_profile_t0 = time.perf_counter()

        def stop(mod, args, out, kind=kind):
            totals[kind] += time.perf_counter() - mod._step_profile_t0
            totals["calls"] += 1

        handles += [module.register_forward_pre_hook(start), module.register_forward_hook(stop)]
    try:
        yield totals
    finally:
        for h in handles:
            h.remove()


@contextmanager
def fused_timers(runner: Any):
    """The fused decode step's own timers (nanoengine.models.fused_decode), where the runner has one: its
    layers run in one C++ call, so no module hook fires inside them. Yields {"linears", "attention"}
    seconds."""
    if runner.fused is None:
        yield {}
        return
    with runner.fused.timed() as totals:
        yield totals


def _decode_run(llm: LLM, prompt: list[int], output_len: int) -> tuple[Any, list[Any]]:
    """One greedy request through the engine: (its output, the StepStats of its decode steps)."""
    engine = llm.engine
    engine.clear_stats()
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return out, [s for s in engine.stats if s.prefill_tokens == 0 and s.num_seqs]


def single_stream(llm: LLM, prompt_len: int = 256, output_len: int = 64, seed: int = 0) -> dict[str, Any]:
    """Decode tokens/s of one stream and the per-step split (ms) of its decode steps
    (see the module docstring)."""
    plan = llm.plan
    prompt_len = max(1, min(prompt_len, plan.max_model_len - output_len - 1))
    rng = random.Random(seed)
    prompt = [rng.randrange(min(plan.hf_config.vocab_size, 10_001)) for _ in range(prompt_len)]
    out, _ = _decode_run(llm, prompt, output_len)
    m = out.metrics
    tpot = (m.finished_time - m.first_token_time) / max(1, output_len - 1)
    runner = llm.engine.executor.runner  # rank 0's
    with module_timers(runner.model) as totals, fused_timers(runner) as fused:
        _, steps = _decode_run(llm, prompt, output_len)
    for part in ("linears", "attention"):
        totals[part] += fused.get(part, 0.0)
    n = max(1, len(steps))
    forward = sum(s.forward_s for s in steps) / n
    host = sum(s.schedule_s + s.prepare_s + s.postprocess_s for s in steps) / n
    linears, attention = totals["linears"] / n, totals["attention"] / n
    split = {"linears": linears, "attention": attention, "other": max(0.0, forward - linears - attention),
             "host": host}
    step = sum(split.values())
    llm.engine.clear_stats()
    return {"prompt_tokens": prompt_len, "output_tokens": output_len,
            "decode_tokens_per_s": 1 / tpot if tpot > 0 else None, "tpot_ms": 1e3 * tpot,
            "step_ms": {k: 1e3 * v for k, v in split.items()},
            "step_fraction": {k: v / step if step else 0.0 for k, v in split.items()},
            "profiled_step_ms": 1e3 * step, "profiled_steps": len(steps),
            "what": "one greedy request: tokens/s from a plain run (1 / TPOT); the split from a second run "
                    "with timers on the linears and attention modules (other = rest of the forward and "
                    "sampling; host = schedule + inputs + postprocess)"}
