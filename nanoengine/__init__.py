"""nanoengine: a small, fast, readable LLM inference engine (the book's finished package).

    from nanoengine import LLM, SamplingParams
    llm = LLM("smollm2-135m")            # an asset name or a local Hugging Face folder
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    llm = LLM("tiny-qwen3", use_exercises=["ch02", "ch03"])  # the same engine on your exercises' pieces

Names are imported lazily, so `import nanoengine.engine.scheduler` stays free of torch.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "nanoengine.llm",
    "SamplingParams": "nanoengine.sampling_params",
    "RequestOutput": "nanoengine.outputs",
    "CompletionOutput": "nanoengine.outputs",
    "EngineConfig": "nanoengine.config",
    "use_exercises": "nanoengine.pieces",
}
_SUBMODULES = {"check", "assets", "viz", "pieces"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    if name in _SUBMODULES:  # the check, assets and viz submodules as attributes after `import nanoengine`
        return import_module(f"nanoengine.{name}")
    raise AttributeError(f"module 'nanoengine' has no attribute {name!r}")
