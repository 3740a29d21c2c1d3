"""Loading the learner's chapter files and wrapping their functions for the engine. All chapters.

`load(chapter, folder)` imports `chNN_*.py` from the folder by path, afresh on every call (so an edited
exercise is picked up by the next `LLM`). `piece(module, name)` returns the function with errors turned into
messages that name the exercise and the file: an untouched stub is an `ExerciseNotDoneError` as soon as the
engine is built, and anything a piece raises inside the engine is an `ExerciseError` naming that piece.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import re
import sys
import textwrap
from collections.abc import Callable
from itertools import count
from pathlib import Path
from types import ModuleType
from typing import Any

from nanoengine.errors import ExerciseError, ExerciseNotDoneError, InvalidValueError

_loads = count()
_EXERCISE = re.compile(r"Exercise (\d+\.\d+)")


def load(chapter: str, folder: Path) -> ModuleType:
    """A fresh import of folder/chNN_*.py (one file per chapter)."""
    files = sorted(folder.glob(f"{chapter}_*.py"))
    if len(files) != 1:
        found = "no file" if not files else f"{len(files)} files ({', '.join(f.name for f in files)})"
        raise InvalidValueError(f"use_exercises: {chapter} needs one {chapter}_*.py in {folder}, found "
                                f"{found}; regenerate exercises with `python scripts/make_exercises.py`, or "
                                "point exercises_dir at the folder with your chapter files")
    name = f"_nanoengine_pieces_{next(_loads)}_{files[0].stem}"
    spec = importlib.util.spec_from_file_location(name, files[0])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses in the file look their module up here
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ExerciseError(f"use_exercises: importing {files[0]} failed with {type(e).__name__}: {e}") from e
    return module


def python_function(fn: Any) -> Any:
    """The Python function behind a @triton.jit kernel (its `fn`), or `fn` itself."""
    return fn.fn if type(fn).__module__.startswith("triton") and callable(getattr(fn, "fn", None)) else fn


def exercise_of(fn: Callable) -> str:
    """The exercise a function (or a Triton kernel) is ("3.4"), from its docstring."""
    m = _EXERCISE.search(inspect.getdoc(python_function(fn)) or "")
    return m.group(1) if m else "?"


def is_stub(fn: Callable) -> bool:
    """Is the function's (or Triton kernel's) body, after its docstring, only the generated
    `raise NotImplementedError(...)`?"""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(python_function(fn))))
    except (OSError, TypeError, SyntaxError):
        return False
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def where(module: ModuleType, name: str) -> str:
    return f"{name} in {module.__file__}"


def not_done(module: ModuleType, name: str, fn: Callable, chapter: str) -> ExerciseNotDoneError:
    n = exercise_of(fn)
    return ExerciseNotDoneError(
        f"use_exercises: your Exercise {n} ({where(module, name)}) is still a stub, so the engine cannot run "
        f"on it. Finish it (check(\"{n}\") shows its tests), or leave {chapter!r} out of use_exercises.")


def check_done(pieces: list[tuple[ModuleType, str, str]]) -> None:
    """Raise one ExerciseNotDoneError naming every (module, name, chapter) that is still a stub (an
    ExerciseError for one that is missing)."""
    missing = [(m, n, c) for m, n, c in pieces if _attr(m, n) is None]
    if missing:
        m, n, c = missing[0]
        raise ExerciseError(f"use_exercises: {m.__file__} has no {n!r}; {c}'s pieces need it (regenerate the "
                            "file from solutions/ if you renamed it)")
    stubs = [(m, n, c) for m, n, c in pieces if is_stub(_attr(m, n))]
    if len(stubs) == 1:
        raise not_done(*stubs[0][:2], _attr(*stubs[0][:2]), stubs[0][2])
    if stubs:
        listed = "; ".join(f"Exercise {exercise_of(_attr(m, n))} ({n} in {Path(m.__file__).name})"
                           for m, n, _ in stubs)
        chapters = sorted({c for _, _, c in stubs})
        raise ExerciseNotDoneError(f"use_exercises: {len(stubs)} of your exercises are still stubs, so the "
                                   f"engine cannot run on them: {listed}. Finish them "
                                   f"(check(\"{chapters[0]}\") shows their tests), or leave "
                                   f"{', '.join(map(repr, chapters))} out of use_exercises.")


def _attr(module: ModuleType, name: str) -> Any:
    obj: Any = module
    for part in name.split("."):
        obj = getattr(obj, part, None)
    return obj


def piece(module: ModuleType, name: str, chapter: str) -> Callable:
    """module.name (or a method: "Class.method"), checked not to be a stub, wrapped so that what it raises
    names the exercise."""
    fn = _attr(module, name)
    if fn is None:
        raise ExerciseError(f"use_exercises: {module.__file__} has no {name!r}; {chapter}'s pieces need it "
                            "(regenerate the file from solutions/ if you renamed it)")
    if is_stub(fn):
        raise not_done(module, name, fn, chapter)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except NotImplementedError as e:
            raise not_done(module, name, fn, chapter) from e
        except Exception as e:
            raise ExerciseError(f"use_exercises: your Exercise {exercise_of(fn)} ({where(module, name)}) "
                                f"raised {type(e).__name__} inside the engine: {e}") from e

    return call


def check_result(ok: bool, fn: Callable, what: str) -> None:
    """A piece returned something the engine cannot use: say what, naming the exercise."""
    if not ok:
        raise ExerciseError(f"use_exercises: your Exercise {exercise_of(fn)} ({fn.__name__}) returned {what}")
