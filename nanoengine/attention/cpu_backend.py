"""The CPU backend: the torch backend with decode attention done by a small C++ kernel that reads K/V in
place from the blocks, plus fused RMSNorm / rotary / SwiGLU for the model's glue (csrc/cpu_kernels.cpp).
Chapter 06.

Why: the torch backend's decode gathers every sequence's blocks into a padded copy, then runs two batched
matmuls with 3-row queries; on CPU that moves the K/V bytes three times and runs the matmuls far below peak.
The kernel reads each K/V row once (about 7x faster at batch 32 here). Prefill and the cache layout are
the torch backend's, so the two backends are interchangeable and tested equal. Between the matmuls, the
~40 small ops of a decoder layer cost more in dispatch than in arithmetic at small batch; the fused kernels
do each step in one pass (`use_cpu_kernels`), rounding where the eager ops round.

The extension is compiled once with the C++ compiler torch uses (`torch.utils.cpp_extension`, ~30 s) into
`$NANOENGINE_HOME/kernels/`, then loaded from there. Without a compiler, `attention_backend="auto"`
falls back to the torch backend with a warning.
"""

from __future__ import annotations

import sys
import warnings
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from nanoengine.attention.metadata import AttentionMetadata
from nanoengine.attention.torch_backend import Plan, TorchAttention

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
# -ffast-math lets the compiler vectorize the dot products and exp; 512-bit vectors where the CPU has them
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp"]


def cpu_signature() -> str:
    """A short hash of this CPU's instruction-set flags: the kernels are built with -march=native, so a
    NANOENGINE_HOME shared between different machines needs one build per kind of CPU."""
    import hashlib
    import platform

    flags = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), flags)
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def build_dir() -> Path:
    from nanoengine import assets

    tag = f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}-cpu{cpu_signature()}"
    return assets.home() / "kernels" / tag.replace("+", "_")


@cache
def load_kernel() -> ModuleType:
    """Compile (first time only) and load the extension; raises when it cannot be built."""
    from torch.utils.cpp_extension import load

    path = build_dir()
    path.mkdir(parents=True, exist_ok=True)
    name = "nanoengine_cpu_kernels"
    if not any(path.glob(f"{name}*.so")):
        print("nanoengine: compiling the CPU kernels (once, ~30 s)...", file=sys.stderr, flush=True)
    return load(name, [str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(path))


@cache
def unavailable_reason() -> str | None:
    """None when the kernel loads here, else why not (asked once by EngineConfig.resolve)."""
    try:
        load_kernel()
        return None
    except Exception as e:  # no compiler, no headers, a build error: all mean "use the torch backend"
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"


def fall_back_warning(reason: str) -> None:
    warnings.warn(f"nanoengine: the CPU attention kernel could not be built ({reason}); using the slower "
                  "torch backend. Install a C++ compiler (e.g. build-essential) to get it.", stacklevel=3)


def use_cpu_kernels(model: torch.nn.Module) -> int:
    """Route the model's RMSNorms, rotary embedding and SwiGLU through the fused kernels (same results as
    the eager ops; one call instead of several per step). Returns how many modules now use them."""
    kernels = load_kernel()
    n = 0
    for m in model.modules():
        if hasattr(m, "kernels"):
            m.kernels = kernels
            n += 1
    return n


class CPUAttention(TorchAttention):
    gathers_for_decode = False  # the kernel reads the block tables itself

    def decode(self, q: torch.Tensor, meta: AttentionMetadata, plan: Plan) -> torch.Tensor:
        # q [B, num_heads, head_dim] -> [B, num_heads, head_dim]
        return load_kernel().paged_decode(q, self.k_cache, self.v_cache, meta.decode_block_tables,
                                          meta.decode_context_lens, self.scale)


if __name__ == "__main__":  # `python -m nanoengine.attention.cpu_backend`: build now (make assets does)
    why = unavailable_reason()
    print("nanoengine CPU kernels: " + ("ready in " + str(build_dir()) if why is None else f"not built ({why})"))
