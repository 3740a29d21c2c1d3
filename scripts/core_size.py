"""How big the engine's core is, measured the way the house states its targets (../shared/DESIGN.md):

- the reading path: the files a reader opens to read what nano-vllm covers (the Qwen3 forward, paged KV and
  the block manager, prefix caching, the scheduler, the model runner, the sampler, `LLM.generate`, CUDA
  graphs, tensor parallelism), with their lines (docstrings and comments count: a learner reads them);
- the branches on a named extension in the five core files (scheduler, input builder, engine loop, model
  runner, executor): `if`, conditional-expression and `while` tests whose source names one (speculation,
  logprobs, overlap, structured outputs, graphs, the learner's pieces, int8/bf16 copies, MoE, traces/stats).
  The rule is that there are none: an extension enters at a declared hook (engine/hooks.py), and
  tests/test_architecture.py checks it with `extension_branches`;
- the modules one decode step enters (`sys.setprofile` over `LLMEngine.step()`, tiny-qwen3 on CPU, after a
  prefill), the engine's and the model's apart.

    python scripts/core_size.py            # all three
    python scripts/core_size.py --no-step  # without running a model
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

READING_PATH = """
    llm.py sampling_params.py outputs.py launch.py
    engine/llm_engine.py engine/step.py engine/request.py engine/hooks.py engine/parts.py
    engine/scheduler.py engine/scheduler_output.py engine/pending.py engine/sequence.py
    engine/block_manager.py engine/inputs.py engine/host_buffers.py engine/sampling.py
    engine/executor.py engine/model_runner.py engine/graphs.py
    models/qwen3.py models/llama.py models/loader.py
    layers/norm.py layers/rotary.py layers/activation.py layers/linear.py layers/embedding.py
    layers/sampler.py layers/tp_group.py attention/base.py attention/metadata.py attention/torch_backend.py
    distributed/executor.py distributed/ranks.py distributed/workers.py distributed/worker.py
    distributed/channel.py
""".split()

CORE_FILES = ["engine/scheduler.py", "engine/inputs.py", "engine/llm_engine.py", "engine/model_runner.py",
              "engine/executor.py"]
EXTENSION_NAMES = re.compile(
    r"spec|draft|logprob|prompt_rows|overlap|in_flight|async|struct|grammar|graph|fused|piece|learner|"
    r"attention_metadata|exercise|int8|bf16|quant|moe|expert|trace|stats", re.IGNORECASE)
MODEL_PACKAGES = ("models", "layers", "attention", "kernels")


def reading_path(root: Path = ROOT) -> list[tuple[str, int]]:
    """(file, lines) of each file on the reading path."""
    package = root / "nanoengine"
    return [(f, len((package / f).read_text().splitlines())) for f in READING_PATH]


def extension_branches(root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(file, line, test) of each branch on a named extension in the five core files."""
    found = []
    for f in CORE_FILES:
        source = (root / "nanoengine" / f).read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.If, ast.IfExp, ast.While)):
                test = ast.get_source_segment(source, node.test) or ""
                if EXTENSION_NAMES.search(test):
                    found.append((f, node.lineno, test))
    return found


def decode_step_modules(steps: int = 4) -> Counter[str]:
    """How many calls `steps` decode steps make into each nanoengine module (tiny-qwen3, default options)."""
    from nanoengine import LLM, SamplingParams

    engine = LLM("tiny-qwen3").engine
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=steps + 3, temperature=0))
    engine.step()  # the prefill
    engine.step()
    calls: Counter[str] = Counter()

    def count(frame, event, arg):  # noqa: ANN001, ANN202 - sys.setprofile's signature
        name = frame.f_globals.get("__name__", "")
        if event == "call" and name.startswith("nanoengine"):
            calls[name] += 1

    sys.setprofile(count)
    try:
        for _ in range(steps):
            engine.step()
    finally:
        sys.setprofile(None)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-step", action="store_true", help="skip the decode step (no model run)")
    args = parser.parse_args()
    files = reading_path()
    print(f"reading path: {len(files)} files, {sum(n for _, n in files)} lines")
    for f, n in sorted(files, key=lambda x: -x[1]):
        print(f"  {n:5d}  nanoengine/{f}")
    branches = extension_branches()
    print(f"branches on a named extension in the five core files: {len(branches)}")
    for f, line, test in branches:
        print(f"  {f}:{line}: {test}")
    if not args.no_step:
        steps = 4
        calls = decode_step_modules(steps)
        model = sorted(m for m in calls if m.split(".")[1] in MODEL_PACKAGES)
        engine = sorted(m for m in calls if m not in model)
        print(f"modules one decode step enters: {len(calls)} ({len(engine)} the engine's, {len(model)} the "
              "model's)")
        for m in engine + model:
            print(f"  {calls[m] / steps:6.1f} calls a step  {m}")


if __name__ == "__main__":
    main()
