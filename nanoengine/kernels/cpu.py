"""The compiled CPU kernels (csrc/*.cpp): building, caching and loading them. Chapters 03 and 06.

One C++ extension, one source file per family of kernels: paged decode attention that reads K/V in place
from the blocks (`decode_attention.cpp`, the `cpu` attention backend), fused (residual +) RMSNorm, rotary
and SwiGLU for the model's glue, which round where the eager ops round (`glue.cpp`), a small-batch linear
with bf16 weights (`bf16_linear.cpp`, for decode steps: `layers.linear.use_bf16_weights`), one with int8
weights and per-group scales (`int8_linear.cpp`, quantization="int8": `layers.quant`), and a decode step's
decoder layers in one call (`decode_step.cpp`); `module.cpp` binds them, `kernels.h` declares them,
`simd.h` holds the helpers they share and `linear_tiles.h` the two linears' register tiles. The hot loops
use AVX2/FMA intrinsics where the compiler targets them (-march=native picks them on the machine that
builds; the int8 linear also AVX-512 where it is there), and plain loops elsewhere. The files are compiled
with the C++ compiler torch uses (`torch.utils.cpp_extension`) and linked into one library in
`$NANOENGINE_HOME/kernels/<torch, python, cpu kind, source>/`, once: by `make assets`
(`python -m nanoengine.kernels`), or at first use with a message saying so. A built library is imported
directly: no build lock, no ninja run, so the processes of a tensor-parallel engine (and two checkouts
sharing one NANOENGINE_HOME) load it side by side. The folder name carries a hash of the sources (every
file in csrc/) and flags, so a changed kernel builds anew instead of reusing a stale library.

Deciding whether to use them never compiles: `build_problem()` answers "is it built, or can it be built
here" by looking for the built library, a compiler, ninja and the Python headers.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import sysconfig
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

NAME = "nanoengine_cpu_kernels"
CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))  # compiled and linked into one library; they include the .h files
# -ffast-math lets the compiler vectorize the dot products and exp; 512-bit vectors where the CPU has them;
# the --param lets GCC keep a tile's 12 accumulator registers (an array of 384 bytes) in registers, where its
# default limit left them on the stack, stored at every step (bf16_linear at 6 rows or more ran at under half
# the speed); other compilers ignore it
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp",
         "--param", "sra-max-scalarization-size-Ospeed=2048"]


def cpu_signature() -> str:
    """A short hash of this CPU's instruction-set flags: the kernels are built with -march=native, so a
    NANOENGINE_HOME shared between different machines needs one build per kind of CPU."""
    flags = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), flags)
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def source_signature() -> str:
    """A short hash of the kernel sources (every .cpp and .h in csrc/: names and bytes) and compiler flags."""
    h = hashlib.sha1()
    for f in sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")]):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(" ".join(FLAGS).encode())
    return h.hexdigest()[:8]


def build_dir() -> Path:
    from nanoengine import assets

    tag = (f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}-cpu{cpu_signature()}"
           f"-src{source_signature()}")
    return assets.home() / "kernels" / tag.replace("+", "_")


def built_library() -> Path | None:
    return next(iter(sorted(build_dir().glob(f"{NAME}*.so"))), None)


def is_built() -> bool:
    return built_library() is not None


def build_problem() -> str | None:
    """None when the kernels are built, or can be built here; else what is missing. Never compiles."""
    if is_built():
        return None
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not found)"
    if not is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        return "the Python development headers are missing (e.g. apt-get install python3-dev)"
    return None


@cache
def load() -> ModuleType:
    """The extension, compiled first if this machine has no build yet; raises when it cannot be built."""
    from torch.utils.cpp_extension import load as load_extension

    library = built_library()
    if library is not None:
        try:  # import the built library as it is (what cpp_extension does after its build check)
            spec = importlib.util.spec_from_file_location(NAME, library)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        except (ImportError, OSError):
            pass  # half-written by a build running right now: wait for it below, under the build lock
    path = build_dir()
    path.mkdir(parents=True, exist_ok=True)
    if library is None:
        print("nanoengine: compiling the CPU kernels (once, ~30 s)...", file=sys.stderr, flush=True)
    try:
        return load_extension(NAME, [str(f) for f in SOURCES], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                              build_directory=str(path))
    except Exception as e:  # a compiler error or missing headers: say what to do instead
        last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        raise RuntimeError(
            f"nanoengine: the CPU kernels could not be built ({type(e).__name__}: {last}); "
            "install a C++ compiler (e.g. build-essential) or use attention_backend='torch'") from e


def unavailable_reason() -> str | None:
    """None when the kernels load here (building them if needed), else why not."""
    try:
        load()
        return None
    except RuntimeError as e:
        return str(e)
