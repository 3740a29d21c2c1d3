"""The compiled CPU kernels (csrc/*.cpp): building, caching and loading them. Chapters 03 and 06.

One C++ extension, one source file per family of kernels: paged decode attention that reads K/V in place
from the blocks (`decode_attention.cpp`, the `cpu` attention backend), fused (residual +) RMSNorm, rotary
and SwiGLU for the model's glue, which round where the eager ops round (`glue.cpp`), a small-batch linear
with bf16 weights (`bf16_linear.cpp`, and `bf16_pairs.cpp` for its AVX-512 layout; for decode steps:
`layers.linear.use_bf16_weights`), one with int8 weights and per-group scales (`int8_linear.cpp`,
quantization="int8": `layers.quant`) and one that also quantizes the activations to int8 (`w8a8_linear.cpp`,
quantization="w8a8"), and a decode step's decoder layers in one call (`decode_step.cpp`); `module.cpp`
binds them, `kernels.h` declares them, `simd.h` holds the helpers they share and `linear_tiles.h` the two
linears' register tiles. The instruction sets are chosen at build time, by what the compiler targets
(-march=native): AVX2/FMA, AVX-512 (16 lanes), AVX512-BF16 (`vdpbf16ps`) and AVX512-VNNI (`vpdpbusd`), each
where the CPU has it, and plain loops everywhere (an arm64 Mac, say). A kernel with several paths takes a
`path` argument ("auto" by default) so that one machine tests every path it can run; `simd_paths()` and
`auto_paths()` say what this build has and runs (the benchmark's JSON records them).
The files are compiled with the C++ compiler torch uses
(`$CXX`, else `c++`; `torch.utils.cpp_extension`) and linked into one library in
`$NANOENGINE_HOME/kernels/<torch, python, cpu kind, source>/`, once: by `make assets`
(`python -m nanoengine.kernels`), or at first use with a message saying so. A built library is imported
directly: no build lock, no ninja run, so the processes of a tensor-parallel engine (and two checkouts
sharing one NANOENGINE_HOME) load it side by side. The folder name carries a hash of the sources (every
file in csrc/) and of the flags, so a changed kernel builds anew instead of reusing a stale library.

The flags are what this compiler accepts (`chosen_flags`): -O3 -ffast-math always, then each of -fopenmp
(threads through at::parallel_for; without it, Apple's clang for one, every kernel runs on one thread),
-march=native or else -mcpu=native (this CPU's vector instructions), -mprefer-vector-width=512 and GCC's
--param, each kept where a tiny test file compiles with it. The probe runs once per compiler and kind of
CPU and is kept in `$NANOENGINE_HOME/kernels/probe/`.

A build that fails is remembered: `build-failed.txt` in the build folder holds the reason (and the compiler's
output), so later starts do not compile again; a changed source or compiler tries again, and so does
`python -m nanoengine.kernels --retry`. Deciding whether to use the kernels never compiles them:
`build_problem()` answers "is it built, or can it be built here" (None) or says why not, from the built
library, that marker, a compiler, ninja, the Python headers and the probe. The plan then runs on torch's
ops with one line saying why and how to get the kernels (`FIX`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

NAME = "nanoengine_cpu_kernels"
CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))  # compiled and linked into one library; they include the .h files
# -ffast-math lets the compiler vectorize the dot products and exp
BASE_FLAGS = ("-O3", "-ffast-math")
# Each kept where the compiler accepts it (the first accepted of a row's alternatives), in this order:
# -fopenmp: at::parallel_for splits a kernel's work over torch's threads (without it: one thread);
# -march=native (GCC; clang on x86) or -mcpu=native (clang on arm64): the instructions of the CPU that builds;
# -mprefer-vector-width=512: 512-bit vectors where the CPU has them;
# the GCC-only --param lets GCC keep a tile's 12 accumulator registers (an array of 384 bytes) in registers,
# where its default limit left them on the stack, stored at every step (bf16_linear at 6 rows or more ran at
# under half the speed)
OPTIONAL_FLAGS: tuple[tuple[tuple[str, ...], ...], ...] = (
    (("-fopenmp",),),
    (("-march=native",), ("-mcpu=native",)),
    (("-mprefer-vector-width=512",),),
    (("--param", "sra-max-scalarization-size-Ospeed=2048"),),
)
PROBE_SOURCE = "int main() { return 0; }\n"
OPENMP_SOURCE = "#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n"
FAILED = "build-failed.txt"  # in the build folder: a build that failed there, and why
FIX = ("to get them, install a C++ compiler with OpenMP (Debian/Ubuntu: apt-get install build-essential; "
       "macOS: xcode-select --install, whose clang builds them single-threaded), then run "
       "`python -m nanoengine.kernels --retry`")


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


# ------------------------------------------------------------------------------------- compiler and flags

def compiler() -> str:
    """The C++ compiler torch's extension builder runs: $CXX, else c++."""
    return os.environ.get("CXX", "c++")


