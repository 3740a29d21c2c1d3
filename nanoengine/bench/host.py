"""`nanoengine bench --host-only`: the host's work per decode step, with the model stubbed out. Chapters 06
and 08.

On a GPU a CUDA-graph decode step of a small model takes a few milliseconds, and whatever the host does
between two launches is time the GPU may sit idle. This benchmark runs the real engine loop (scheduler,
input builder, executor, sampler, update, detokenizer, stats) over a `StubExecutor`: no model, no KV
cache; each sampled row gets random logits over a small vocabulary (so the sampler still draws, in
microseconds), and tokens come back as they would from a device. At batch 1, 32 and 256 (decode steps only:
every request is prefilled before the measured window), with overlap scheduling off and on, it reports the
milliseconds of one `LLMEngine.step` call and their split:
- schedule: Scheduler.schedule (picking the batch and committing it: its tokens count as computed);
- build: InputBuilder.build and the sampler's parameters;
- launch: handing the step to the executor (with overlap on CPU: to its thread);
- wait: waiting for the tokens (with overlap, for the step launched in the call before);
- update: Scheduler.update (sampled tokens in place, blocks cached, stop rules);
- detokenize: Completion.push (incremental detokenization, stop strings);
- other: the rest of the call (request metrics, StepStats, the loop itself).
"critical path" is everything but the wait: with overlap on it runs while the device computes the step
launched just before, so it is hidden whenever the forward takes longer.
It runs each batch twice: with the text made as LLM.generate makes it (once, when a request ends) and
streamed (a text delta per token, as LLM.stream and the server).
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nanoengine import SamplingParams, assets, pieces
from nanoengine.bench import hardware
from nanoengine.bench.report import _slug, write_json
from nanoengine.config import EngineConfig
from nanoengine.engine.executor import Executor
from nanoengine.engine.inputs import ModelInput
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.engine.parts import EngineParts, assemble
from nanoengine.plan import EnginePlan, resolve_plan
from nanoengine.tokenizer import load_tokenizer
from nanoengine.trace import StepStats

STUB_VOCAB = 64  # the stub's logits cover token ids 0..63 (single characters in Qwen3's vocabulary)
PHASES = ("schedule", "build", "launch", "wait", "update", "detokenize", "other")


class StubExecutor(Executor):
    """An executor without a model: random logits [num_sampled, STUB_VOCAB] for every step."""

    def __init__(self, plan: EnginePlan, parts: EngineParts, num_blocks: int, seed: int = 0) -> None:
        self.blocks = num_blocks
        self.generator = torch.Generator().manual_seed(seed)
        self.sampler = parts.sampler  # the engine's draw, over the random logits

    @property
    def num_kv_blocks(self) -> int:
        return self.blocks

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def run_step(self, model_input: ModelInput, prev_tokens: torch.Tensor | None) -> torch.Tensor | None:
        if model_input.prev_sampled and (prev_tokens is None or len(prev_tokens) != model_input.prev_sampled):
            raise RuntimeError("the stub got a step that reads tokens it does not have")
        n = model_input.num_sampled
        return torch.randn(n, STUB_VOCAB, generator=self.generator) if n else None

    def run_rpc(self, method: Any, args: tuple) -> list[Any]:
        raise NotImplementedError("the stub executor has no model to call")

    def stop_ranks(self) -> None:
        pass


def stub_engine(model: str, async_scheduling: bool, num_blocks: int, seed: int = 0,
                executor: Callable[..., Executor] = StubExecutor, scheduler_class: type | None = None,
                **options: Any) -> LLMEngine:
    """The real engine loop over a stub executor (`executor(plan, parts, num_blocks, seed)`) with `num_blocks`
    KV blocks; `options` are engine options (CPU, float32, torch attention by default)."""
    from transformers import AutoConfig

    options = {"device": "cpu", "dtype": "float32", "attention_backend": "torch", **options}
    config = EngineConfig.from_kwargs(model=model, async_scheduling=async_scheduling, num_kvcache_blocks=1,
                                      seed=seed, **options)
    path = assets.resolve_model(model)
    plan = resolve_plan(config, AutoConfig.from_pretrained(path), path, pieces.NO_PIECES)
    parts = assemble(plan)
    if scheduler_class is not None:
        parts = dataclasses.replace(parts, scheduler_class=scheduler_class)
    return LLMEngine(config, plan, parts, executor(plan, parts, num_blocks, seed), load_tokenizer(path))


def timed_steps(eng: LLMEngine, steps: int) -> tuple[list[float], list[StepStats]]:
    """Seconds of each of `steps` engine steps, after 3 more into a steady state, and the StepStats of the
    steps they finished."""
    for _ in range(3):
        eng.step()
    walls, stats = [], []
    for _ in range(steps):
        t = time.perf_counter()
        result = eng.step()
        walls.append(time.perf_counter() - t)
        if result.stats is not None:
            stats.append(result.stats)
    return walls, stats


def measure(model: str, batch: int, async_scheduling: bool, steps: int = 200, seed: int = 0,
            streaming: bool = False) -> dict[str, Any]:
    """Milliseconds per decode step at `batch` running sequences (prompts uniform in 100..1024 tokens, as
    nano-vllm's benchmark; sampling at temperature 0.6), split by phase (see the module docstring). Text as
    LLM.generate makes it (once, at the end), or with `streaming` a delta per token (LLM.stream, the
    server)."""
    rng = random.Random(seed)
    prompt_lens = [rng.randint(100, 1024) for _ in range(batch)]
    budget = 4096
    # the first prompts decode while the last ones are prefilled: room for that, so that every measured step
    # runs the whole batch
    max_tokens = steps + 4 + -(-sum(prompt_lens) // budget)
    max_len = max(prompt_lens) + max_tokens
    eng = stub_engine(model, async_scheduling, batch * -(-max_len // 16) + 16, seed, max_num_seqs=batch,
                      max_num_batched_tokens=max(budget, max_len), block_size=16)
    vocab = min(eng.plan.hf_config.vocab_size, 10_000)
    params = SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True)
    for n in prompt_lens:
        eng.add(eng.make_request([rng.randrange(vocab) for _ in range(n)], params, final_only=not streaming))
    while any(s.is_prefill for s in eng.scheduler.running + list(eng.scheduler.waiting)):
        eng.step()  # prefill every prompt (stubbed: costs only the host's part)
    walls, stats = timed_steps(eng, steps)
    stats = [s for s in stats if s.prefill_tokens == 0 and s.num_seqs == batch]
    eng.close()
    if len(stats) < steps - 1:  # (with overlap the last one is still in flight)
        raise RuntimeError(f"only {len(stats)} of {steps} measured steps decoded the whole batch of {batch}")

    def ms(values: list[float]) -> float:
        return 1e3 * statistics.fmean(values)

    wait = ms([s.wait_s for s in stats])
    phases = {"schedule": ms([s.schedule_s for s in stats]), "build": ms([s.prepare_s for s in stats]),
              "launch": ms([s.forward_s - s.wait_s for s in stats]), "wait": wait,
              "update": ms([s.postprocess_s - s.detokenize_s for s in stats]),
              "detokenize": ms([s.detokenize_s for s in stats])}
    step_ms = ms(walls)
    phases["other"] = max(0.0, step_ms - sum(phases.values()))
    return {"batch": batch, "async_scheduling": async_scheduling, "streaming": streaming,
            "steps": len(stats), "step_ms": step_ms,
            "critical_path_ms": step_ms - wait, "phases_ms": phases,
            "median_step_ms": 1e3 * statistics.median(walls)}


def with_json(result: dict[str, Any], out_dir: str | Path | None) -> dict[str, Any]:
    """The result, written to out_dir as JSON named by its workload, model, CPU and torch (its path in
    result["json_path"])."""
    if out_dir is not None:
        hw = result["hardware"]
        where = _slug(hw.get("cpu") or "cpu")
        name = f"{result['workload']}_{_slug(Path(result['model']).name)}_{where}_torch{_slug(hw['torch'])}"
        result["json_path"] = str(write_json(result, out_dir, name))
    return result


def measure_backlog(model: str, num_waiting: int, num_running: int = 64, steps: int = 100, seed: int = 0,
                    **options: Any) -> dict[str, Any]:
    """Milliseconds per decode step at `num_running` decoding sequences on a full KV pool (not one block
    free) with `num_waiting` requests queued behind them that cannot start (prompts uniform in 100..1024
    tokens). Blocks of 256 tokens and running prompts of 256k + 1 tokens: a running sequence's last block has
    room for 255 decodes, so nothing is preempted and nothing admitted in the measured steps; what the queue
    costs is only admission's attempt on it. options: engine options (e.g. scheduling_policy)."""
    rng = random.Random(seed)
    block = 256
    prompt_lens = [block * rng.randint(0, 3) + 1 for _ in range(num_running)]
    if steps + 8 >= block:
        raise ValueError(f"backlog: at most {block - 9} steps fit one block's decodes, got {steps}")
    eng = stub_engine(model, False, sum(-(-n // block) for n in prompt_lens), seed, block_size=block,
                      max_num_seqs=max(256, num_running), max_num_batched_tokens=4096, **options)
    vocab = min(eng.plan.hf_config.vocab_size, 10_000)
    params = SamplingParams(temperature=0.6, max_tokens=block - 2, ignore_eos=True)
    for n in prompt_lens:
        eng.add(eng.make_request([rng.randrange(vocab) for _ in range(n)], params, final_only=True))
    while any(s.is_prefill for s in eng.scheduler.running + list(eng.scheduler.waiting)):
        eng.step()
    if eng.block_manager.num_free_blocks or len(eng.scheduler.running) != num_running:
        raise RuntimeError("backlog: the pool should be full with every sequence running")
    for _ in range(num_waiting):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(100, 1024))]
        eng.add(eng.make_request(prompt, SamplingParams(max_tokens=16), final_only=True))
    walls, stats = timed_steps(eng, steps)
    sch = eng.scheduler
    ok = all(s.num_seqs == num_running and s.prefill_tokens == 0 for s in stats)
    left = len(sch.waiting)
    eng.close()
    if not ok or left != num_waiting:
        raise RuntimeError(f"backlog: the measured steps should decode the {num_running} running sequences "
                           f"only and admit none (waiting: {left} of {num_waiting})")
    return {"num_waiting": num_waiting, "num_running": num_running, "steps": steps,
            "step_ms": 1e3 * statistics.fmean(walls), "median_step_ms": 1e3 * statistics.median(walls),
            "schedule_ms": 1e3 * statistics.fmean(s.schedule_s for s in stats),
            "options": options}


def backlog_bench(model: str = "qwen3-0.6b-shape", waiting: tuple[int, ...] = (0, 1_000, 10_000),
                  steps: int = 100, seed: int = 0, out_dir: str | Path | None = None) -> dict[str, Any]:
    """`measure_backlog` at each queue length, under both admission policies."""
    from nanoengine.config import SCHEDULING_POLICIES

    rows = [{**measure_backlog(model, n, steps=steps, seed=seed, scheduling_policy=policy),
             "policy": policy} for policy in SCHEDULING_POLICIES for n in waiting]
    result = {"model": model, "workload": "host-only-backlog", "rows": rows,
              "hardware": hardware.describe("cpu"),
              "what": "host ms per step of 64 decoding sequences on a full KV pool, with N requests waiting "
                      "that cannot start (model stubbed)"}
    return with_json(result, out_dir)


def backlog_report(result: dict[str, Any]) -> str:
    lines = [f"host work per step, {result['rows'][0]['num_running']} decodes on a full pool, N waiting "
             f"({result['model']}, model stubbed)",
             f"{'policy':>10} {'waiting':>8} {'step ms':>8} {'median':>8} {'schedule':>8}"]
    lines += [f"{r['policy']:>10} {r['num_waiting']:>8} {r['step_ms']:>8.3f} {r['median_step_ms']:>8.3f} "
              f"{r['schedule_ms']:>8.3f}" for r in result["rows"]]
    if "json_path" in result:
        lines.append(f"JSON: {result['json_path']}")
    return "\n".join(lines)


def host_bench(model: str = "qwen3-0.6b-shape", batches: tuple[int, ...] = (1, 32, 256), steps: int = 200,
               seed: int = 0, out_dir: str | Path | None = None) -> dict[str, Any]:
    rows = [measure(model, b, overlap, steps, seed, streaming) for streaming in (False, True) for b in batches
            for overlap in (False, True)]
    result = {"model": model, "workload": "host-only", "batches": list(batches), "steps_per_batch": steps,
              "hardware": hardware.describe("cpu"), "rows": rows,
              "what": "host ms per decode step of the real engine loop over a stub executor (random logits "
                      f"over {STUB_VOCAB} ids); critical path = all but waiting for the tokens"}
    return with_json(result, out_dir)


def report(result: dict[str, Any]) -> str:
    head = (f"{'text':>9} {'batch':>5} {'overlap':>7} {'step ms':>8} {'critical':>8} "
            + " ".join(f"{p:>11}" for p in PHASES))
    lines = [f"host work per decode step ({result['model']}, model stubbed; text: at the end as "
             "LLM.generate, or streamed)", head]
    for r in result["rows"]:
        lines.append(f"{('streamed' if r['streaming'] else 'at end'):>9} {r['batch']:>5} "
                     f"{('on' if r['async_scheduling'] else 'off'):>7} {r['step_ms']:>8.3f} "
                     f"{r['critical_path_ms']:>8.3f} "
                     + " ".join(f"{r['phases_ms'][p]:>11.3f}" for p in PHASES))
    if "json_path" in result:
        lines.append(f"JSON: {result['json_path']}")
    return "\n".join(lines)


def main(args: Any) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = args.model or "qwen3-0.6b-shape"
    if args.backlog:
        print(backlog_report(backlog_bench(model, steps=min(args.steps, 100), seed=args.seed,
                                           out_dir=args.out_dir)))
        return 0
    print(report(host_bench(model, steps=args.steps, seed=args.seed, out_dir=args.out_dir)))
    return 0
