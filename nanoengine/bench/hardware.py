"""Hardware ceilings measured on the spot: GEMM peak and memory bandwidth, plus a description of the
machine for the result's name. Chapter 08.

Measured, not looked up: a square matmul in the engine's dtype with the torch threads the run uses (CPU), and
a large tensor copy (read + write). Together they take about a second; `bench/roofline.py` turns them into
the workload's time bounds.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable

import torch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time(fn: Callable[[], object], device: str, min_seconds: float = 0.25) -> float:
    """Seconds per call of fn: one warm-up call, then as many calls as fit in min_seconds."""
    fn()
    _sync(device)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        fn()
        n += 1
        if device.startswith("cuda") and n % 8 == 0:
            _sync(device)
    _sync(device)
    return (time.perf_counter() - start) / n


def gemm_peak_gflops(dtype: torch.dtype, device: str, n: int | None = None) -> float:
    """GFLOP/s of an n x n x n matmul (2 n^3 FLOPs) in `dtype`; n = 1024 on CPU, 8192 on CUDA."""
    n = n or (8192 if device.startswith("cuda") else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _time(lambda: torch.mm(a, b), device) / 1e9


def memory_bandwidth_gbs(device: str, mib: int | None = None) -> float:
    """GB/s of copying a `mib` MiB float32 tensor (bytes read + bytes written); 256 MiB on CPU (beyond the
    caches), 2 GiB on CUDA."""
    mib = mib or (2048 if device.startswith("cuda") else 256)
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / _time(lambda: y.copy_(x), device) / 1e9


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(device: str) -> dict:
    """Device, CPU model, torch threads and versions: what the result's file name is built from."""
    import nanoengine

    info = {"device": device, "cpu": cpu_model(), "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "nanoengine": nanoengine.__version__,
            "python": platform.python_version()}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def kernel_paths(plan) -> dict:
    """Which instruction paths the run's kernels take (the bench JSON's `kernel_paths`): the C++ kernels'
    build (its flags, the instruction sets it uses) and, per kind of work the plan gives them, what their
    path="auto" runs here; the matmuls left to torch are named by what runs them (oneDNN, with AMX where the
    CPU has it, or torch's float32 GEMM). {} off CPU; {"cpp_kernels": why not} where they are not built."""
    if plan.device != "cpu":
        return {}
    from nanoengine.kernels import cpu as cpu_kernels

    problem = cpu_kernels.build_problem()
    if problem is not None or not cpu_kernels.is_built():
        return {"cpp_kernels": f"not built ({problem or 'not yet'})"}
    kernels = cpu_kernels.load()
    auto = dict(kernels.auto_paths())
    cpu_flags = set(cpuinfo_flags())
    out: dict = {"cpp_flags": list(cpu_kernels.chosen_flags()), "cpp_simd": list(kernels.simd_paths()),
                 "cpu_has": sorted(cpu_flags & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni",
                                               "amx_bf16", "amx_int8"})}
    quant = getattr(plan, "quantization", "none")
    if quant == "w8a8":
        out["decode_linears"] = f"w8a8_linear:{auto['w8a8_linear']}"
        out["prefill_linears"] = f"w8a8_linear:{auto['w8a8_linear']}"
    elif quant == "int8":
        out["decode_linears"] = f"int8_linear:{auto['int8_linear']} (<= {plan.int8_weight_rows} rows)"
    elif plan.bf16_weight_rows:
        # up to a row count through the bf16 copies' kernel, above it prefill_dtype's bf16 or torch's matmul
        rows = plan.bf16_weight_rows
        above = f"torch:{plan.dtype} matmul"
        if plan.prefill_dtype == "bfloat16" and plan.prefill_dtype != plan.dtype:
            rows = min(rows, plan.prefill_dtype_min_rows)
            above = "onednn:bf16 activations" + (" (amx)" if "amx_bf16" in cpu_flags else "")
        out["decode_linears"] = out["prefill_linears"] = (f"bf16_linear:{auto['bf16_linear']} (<= {rows} "
                                                          f"rows), {above} above")
    elif plan.prepack_weights:
        out["decode_linears"] = "onednn:bf16 (prepacked)"
    if "prefill_linears" not in out:
        if plan.prepack_weights:
            out["prefill_linears"] = "onednn:bf16" + (" (amx)" if "amx_bf16" in cpu_flags else "")
        else:
            out["prefill_linears"] = f"torch:{plan.dtype} matmul"
    if plan.attention_backend == "cpu":
        out["decode_attention"] = f"paged_decode:{auto['paged_decode']}"
    return out


def cpuinfo_flags() -> list[str]:
    """This CPU's instruction-set flags (Linux /proc/cpuinfo); [] elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return []
    return line.split(":", 1)[1].split() if ":" in line else []


def gemm_dtype(plan) -> torch.dtype:
    """The dtype of the compute ceiling: the one the plan's batched linears run in (prefill_dtype above its
    row threshold, else the compute dtype)."""
    return getattr(torch, plan.prefill_dtype) if plan.prefill_dtype != plan.dtype else plan.torch_dtype


def measure(dtype: torch.dtype, device: str) -> dict:
    """The two ceilings, in the units the roofline uses."""
    t0 = time.perf_counter()
    gemm = gemm_peak_gflops(dtype, device)
    bw = memory_bandwidth_gbs(device)
    return {"gemm_gflops": gemm, "gemm_dtype": str(dtype).removeprefix("torch."), "memory_gbs": bw,
            "threads": torch.get_num_threads(), "measure_s": time.perf_counter() - t0}
