"""Shared fixtures: the offline assets (built once by `make assets`) and seeded randomness."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
from hypothesis import settings

from nanoengine import assets

# Triton runs on CPU only in its interpreter, chosen when `triton.language` is first imported: set it for
# the whole run before anything imports triton, or the tests that run a kernel would depend on the order
# (chapter 03's file sets it too, but only before its own kernel, too late if torch.compile came first)
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

# Two pytest-xdist workers on two cores: one torch thread each. Two OpenMP threads per worker fight over
# the cores and make every matmul ~40x slower (measured: a 576x1728 bf16 linear, 0.13 ms -> 6 ms).
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)


# CI runs the same hypothesis examples every time (main stays green or fails for a reason you can rerun);
# locally, each run explores new examples and remembers failures in .hypothesis/.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


# --impl for the exercise tests (tests/exercises/conftest.py reads it), here so that it also works from the
# root
def pytest_addoption(parser):
    parser.addoption("--impl", default=None,
                     help="chapter modules to test: exercises (default), solutions, or a folder path "
                          "(also NANOENGINE_IMPL)")


def pytest_collection_modifyitems(config, items):
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def qwen3_tokenizer_path():
    return assets.ensure("qwen3-tokenizer")


@pytest.fixture(scope="session")
def tiny_qwen3_path():
    return assets.ensure("tiny-qwen3")


@pytest.fixture(scope="session")
def smollm2_path():
    return assets.ensure("smollm2-135m")


@pytest.fixture
def seed():
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    return 0


@pytest.fixture(scope="session")
def cpu_kernels():
    """nanoengine's compiled CPU kernels (nanoengine/kernels/csrc). Skipped where they cannot be built;
    on CI (which has a compiler) that is a failure instead."""
    from nanoengine.kernels import cpu

    why = cpu.unavailable_reason()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the CPU kernels did not build: {why}")
        pytest.skip(f"no CPU kernels here: {why}")
    return cpu.load()


@pytest.fixture(autouse=True)
def python_sigint_handler():
    """Every test starts with Python's own SIGINT handler (Ctrl-C raises KeyboardInterrupt) and gives back
    the one it found: a test that sends itself SIGINT must not depend on what a test before it, in the same
    worker, left installed (the clean-clone run had three such tests fail in one xdist worker). What is left
    installed is the engine's own: the first step of any engine puts `interrupts.HELD.handler` in front of
    Python's and leaves it there by design (nanoengine/engine/interrupts.py); every test that runs a step
    leaves it."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if before is not None:
            signal.signal(signal.SIGINT, before)
