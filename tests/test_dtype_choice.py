"""dtype='auto' on CPU picks by measurement (nanoengine/dtype_choice.py, plan.pick_dtype): the faster decode
path is kept per machine, printed once, re-measured when its file is corrupt; explicit dtypes and machines
with one candidate measure nothing. The timer is a stand-in here, except in the last tests, which run the
real measurement on the candidates this machine has."""

from __future__ import annotations

import json
import math

import pytest
from plans import plan_of, tiny_hf_config

from nanoengine import dtype_choice
from nanoengine.kernels import cpu as cpu_kernels
from nanoengine.layers import linear
from nanoengine.plan import DecodeMode


def bf16_config():
    cfg = tiny_hf_config()
    cfg.dtype, cfg.architectures = "bfloat16", ["Qwen3ForCausalLM"]
    return cfg


class FakeTimer:
    """Counts its calls; answers the given milliseconds per candidate."""

    def __init__(self, ms: dict[str, float]) -> None:
        self.ms, self.calls = ms, 0

    def __call__(self, hf_config, candidates):
        self.calls += 1
        assert sorted(c.dtype for c in candidates) == ["bfloat16", "float32"]
        return {c.dtype: self.ms[c.dtype] for c in candidates}


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A CPU with oneDNN bf16 and built kernels (both candidates), an empty NANOENGINE_HOME, a fake timer
    (float32 faster; tests change `.ms`)."""
    monkeypatch.setenv("NANOENGINE_HOME", str(tmp_path))
    monkeypatch.setattr(linear, "onednn_bf16_available", lambda: True)
    monkeypatch.setattr(cpu_kernels, "build_problem", lambda: None)
    monkeypatch.setattr(cpu_kernels, "is_built", lambda: True)
    timer = FakeTimer({"float32": 1.0, "bfloat16": 2.3})
    monkeypatch.setattr(dtype_choice, "measure", timer)
    return timer


@pytest.mark.parametrize("faster", ["float32", "bfloat16"])
def test_the_faster_candidate_is_picked_kept_and_printed_once(machine, capsys, faster):
    machine.ms = {"float32": 1.0, "bfloat16": 2.3} if faster == "float32" else {"float32": 3.0,
                                                                                 "bfloat16": 1.5}
    cfg = bf16_config()
    plan = plan_of(cfg, device="cpu")
    assert (plan.dtype, plan.dtype_source, machine.calls) == (faster, "measured", 1)
    # the rest of the plan follows the dtype as it would have followed it given
    given = plan_of(cfg, device="cpu", dtype=faster)
    assert (given.dtype_source, machine.calls) == ("given", 1)
    for f in ("prepack_weights", "bf16_weight_rows", "decode_mode", "attention_backend"):
        assert getattr(plan, f) == getattr(given, f), f
    assert plan.decode_mode is (DecodeMode.FUSED_CPU if faster == "float32" else DecodeMode.EAGER)
    described = plan.describe()
    assert described["dtype_ms_per_step"] == machine.ms and described["dtype_source"] == "measured"
    again = plan_of(cfg, device="cpu")
    assert (again.dtype, again.dtype_source, machine.calls) == (faster, "cached", 1)
    assert again.describe()["dtype_ms_per_step"] == machine.ms
    lines = [line for line in capsys.readouterr().err.splitlines() if "dtype='auto'" in line]
    assert len(lines) == 1 and f"picked {faster}" in lines[0] and "dtype= overrides" in lines[0]
    # another shape is another entry
    other = bf16_config()
    other.intermediate_size *= 2
    assert plan_of(other, device="cpu").dtype_source == "measured" and machine.calls == 2


@pytest.mark.parametrize("content", ["{not json", "", '{"dtype": "float64", "ms_per_step": {}}',
                                     '{"dtype": "bfloat16", "ms_per_step": {"bfloat16": "x"}}', "[1, 2]"])
def test_a_corrupt_cache_file_is_measured_again_and_replaced(machine, content):
    cfg = bf16_config()
    path = dtype_choice.cache_path(cfg)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    plan = plan_of(cfg, device="cpu")
    assert (plan.dtype, plan.dtype_source, machine.calls) == ("float32", "measured", 1)
    assert json.loads(path.read_text())["dtype"] == "float32"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    assert plan_of(cfg, device="cpu").dtype_source == "cached" and machine.calls == 1


def test_an_explicit_dtype_measures_nothing(machine):
    cfg = bf16_config()
    for dtype in ("float32", "bfloat16", "float16"):
        plan = plan_of(cfg, device="cpu", dtype=dtype)
        assert plan.dtype == ("bfloat16" if dtype == "float16" else dtype) and plan.dtype_source == "given"
    assert machine.calls == 0 and not dtype_choice.cache_path(cfg).exists()


def test_one_candidate_measures_nothing_and_keeps_the_rule(machine, monkeypatch):
    """No oneDNN bf16 (this machine's kind): float32, as before. With oneDNN bf16 but no fused step (the
    torch backend, enforce_eager, prepack_weights asked for), int8 (one int8 decode path either way), or a
    float32 checkpoint: the rule's dtype, untimed. Kernels not built: the rule, untimed (resolving never
    compiles)."""
    cfg = bf16_config()
    for options in ({"attention_backend": "torch"}, {"enforce_eager": True}, {"prepack_weights": True},
                    {"quantization": "int8"}):
        plan = plan_of(cfg, device="cpu", **options)
        assert (plan.dtype, plan.dtype_source) == ("bfloat16", "only candidate"), options
    assert plan_of(tiny_hf_config(), device="cpu").dtype_source == "only candidate"  # float32 checkpoint
    monkeypatch.setattr(cpu_kernels, "is_built", lambda: False)
    assert plan_of(cfg, device="cpu").dtype_source == "unmeasured"
    monkeypatch.setattr(linear, "onednn_bf16_available", lambda: False)
    plan = plan_of(cfg, device="cpu")
    assert (plan.dtype, plan.dtype_source, plan.decode_mode) == ("float32", "only candidate",
                                                                 DecodeMode.FUSED_CPU)
    assert machine.calls == 0 and not dtype_choice.cache_path(cfg).exists()


def test_a_failed_measurement_warns_and_keeps_the_rule_unkept(machine, monkeypatch):
    def broken(hf_config, candidates):
        raise RuntimeError("no memory")

    monkeypatch.setattr(dtype_choice, "measure", broken)
    cfg = bf16_config()
    with pytest.warns(UserWarning, match="could not time"):
        plan = plan_of(cfg, device="cpu")
    assert (plan.dtype, plan.dtype_source) == ("bfloat16", "unmeasured")
    assert not dtype_choice.cache_path(cfg).exists()


# ------------------------------------------------------------------------ the real measurement, this machine
def test_the_real_measurement_times_this_machines_candidates(cpu_kernels):
    """measure() on a tiny bf16 shape, for the candidates the plan finds here: a positive time for each
    (float32 fused with bf16 copies everywhere the kernels are; bfloat16 with oneDNN where it has bf16), and
    the stand-in's layer-by-layer path runs too (the bfloat16 candidate's, here in float32 since oneDNN
    bf16 may be missing)."""
    import dataclasses

    from nanoengine.config import EngineConfig
    from nanoengine.plan_cpu import dtype_candidates

    cfg = bf16_config()
    candidates = dtype_candidates(EngineConfig(device="cpu"), "cpu", cfg, "cpu")
    assert [c.dtype for c in candidates] == ["float32"] + (["bfloat16"] if linear.onednn_bf16_available()
                                                            else [])
    assert candidates[0].fused and candidates[0].bf16_rows > 0 and not candidates[0].prepack
    ms = dtype_choice.measure(cfg, candidates)
    assert set(ms) == {c.dtype for c in candidates}
    assert all(0 < t < 1e3 and math.isfinite(t) for t in ms.values())
    sizes = dtype_choice.copy.deepcopy(cfg)
    sizes.num_hidden_layers, sizes.vocab_size, sizes.tie_word_embeddings = 1, 512, False
    eager = dataclasses.replace(candidates[0], fused=False)
    stack_s, head_s = dtype_choice.time_stand_in(sizes, eager, cpu_kernels)
    assert stack_s > 0 and head_s > 0


def test_writers_racing_never_leave_a_half_written_file(tmp_path, monkeypatch):
    """Processes starting together (replicas, ranks) write whole files under temporary names and rename
    them: a reader sees no file or a whole one, never a torn one, and no temporary file stays."""
    import threading

    monkeypatch.setenv("NANOENGINE_HOME", str(tmp_path))
    cfg = bf16_config()
    path = dtype_choice.cache_path(cfg)
    names = ["float32", "bfloat16"]
    seen, stop = [], threading.Event()

    def write(i: int) -> None:
        for j in range(30):
            best = names[(i + j) % 2]
            dtype_choice.write_cached(path, dtype_choice.DtypeChoice(best, "measured",
                                                                     (("float32", 1.0), ("bfloat16", 2.0))))

    def read() -> None:
        while not stop.is_set():
            seen.append(dtype_choice.read_cached(path, names) if path.exists() else "absent")

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    reader.join()
    assert seen and None not in seen  # a file that exists always reads whole
    assert [p.name for p in path.parent.iterdir()] == [path.name]


@pytest.mark.xdist_group("tiny")
def test_the_benchmark_records_the_dtype_and_how_it_was_chosen(monkeypatch):
    from nanoengine.bench import hardware
    from nanoengine.bench.run import bench

    monkeypatch.setattr(hardware, "measure", lambda dtype, device: {"gemm_gflops": 1.0, "memory_gbs": 1.0})
    r = bench("tiny-qwen3", "smoke", peers=[], out_dir=None, figures_dir=None, quiet=True, step_profile=False,
              engine_options={"dtype": "float32"})
    assert r["dtype_choice"] == {"dtype": "float32", "source": "given", "ms_per_step": {}}
    assert r["plan"]["dtype_source"] == "given" and r["plan"]["dtype_ms_per_step"] == {}
    json.dumps(r["plan"])  # plain JSON values
