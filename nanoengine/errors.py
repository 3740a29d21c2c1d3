"""nanoengine's exceptions. Chapter 00.

Every mistake in what a user passes (an engine option, sampling parameters, a prompt, chat messages, a
checkpoint) raises one of these, with a message that names the parameter, tensor or file, the value, and what
is allowed. They subclass ValueError or TypeError, so code written for vLLM (`except ValueError`) keeps
working. `WorkerError` is not an input error: a tensor-parallel worker failed (a RuntimeError).
"""

from __future__ import annotations


class NanoengineError(Exception):
    """Base class: `except NanoengineError` catches every input error nanoengine raises."""


class InvalidValueError(NanoengineError, ValueError):
    """A value of the right type that is not allowed (out of range, empty, too long, inconsistent)."""


class InvalidTypeError(NanoengineError, TypeError):
    """A value of the wrong type."""


class CheckpointError(InvalidValueError):
    """A model folder that cannot be loaded: a missing, corrupt or truncated file, a missing or mis-shaped
    tensor, an unsupported architecture, or a tokenizer that does not match the model."""


class ModelNotFoundError(CheckpointError, FileNotFoundError):
    """A model that is neither an asset name nor a folder with a config.json (also a FileNotFoundError)."""


class ExerciseError(NanoengineError):
    """The learner's code plugged into the engine (`use_exercises`, nanoengine.pieces) failed or gave a result
    the engine cannot use; the message names the exercise and its file."""


class ExerciseNotDoneError(ExerciseError, NotImplementedError):
    """A piece asked for with `use_exercises` is still the untouched stub of its exercise."""


class WorkerError(RuntimeError):
    """A tensor-parallel worker raised, exited or was killed; the message carries its traceback or its end."""


class StructuredOutputsError(InvalidValueError):
    """A structured-outputs request the library cannot compile; `param` names the field (the server's 400)."""

    def __init__(self, message: str, param: str = "structured_outputs") -> None:
        super().__init__(message)
        self.param = param