def compiler_signature() -> str:
    """A short hash of the compiler's file (its resolved path, size and time): a changed compiler probes and
    tries a failed build again. 'none' where there is no such program."""
    found = shutil.which(compiler())
    if found is None:
        return "none"
    real = os.path.realpath(found)
    try:
        st = os.stat(real)
        facts = f"{real}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        facts = real
    return hashlib.sha1(facts.encode()).hexdigest()[:8]


def first_error(output: str, most: int = 300) -> str:
    """The line of a compiler's (or a build's) output that says what went wrong: the first diagnostic
    ("...: error: ..."), else the first line with 'error', else the last; at most `most` characters."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    line = next((line for line in lines if "error:" in line and not line.startswith("Error building")),
                next((line for line in lines if "error" in line.lower()), lines[-1] if lines else ""))
    return line if len(line) <= most else line[:most - 3] + "..."


def try_compile(flags: list[str], source: str = PROBE_SOURCE, link: bool = False) -> str | None:
    """None where the compiler compiles `source` with `flags` (and links it, with link), else why not."""
    with tempfile.TemporaryDirectory(prefix="nanoengine-probe-") as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text(source)
        cmd = [compiler(), *flags, str(src), "-o", str(Path(tmp) / ("probe" if link else "probe.o"))]
        if not link:
            cmd.insert(1, "-c")
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp)
        except (OSError, subprocess.SubprocessError) as e:
            return f"{type(e).__name__}: {e}"
        if done.returncode == 0:
            return None
        return first_error(done.stderr + done.stdout) or f"{compiler()} exited with status {done.returncode}"


def run_probe() -> dict:
    """Compile a tiny file with BASE_FLAGS, then with each of OPTIONAL_FLAGS: {"flags": the accepted ones,
    "error": why the compiler cannot compile at all, or None}."""
    error = try_compile(list(BASE_FLAGS))
    if error is not None:
        return {"flags": list(BASE_FLAGS), "error": f"{compiler()!r} cannot compile a test file: {error}"}
    flags = list(BASE_FLAGS)
    accepted: list[tuple[str, ...]] = []
    for alternatives in OPTIONAL_FLAGS:
        for candidate in alternatives:
            openmp = candidate == ("-fopenmp",)  # omp.h there, and the runtime library links
            if try_compile([*flags, *candidate, "-Werror"], OPENMP_SOURCE if openmp else PROBE_SOURCE,
                           link=openmp) is None:
                flags += candidate
                accepted.append(candidate)
                break
    # in the order the flags had when they were fixed, so a compiler that takes them all keeps its old build
    order = ["-O3", "-march=native", "-mcpu=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp",
             "--param"]
    parts = [*((f,) for f in BASE_FLAGS), *accepted]
    parts.sort(key=lambda part: order.index(part[0]) if part[0] in order else len(order))
    return {"flags": [f for part in parts for f in part], "error": None}


def probe_path() -> Path:
    from nanoengine import assets

    return assets.home() / "kernels" / "probe" / f"cpu{cpu_signature()}-cxx{compiler_signature()}.json"


@cache
def probed(path: Path) -> tuple[tuple[str, ...], str | None]:
    """(flags, error) for the compiler and CPU named by `path`: read from it, else probed and kept there."""
    try:
        data = json.loads(path.read_text())
        return tuple(str(f) for f in data["flags"]), data["error"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    result = run_probe()
    write_atomically(path, json.dumps({**result, "compiler": compiler()}, indent=1))
    return tuple(result["flags"]), result["error"]


def chosen_flags() -> tuple[str, ...]:
    """The flags the kernels are compiled with here (see OPTIONAL_FLAGS)."""
    return probed(probe_path())[0]


def has_openmp() -> bool:
    return "-fopenmp" in chosen_flags()


def write_atomically(path: Path, text: str) -> None:
    """Write under a temporary name, then rename (atomic on one file system); a read-only home: nothing."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(name, path)
    except OSError:
        pass


