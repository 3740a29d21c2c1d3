"""Hardware ceilings measured on the spot: GEMM peak and memory bandwidth. Chapter 08."""

from __future__ import annotations

import platform
import time

import torch


def _time(fn, min_seconds: float = 0.3) -> float:
    fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        fn()
        n += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / n


def gemm_peak_gflops(dtype: torch.dtype, device: str, n: int = 2048) -> float:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / _time(lambda: torch.mm(a, b)) / 1e9


def memory_bandwidth_gbs(device: str, mib: int = 256) -> float:
    x = torch.empty(mib * 2**20 // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / _time(lambda: y.copy_(x)) / 1e9  # read + write


def describe(device: str) -> dict:
    info = {"device": device, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "python": platform.python_version()}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info
