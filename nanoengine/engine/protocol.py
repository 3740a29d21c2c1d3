"""The engine protocol: what `LLM`, `nanoengine serve` and `nanoengine bench` ask of an engine. Chapter 05.

`LLMEngine` speaks it, and so can an engine of your own, however it is built inside:
`LLM.from_engine(engine)` runs it offline, `nanoengine serve --engine module:factory` serves it over HTTP, and
`nanoengine bench --engine module:factory` measures it (the factory is called with the model, a path or an
asset name, and returns the engine).

A request travels as a `Request` (engine/request.py): its prompt and SamplingParams, and per completion a
`Sequence` (its tokens, status and finish reason) and a `Completion` (its text and stop strings);
`new_request` makes one, checked. `step()` returns a `StepResult` (engine/step.py): the text deltas, the
tokens each sequence got, the requests it finished, and optionally its `StepStats` (None: the engine keeps
none). `plan` states the engine's facts by EnginePlan's names (max_model_len, block_size, device, dtype, ...):
the server shows those it has. An engine that keeps a step in flight between calls (overlap) also has
`drain()`, which finishes it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from nanoengine.errors import InvalidTypeError, InvalidValueError

if TYPE_CHECKING:
    from nanoengine.engine.request import Request
    from nanoengine.engine.step import EngineLoad, StepResult
    from nanoengine.sampling_params import SamplingParams

METHODS = ("make_request", "add", "step", "abort", "has_unfinished", "load", "close")


@runtime_checkable
class Engine(Protocol):
    tokenizer: Any  # a Hugging Face tokenizer (chat templates, decoding)
    plan: Any  # the engine's facts, by EnginePlan's names

    def make_request(self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None,
                     final_only: bool = False) -> Request:
        """Tokenize and check a request without queueing it (a bad one raises here, naming the problem)."""

    def add(self, request: Request) -> None:
        """Queue a request made by make_request."""

    def step(self) -> StepResult:
        """Run one step; what it finished."""

    def abort(self, request_id: str) -> None:
        """Forget a request: stop it if it runs (a finished one just lets go)."""

    def has_unfinished(self) -> bool:
        """Whether step() has work."""

    def load(self) -> EngineLoad:
        """How busy it is: running and waiting sequences, used and total KV blocks."""

    def close(self) -> None:
        """Release what it holds."""


def check_engine(engine: Any, where: str = "the engine") -> Engine:
    """`engine` if it speaks the protocol, else an error naming what it lacks."""
    missing = [m for m in METHODS if not callable(getattr(engine, m, None))]
    missing += [a for a in ("tokenizer", "plan") if not hasattr(engine, a)]
    if missing:
        raise InvalidTypeError(f"{where} ({type(engine).__name__}) does not speak the engine protocol: it "
                               f"has no {', '.join(missing)}; see nanoengine/engine/protocol.py")
    return engine


def load_engine(spec: str, model: str, **options: Any) -> Engine:
    """The engine `module:factory` makes for `model` (factory(model, **options)), checked."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise InvalidValueError(f"--engine {spec!r}: give module:factory, e.g. my_engine:make_engine (the "
                                "module importable from here, the factory called with the model)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise InvalidValueError(f"--engine {spec!r}: cannot import {module_name!r} ({e}); run from its "
                                "folder or put it on PYTHONPATH") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise InvalidValueError(f"--engine {spec!r}: {module_name} has no callable {name!r}")
    return check_engine(factory(model, **options), f"--engine {spec!r}")
