"""nanoengine.kernels.cpu on a machine that cannot build the kernels as we do: flags chosen by what the
compiler accepts, a failed build remembered and turned into torch's ops with one line (the engine's tokens
unchanged), `python -m nanoengine.kernels` exiting 0 there; and csrc/ compiling with clang++ (a Mac's
compiler family, without OpenMP) for x86-64 and, for the plain loops, for arm64."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from nanoengine.kernels import cpu

LINE = "the CPU kernels cannot be built here"
PROMPTS = [[5, 17, 300, 42] * n for n in (1, 7)]


def fake_compiler(tmp_path: Path, body: str, name: str = "fakecxx") -> Path:
    """A shell script standing in for $CXX: logs each call (one line) to <script>.log, then runs `body`."""
    script = tmp_path / name
    script.write_text(f'#!/bin/sh\necho "$*" >> "{script}.log"\n{body}\n')
    script.chmod(0o755)
    return script


def calls(script: Path) -> int:
    log = Path(f"{script}.log")
    return len(log.read_text().splitlines()) if log.exists() else 0


def run(code: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *args] if not code else [sys.executable, "-c", textwrap.dedent(code), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def no_kernels_env(cxx: Path, home: Path) -> dict[str, str]:
    return {**os.environ, "CXX": str(cxx), "NANOENGINE_HOME": str(home), "OMP_NUM_THREADS": "1"}


GENERATE = """
    import json, sys
    from nanoengine import LLM, SamplingParams
    llm = LLM(sys.argv[1], max_num_batched_tokens=32, num_kvcache_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(json.loads(sys.argv[2]), params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    print(json.dumps({"backend": llm.plan.attention_backend, "tokens": tokens}))
"""


def generate(env: dict[str, str], model: Path) -> tuple[dict, list[str]]:
    """(what the engine in a subprocess ran and generated, its stderr lines about the kernels)."""
    done = run(GENERATE, env, str(model), json.dumps(PROMPTS))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if LINE in line]
    return json.loads(done.stdout.strip().splitlines()[-1]), lines


@pytest.fixture(scope="module")
def reference_tokens(tiny_qwen3_path):
    """The normal engine's greedy tokens (the kernels where they build here, else torch's ops)."""
    from nanoengine import LLM, SamplingParams

    llm = LLM(str(tiny_qwen3_path), max_num_batched_tokens=32, num_kvcache_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_the_flags_are_what_the_compiler_accepts(tmp_path, monkeypatch):
    """A compiler without OpenMP or GCC's --param: the probe keeps the rest, the build folder changes with
    the flags, and the result is kept (a second look compiles nothing)."""
    real = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if real is None:
        pytest.skip("no C++ compiler here")
    cxx = fake_compiler(tmp_path, f'case "$*" in *-fopenmp*|*--param*) exit 1;; esac\nexec {real} "$@"')
    monkeypatch.setenv("NANOENGINE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CXX", real)
    full = cpu.chosen_flags()
    full_dir = cpu.build_dir()
    monkeypatch.setenv("CXX", str(cxx))
    flags = cpu.chosen_flags()
    assert flags[:1] == ("-O3",) and "-ffast-math" in flags
    assert "-fopenmp" not in flags and "--param" not in flags and not cpu.has_openmp()
    assert set(flags) <= set(full)
    assert ("-march=native" in flags or "-mcpu=native" in flags) == ("-march=native" in full or
                                                                    "-mcpu=native" in full)
    assert cpu.build_dir() != full_dir
    assert json.loads(cpu.probe_path().read_text())["flags"] == list(flags)
    probed = calls(cxx)
    cpu.probed.cache_clear()
    assert cpu.chosen_flags() == flags and calls(cxx) == probed  # read back, not probed again


def test_a_remembered_failure_is_retried_with_another_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOENGINE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CXX", str(fake_compiler(tmp_path, "exit 1", "one")))
    problem = cpu.build_problem()
    assert problem and "cannot compile a test file" in problem and cpu.failure_marker().is_file()
    assert "build-failed.txt" in problem
    monkeypatch.setenv("CXX", str(fake_compiler(tmp_path, "exit 1", "two")))
    assert cpu.remembered_failure() is None  # another compiler: the old marker does not count for it


@pytest.mark.slow
def test_a_compiler_that_fails_gives_torchs_ops_and_one_line(tmp_path, tiny_qwen3_path, reference_tokens,
                                                             monkeypatch):
    """CXX fails everything (and the home has no kernels): the engine runs on torch with the same greedy
    tokens and one line saying why and how to get the kernels; a second start does not try again;
    `python -m nanoengine.kernels` exits 0 (1 with --require); an explicit attention_backend='cpu' is a
    clear error."""
    cxx = fake_compiler(tmp_path, 'echo "fakecxx: error: no" >&2; exit 1')
    env = no_kernels_env(cxx, tmp_path / "home")
    for start in (1, 2):
        out, lines = generate(env, tiny_qwen3_path)
        assert out == {"backend": "torch", "tokens": reference_tokens}, start
        assert len(lines) == 1 and "fakecxx: error: no" in lines[0], lines
        assert "python -m nanoengine.kernels --retry" in lines[0] and "OpenMP" in lines[0]
        if start == 1:
            tried = calls(cxx)
            assert tried >= 1
    assert calls(cxx) == tried  # remembered: the second start did not run the compiler
    done = run("", env, "-m", "nanoengine.kernels")
    assert done.returncode == 0 and LINE in done.stderr and calls(cxx) == tried, done.stderr
    assert run("", env, "-m", "nanoengine.kernels", "--require").returncode == 1
    done = run("", env, "-m", "nanoengine.kernels", "--retry")
    assert done.returncode == 0 and LINE in done.stderr and calls(cxx) > tried  # --retry tries again

    from nanoengine import LLM
    from nanoengine.errors import InvalidValueError

    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("NANOENGINE_HOME", str(tmp_path / "home"))
    with pytest.raises(InvalidValueError, match=r"attention_backend='cpu' cannot be built here .*fakecxx.*"
                                                r"python -m nanoengine.kernels --retry"):
        LLM(str(tiny_qwen3_path), attention_backend="cpu")
    with (pytest.raises(InvalidValueError, match=r"quantization='int8' needs the C\+\+ CPU kernels"),
          pytest.warns(UserWarning, match=LINE)):  # 'auto' attention: torch's, said once
        LLM(str(tiny_qwen3_path), quantization="int8")


@pytest.mark.slow
def test_a_build_that_fails_is_remembered(tmp_path, tiny_qwen3_path, reference_tokens):
    """A compiler that compiles a test file but not the kernels (say, torch's headers): `python -m
    nanoengine.kernels` (make assets) tries once, exits 0 with the line and keeps the reason; the engine then
    runs on torch's ops without trying again."""
    real = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if real is None:
        pytest.skip("no C++ compiler here")
    cxx = fake_compiler(tmp_path, 'case "$*" in *torch/include*) echo "fakecxx: error: the kernels" >&2; '
                                  f'exit 1;; esac\nexec {real} "$@"')
    env = no_kernels_env(cxx, tmp_path / "home")
    done = run("", env, "-m", "nanoengine.kernels")
    assert done.returncode == 0, done.stderr
    assert LINE in done.stderr and "fakecxx: error: the kernels" in done.stderr, done.stderr
    markers = list((tmp_path / "home" / "kernels").glob(f"*/{cpu.FAILED}"))
    assert len(markers) == 1 and markers[0].read_text().startswith("fakecxx: error: the kernels")
    tried = calls(cxx)
    out, lines = generate(env, tiny_qwen3_path)
    assert out == {"backend": "torch", "tokens": reference_tokens} and len(lines) == 1, lines
    assert calls(cxx) == tried
    # without `make assets`: the first engine tries the build once, then runs on torch's ops all the same
    env = no_kernels_env(cxx, tmp_path / "fresh-home")
    out, lines = generate(env, tiny_qwen3_path)
    assert out == {"backend": "torch", "tokens": reference_tokens}, lines
    assert list((tmp_path / "fresh-home" / "kernels").glob(f"*/{cpu.FAILED}"))


# ------------------------------------------------------------------------------ csrc/ under clang++

CLANG = shutil.which("clang++")
TARGETS = {
    # Linux clang or an Intel Mac: the AVX2 / AVX-512 paths, with the flags the probe keeps for this clang
    "x86-64-native": None,
    # an arm64 Mac: no AVX2, so the plain loops (with the arm64 C++ headers: libstdc++-12-dev-arm64-cross)
    "aarch64": ["-O3", "-ffast-math", "--target=aarch64-linux-gnu"],
}


@pytest.fixture(scope="module")
def clang_flags(tmp_path_factory):
    if CLANG is None:
        pytest.skip("clang++ is not installed (apt-get install clang); .ci/run installs it")
    home = tmp_path_factory.mktemp("clang-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CXX", CLANG)
        mp.setenv("NANOENGINE_HOME", str(home))
        native = list(cpu.chosen_flags())
    assert "--param" not in native  # GCC's only: the probe leaves it out for clang
    return {"x86-64-native": native, "aarch64": TARGETS["aarch64"]}


def arch_specific(source: Path) -> bool:
    """Whether a source has code that depends on the target's instructions (simd.h, directly or not)."""
    text = source.read_text()
    return any(f'#include "{h}"' in text for h in ("simd.h", "linear_tiles.h"))


# every source for x86-64; for arm64 the ones with both paths (module.cpp, decode_step.cpp have no AVX code)
CASES = [(target, f.name) for target in TARGETS for f in cpu.SOURCES
         if target == "x86-64-native" or arch_specific(f)]


def starts_with_kernels_h(source: str) -> bool:
    """Whether a source's first include is kernels.h (which includes <ATen/ATen.h> first)."""
    includes = [line for line in (cpu.CSRC / source).read_text().splitlines() if line.startswith("#include")]
    return bool(includes) and includes[0] == '#include "kernels.h"'


@pytest.fixture(scope="module")
def aten_pchs() -> dict[str, Path]:
    """target -> <ATen/ATen.h> precompiled with that target's flags, made by the first source that needs it:
    parsing torch's headers is most of a source's ~6 s check, and a source whose first include is kernels.h
    (which includes ATen/ATen.h first) reads the same declarations from the PCH."""
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("target,source", CASES)
def test_csrc_compiles_with_clang(target, source, clang_flags, aten_pchs, tmp_path_factory, tmp_path):
    """A syntax check (-fsyntax-only, torch's headers) of one kernel source, ~1-7 s (one CPU) each."""
    from torch.utils.cpp_extension import include_paths

    flags = [f for f in clang_flags[target] if f != "-fopenmp"]  # without OpenMP, as Apple's clang builds
    if target == "aarch64":
        probe = tmp_path / "probe.cpp"
        probe.write_text("#include <cassert>\n#include <vector>\nint main() { return 0; }\n")
        if subprocess.run([CLANG, *flags, "-fsyntax-only", str(probe)], capture_output=True).returncode:
            pytest.skip("no arm64 C++ headers for clang++ --target=aarch64-linux-gnu (apt-get install "
                        "libc6-dev-arm64-cross libstdc++-12-dev-arm64-cross; .ci/run installs them)")
    includes = [a for p in [*include_paths(), sysconfig.get_paths()["include"]] for a in ("-isystem", p)]
    compile_ = [CLANG, "-std=c++20", "-Werror=return-type", *flags,
                "-DTORCH_EXTENSION_NAME=nanoengine_cpu_kernels", "-DTORCH_API_INCLUDE_EXTENSION_H", *includes]
    pch = []
    if starts_with_kernels_h(source):
        if target not in aten_pchs:
            header = tmp_path_factory.mktemp(f"pch-{target}") / "aten.h"
            header.write_text("#include <ATen/ATen.h>\n")
            made = subprocess.run([*compile_, "-x", "c++-header", str(header), "-o", f"{header}.pch"],
                                  capture_output=True, text=True, timeout=110)
            assert made.returncode == 0, made.stderr[-4000:]
            aten_pchs[target] = Path(f"{header}.pch")
        pch = ["-include-pch", str(aten_pchs[target])]
    done = subprocess.run([*compile_, "-fsyntax-only", *pch, str(cpu.CSRC / source)], capture_output=True,
                          text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-4000:]
