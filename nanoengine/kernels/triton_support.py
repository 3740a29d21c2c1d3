"""Can the Triton kernels run here, and how? Chapter 06.

Importing this module never imports triton: the engine works without it (the `torch` and `cpu` backends),
and the config asks `problem(device)` before it picks or accepts attention_backend='triton'.

Triton compiles its kernels for CUDA. On a CPU it can only run them in its interpreter, which executes each
program of the grid one after another in numpy: exact enough to test the kernels against the torch
reference, far too slow to serve with. The interpreter is switched on by `TRITON_INTERPRET=1` in the
environment, and triton reads it when a kernel is *defined* (`@triton.jit`, at import of the kernel
modules), so it must be set before nanoengine's Triton kernels are first imported.
"""

from __future__ import annotations

import importlib.util
import os

INTERPRET_VAR = "TRITON_INTERPRET"


def interpreter_requested() -> bool:
    """Is TRITON_INTERPRET=1 set in the environment? (triton's own test: 1, true, on or yes, any case)"""
    return os.environ.get(INTERPRET_VAR, "0").lower() in ("1", "true", "on", "yes")


def installed() -> bool:
    """Is the triton package installed (without importing it)?"""
    return importlib.util.find_spec("triton") is not None


def problem(device: str) -> str | None:
    """None when the Triton kernels can run on `device` ('cuda' or 'cpu'),
    else what is missing and the fix."""
    if not installed():
        return ("the triton package is not installed: pip install -c constraints.txt triton "
                "(it comes with CUDA builds of torch; the dev extra installs it)")
    if device == "cpu" and not interpreter_requested():
        return ("on device='cpu' the Triton kernels run only in Triton's interpreter (slow: for tests and "
                f"learning), which needs {INTERPRET_VAR}=1 set in the environment before nanoengine starts, "
                f"e.g. `{INTERPRET_VAR}=1 python ...` or os.environ['{INTERPRET_VAR}'] = '1' before "
                "importing nanoengine; for speed on CPU use attention_backend='auto' or 'cpu'")
    return None


def is_interpreted(kernel: object) -> bool:
    """Was this @triton.jit kernel defined under the interpreter (True) or for compilation (False)?"""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def fix_old_interpreter() -> None:
    """Make an older Triton interpreter (3.6, the lent GPU machine's) run our kernels under NumPy >= 2.4.

    The interpreter holds a scalar (a program id, a loaded length) as a NumPy array of shape [1] and turns it
    into a Python int, as `range(lo, hi, BLOCK_N)` needs, with `int(array)`; NumPy 2.4 refuses that for
    arrays of one or more dimensions. Triton 3.8 squeezes the array first; this does the same on versions
    that do not. Only the interpreter is touched (compiled kernels never call it), and only once; nothing
    changes with a Triton that has the fix, or without the interpreter.
    """
    if not interpreter_requested():
        return
    import inspect

    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "nanoengine_fix", False):
        return
    try:
        fixed = "squeeze" in inspect.getsource(patch)
    except (OSError, TypeError):
        fixed = False
    if fixed:
        return

    def patch_lang_tensor(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor.nanoengine_fix = True
    interpreter._patch_lang_tensor = patch_lang_tensor
