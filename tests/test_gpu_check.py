"""scripts/gpu_check.sh's own pieces, in seconds: its summary from a run's results (scripts/gpu_summary.py),
the one-line refusal of a bad option, and the hypothesis stand-in of scripts/gpu_env.py. The whole script runs
on CPU with `bash scripts/gpu_check.sh --smoke` (about 1.5 minutes; not part of the test suite)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_run(tmp_path: Path) -> tuple[Path, Path]:
    """A work folder and an $OUT as gpu_check.sh leaves them after a full run on a GPU."""
    work, out = tmp_path / "work", tmp_path / "out"
    for d in ("graphs", "attention", "bench"):
        (work / d).mkdir(parents=True)
    out.mkdir()
    (work / "env.json").write_text(json.dumps({
        "mode": "full", "gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "cuda": "13.0", "triton": "3.6.0",
        "modules": {"flash_attn": None},
        "notes": ["flash_attn absent: flash-attn's rows and tests are skipped"]}))
    (work / "parts.tsv").write_text("env\tok\t4\t15\t\nbench\tok\t95\t180\t\n"
                                    "pytest\ttimed out\t60\t60\tafter 60 s\n")
    (work / "graphs" / "graphs_check.json").write_text(json.dumps({
        "tokens": [{"model": "tiny-qwen3", "dtype": "float32", "graphs_equal": True, "graphs_agree": 1.0,
                    "compiled_equal": False, "compiled_agree": 0.97}],
        "decode": [{"batch": 1, "context": 512, "eager_ms": 12.0, "graphs_ms": 3.0}]}))
    (work / "attention" / "attention_check.json").write_text(json.dumps({
        "correctness": [
            {"model": "tiny-qwen3", "dtype": "float32", "backend": "torch", "result": "reference"},
            {"model": "tiny-qwen3", "dtype": "float32", "backend": "triton", "result": "5/5 equal",
             "equal": 5, "of": 5}],
        "decode_speed": [{"backend": "triton split-K (block 16)", "batch": 1, "context": 512, "us": 20.0,
                          "kv_GBps": 100.0, "fraction_of_copy_bw": 0.25}], "copy_bandwidth_GBps": 4300}))
    (work / "bench" / "qwen3-0.6b-shape_nano-vllm_H200.json").write_text(json.dumps({
        "model": "qwen3-0.6b-shape", "workload": "nano-vllm", "num_requests": 256, "output_tokens": 133_966,
        "workload_spec": {"input_len": [100, 1024], "output_len": [100, 1024]}, "dtype": "bfloat16",
        "plan": {"attention_backend": "triton", "decode_mode": "cuda_graphs"},
        "hardware": {"gpu": "NVIDIA H200"},
        "ceilings": {"gemm_gflops": 7.5e5, "memory_gbs": 4300},
        "nanoengine": {"output_tokens_per_s": 2868.26, "seconds": 46.7, "latency": {}, "steps": {}},
        "roofline": {"achieved_fraction_of_limit": 0.2, "bound": "memory",
                     "limit_output_tokens_per_s": 14000}}))
    (out / "log.txt").write_text(
        "===== pytest (timeout 60 s) =====\n$ python -m pytest\n"
        "tests/test_gpu.py::test_cuda_matches_cpu[default] PASSED [ 10%]\n"
        "tests/test_gpu.py::test_cuda_seeded_sampling_is_reproducible FAILED [ 20%]\n")
    return work, out


def test_the_summary_says_what_ran_at_a_glance(tmp_path):
    work, out = fake_run(tmp_path)
    text = load_script("gpu_summary").summary(work, out, elapsed=300, budget=450, final=True)
    assert text == (out / "summary.md").read_text()
    assert text.startswith("# GPU check (full): NVIDIA H200 · torch 2.11.0+cu130 · CUDA 13.0 · "
                           "triton 3.6.0 · flash_attn absent")
    assert "triton vs torch: equal in 1/1" in text and "compiled vs eager: DIFFER in 0/1" in text
    assert "**differs**: 97.0% of tokens agree" in text
    assert "2,868 output tok/s" in text and "20.0% of the roofline limit" in text
    assert "2.00x nano-vllm's published 1,434 tok/s" in text and "the same draw as nano-vllm" in text
    assert "tests: 1 passed, 1 failed (cut short) [timed out (after 60 s)]" in text
    assert "| 1 | 512 | 12.000 | 3.000 | 4.00x |" in text
    assert json.loads((out / "checks.json").read_text())["graphs"]["decode"][0]["batch"] == 1


def test_a_run_cut_short_still_has_a_summary(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    text = load_script("gpu_summary").summary(work, out, elapsed=61, budget=450)
    assert "cut short or still running: 1 min 1 s so far" in text and "## Parts" in text


def test_a_bad_option_is_refused_in_one_line():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--bogus"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown option '--bogus'" in r.stderr


def test_the_hypothesis_stand_in_is_written_only_where_hypothesis_is_absent(tmp_path, monkeypatch):
    env = load_script("gpu_env")
    env.write_stubs(tmp_path / "present")
    assert not (tmp_path / "present").exists()  # hypothesis is installed here
    monkeypatch.setattr(env, "present", lambda name: False)
    env.write_stubs(tmp_path / "absent")
    code = "from hypothesis import settings; settings.register_profile('ci'); settings.load_profile('ci')"
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path / "absent", check=True, timeout=30)