# --------------------------------------------------------------------------------- the build and its folder

def source_signature() -> str:
    """A short hash of the kernel sources (every .cpp and .h in csrc/: names and bytes) and compiler flags."""
    h = hashlib.sha1()
    for f in sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")]):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(" ".join(chosen_flags()).encode())
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


def failure_marker() -> Path:
    return build_dir() / FAILED


def remembered_failure() -> str | None:
    """Why the last build in this folder failed, with this same compiler; None if it did not (or another
    compiler tried: then it is tried again)."""
    try:
        reason, who = failure_marker().read_text().splitlines()[:2]
    except (OSError, ValueError):
        return None
    return reason if who == f"compiler {compiler()} {compiler_signature()}" else None


def remember_failure(reason: str, output: str = "") -> None:
    write_atomically(failure_marker(), f"{reason}\ncompiler {compiler()} {compiler_signature()}\n"
                     f"(delete this file, or run `python -m nanoengine.kernels --retry`, to build again)\n\n"
                     f"{output}")


def forget_failure() -> None:
    """Forget a failed build and the compiler probe (`python -m nanoengine.kernels --retry`)."""
    failure_marker().unlink(missing_ok=True)
    probe_path().unlink(missing_ok=True)
    probed.cache_clear()
    failure_marker().unlink(missing_ok=True)  # the folder of the flags probed anew


def build_problem() -> str | None:
    """None when the kernels are built, or can be built here; else what is missing, or why the build failed
    when it was tried. Never compiles the kernels (the flag probe compiles a tiny file, once)."""
    if is_built():
        return None
    failed = remembered_failure()
    if failed is not None:
        return f"{failed}; kept in {failure_marker()}"
    from torch.utils.cpp_extension import is_ninja_available

    if shutil.which(compiler()) is None:
        return f"no C++ compiler ({compiler()!r} not found)"
    if not is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        return "the Python development headers are missing (e.g. apt-get install python3-dev)"
    error = probed(probe_path())[1]
    if error is not None:
        remember_failure(error)
        return f"{error}; kept in {failure_marker()}"
    return None


class KernelBuildError(RuntimeError):
    """The kernels cannot be built here; `problem` says why."""

    def __init__(self, problem: str, just_failed: bool = False) -> None:
        then = "; remembered: the next start's 'auto' runs on torch's ops" if just_failed else ""
        super().__init__(f"nanoengine: the CPU kernels could not be built ({problem}){then}; {FIX}; "
                         "or use attention_backend='torch'")
        self.problem = problem


def fallback_line(problem: str) -> str:
    """The one line an automatic choice prints when it runs on torch's ops instead of the kernels."""
    return f"nanoengine: the CPU kernels cannot be built here ({problem}); using the slower torch ops; {FIX}"


@cache
def load() -> ModuleType:
    """The extension, compiled first if this machine has no build yet; raises when it cannot be built (and
    remembers why, so the next start's plan runs on torch's ops without trying again)."""
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
    else:
        problem = build_problem()
        if problem is not None:
            raise KernelBuildError(problem)
    path = build_dir()
    path.mkdir(parents=True, exist_ok=True)
    flags = list(chosen_flags())
    if library is None:
        threads = "" if "-fopenmp" in flags else " (this compiler has no OpenMP: they will run on one thread)"
        print(f"nanoengine: compiling the CPU kernels (once, ~30 s){threads}...", file=sys.stderr, flush=True)
    try:
        return load_extension(NAME, [str(f) for f in SOURCES], extra_cflags=flags,
                              extra_ldflags=["-fopenmp"] if "-fopenmp" in flags else [],
                              build_directory=str(path))
    except Exception as e:  # a compiler error or missing headers: remember it, and say what to do instead
        reason = first_error(str(e)) or type(e).__name__
        remember_failure(reason, str(e))
        raise KernelBuildError(f"{reason}; kept in {failure_marker()}", just_failed=True) from e


def unavailable_reason() -> str | None:
    """None when the kernels load here (building them if needed), else why not."""
    try:
        load()
        return None
    except RuntimeError as e:
        return str(e)
