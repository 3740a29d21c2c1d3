"""The benchmark runs end to end on a tiny workload and writes a JSON result with the peer ratio."""

from __future__ import annotations

import json

import pytest

from nanoengine.bench.run import bench
from nanoengine.bench.workload import WORKLOADS, make_workload


def test_workload_is_seeded_and_in_range():
    a = make_workload("cpu-small", vocab_size=1000, **WORKLOADS["cpu-small"])
    b = make_workload("cpu-small", vocab_size=1000, **WORKLOADS["cpu-small"])
    assert a.prompts == b.prompts and a.output_lens == b.output_lens
    assert len(a.prompts) == 32 and all(64 <= len(p) <= 512 for p in a.prompts)
    assert all(64 <= n <= 512 for n in a.output_lens)


@pytest.mark.xdist_group("tiny")
def test_bench_smoke(tmp_path):
    r = bench("tiny-qwen3", "smoke", peer_batches=(2,), out_dir=str(tmp_path))
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["workload"] == "smoke"
    assert r["nanoengine"]["output_tokens"] == r["output_tokens"]
    assert r["speedup_vs_best_peer"] == pytest.approx(
        r["nanoengine"]["output_tokens_per_s"] / r["peers"][0]["output_tokens_per_s"])
    assert r["ceilings"]["gemm_gflops"] > 0 and r["ceilings"]["memory_gbs"] > 0
