"""Building an engine: the one place where what the user asked for becomes a running engine. Chapter 00.

    settings (EngineConfig) ─▶ plan (EnginePlan) ─▶ parts (EngineParts) ─▶ executor ─▶ LLMEngine

`build_engine(model, **options)` checks the options (`config.py`), reads the checkpoint's config and applies
the `use_exercises()` default to pick the learner's pieces (`pieces`), resolves everything against the
checkpoint and the machine (`plan.py`), assembles the parts (`engine/parts.py`), starts the executor
(`start_executor`) and hands all of it to the step loop. Under a launcher (torchrun) every rank runs this:
rank 0 goes on to the step loop, the others serve its steps and exit when it closes. `LLM` and `nanoengine
serve` build their engines here.
"""

from __future__ import annotations

from typing import Any

from nanoengine import assets, pieces
from nanoengine.config import EngineConfig
from nanoengine.distributed import launcher
from nanoengine.engine.executor import Executor, UniprocExecutor
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.engine.parts import EngineParts, assemble
from nanoengine.errors import CheckpointError
from nanoengine.plan import EnginePlan, resolve_plan
from nanoengine.tokenizer import load_tokenizer


def start_executor(plan: EnginePlan, parts: EngineParts, launch: launcher.Launched | None = None) -> Executor:
    """One rank in this process, or (tensor parallelism) rank 0 here and the others in worker processes (or
    a launcher's ranks)."""
    if plan.tensor_parallel_size == 1:
        return UniprocExecutor(plan, parts)
    from nanoengine.distributed.executor import MultiprocExecutor  # (imported only for tensor parallelism)

    return MultiprocExecutor(plan, parts, launch)


def build_engine(model: str = assets.DEFAULT_MODEL, **options: Any) -> LLMEngine:
    from transformers import AutoConfig

    config = EngineConfig.from_kwargs(model=str(model), **options)
    model_path = assets.resolve_model(model)
    hf_config = AutoConfig.from_pretrained(model_path)
    chosen = pieces.selected(config.use_exercises, config.exercises_dir)  # the use_exercises() default here
    launch = launcher.launched()  # torchrun's ranks: every one runs this
    plan = resolve_plan(config, hf_config, model_path, chosen, launch)
    if plan.attention_backend == "cpu" and config.attention_backend == "auto":
        from nanoengine.kernels import cpu as cpu_kernels

        try:  # the plan never compiles: built here if `make assets` did not build them
            cpu_kernels.load()
        except cpu_kernels.KernelBuildError:  # remembered now, so the plan picks torch's ops
            plan = resolve_plan(config, hf_config, model_path, chosen, launch)
    if launch is not None and launch.rank != 0:
        from nanoengine.distributed.worker import serve_launched_rank

        serve_launched_rank(plan, launch)  # serves rank 0's steps; exits the process when it closes
    tokenizer = load_tokenizer(model_path)
    if len(tokenizer) > hf_config.vocab_size:
        raise CheckpointError(f"{model_path}: the tokenizer has {len(tokenizer)} tokens but the model's "
                              f"vocab_size is {hf_config.vocab_size}; "
                              "the tokenizer files belong to another model")
    parts = assemble(plan)
    executor = start_executor(plan, parts, launch)
    try:
        return LLMEngine(config, plan, parts, executor, tokenizer, build_engine)
    except BaseException:
        executor.close()
        raise
