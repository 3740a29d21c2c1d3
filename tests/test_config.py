"""EngineConfig and EnginePlan: engine options are checked when the LLM is built (clear errors, near-miss
names), options that cannot work here are refused with what would, the attention backend and block size are
picked per device (flash_attn, then triton on CUDA; triton on CPU only when asked, with the interpreter
switched on), and resolving for the device picks without compiling (fp16 is never used on CPU)."""

from __future__ import annotations

import pytest
import torch
from plans import plan_of, tiny_hf_config

from nanoengine import LLM, SamplingParams
from nanoengine.config import EngineConfig
from nanoengine.plan import DecodeMode

pytestmark = pytest.mark.xdist_group("tiny")
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def test_bad_engine_options_are_clear_errors():
    with pytest.raises(ValueError, match="max_position_embeddings=4096"):
        LLM("tiny-qwen3", max_model_len=10**6)
    with pytest.raises(ValueError, match="block_size"):
        LLM("tiny-qwen3", block_size=0)
    with pytest.raises(ValueError, match="can never fit the KV pool of 2 blocks"):
        LLM("tiny-qwen3", num_kvcache_blocks=2, block_size=4).generate(["x " * 20], GREEDY, use_tqdm=False)


def test_unknown_option_is_an_error():
    with pytest.raises(TypeError, match=r"'max_num_seq'.*did you mean 'max_num_seqs'"):
        LLM("tiny-qwen3", max_num_seq=4)


def test_fp16_is_never_used_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("CPU-only rule")
    llm = LLM("tiny-qwen3", dtype="float16", num_kvcache_blocks=8)
    assert llm.plan.dtype == "bfloat16" and llm.config.dtype == "float16"  # as resolved, and as asked


@pytest.mark.parametrize("options,match", [
    ({"attention_backend": "sdpa"}, r"attention_backend must be one of"),
    ({"attention_backend": "flash_attn", "device": "cpu"},
     r"'flash_attn' runs on device='cuda' only.*'triton'"),
    ({"attention_backend": "triton", "block_size": 24}, r"power-of-two block_size, not 24; use 16 or 32"),
])
def test_options_that_cannot_work_are_refused_not_ignored(options, match, monkeypatch):
    from nanoengine.kernels import triton_support

    monkeypatch.setattr(triton_support, "installed", lambda: True)  # so that triton's row fails on its block
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # size alone, on any machine
    with pytest.raises(ValueError, match=match):
        LLM("tiny-qwen3", **options)


def test_triton_on_cpu_needs_the_interpreter_switched_on(monkeypatch):
    """On CPU the Triton kernels run only in Triton's interpreter: without TRITON_INTERPRET=1 the config says
    so (instead of a crash inside triton at the first kernel launch); with it, 'triton' is taken as asked."""
    if torch.cuda.is_available():
        pytest.skip("CPU-only rule")
    from nanoengine.kernels import triton_support

    monkeypatch.setattr(triton_support, "installed", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError,
                       match=r"'triton' cannot run here: on device='cpu'.*TRITON_INTERPRET=1.*'cpu'"):
        plan_of(device="cpu", attention_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = plan_of(device="cpu", attention_backend="triton")
    assert (cfg.attention_backend, cfg.block_size) == ("triton", 16)
    assert plan_of(device="cpu").attention_backend in ("cpu", "torch")  # never auto
    monkeypatch.setattr(triton_support, "installed", lambda: False)
    with pytest.raises(ValueError,
                       match=r"triton package is not installed: pip install -c constraints.txt triton"):
        plan_of(device="cpu", attention_backend="triton")


@pytest.fixture
def fake_cuda(monkeypatch):
    """Resolve as on a CUDA machine (nothing runs): set flash_attn's and triton's availability by hand
    (enforce_eager=True where the torch backend may be picked: graphs are not what these tests are about)."""
    from nanoengine.attention import flash_attn_backend
    from nanoengine.kernels import triton_support

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    state = {"flash_attn": None, "triton": None}  # None = available, else the problem
    monkeypatch.setattr(flash_attn_backend, "problem", lambda: state["flash_attn"])
    monkeypatch.setattr(triton_support, "problem", lambda device: state["triton"])
    return state


@pytest.mark.parametrize("options,missing,want", [
    ({"dtype": "bfloat16"}, (), ("flash_attn", 256)),
    ({"dtype": "bfloat16", "block_size": 512}, (), ("flash_attn", 512)),
    ({"dtype": "bfloat16", "block_size": 16}, (), ("triton", 16)),  # auto keeps the user's block size
    ({"dtype": "float32"}, (), ("triton", 16)),  # flash-attn has no float32
    ({"dtype": "bfloat16"}, ("flash_attn",), ("triton", 16)),
    ({"dtype": "bfloat16"}, ("flash_attn", "triton"), ("torch", 16)),
    ({"dtype": "bfloat16", "attention_backend": "triton", "block_size": 64}, (), ("triton", 64)),
    ({"dtype": "float32", "attention_backend": "torch"}, (), ("torch", 16)),
])
def test_cuda_picks_flash_attn_then_triton_with_a_block_size_each_can_use(fake_cuda, options, missing, want):

    for name in missing:
        fake_cuda[name] = f"{name} is missing"
    if len(missing) == 2:
        with pytest.warns(UserWarning, match=r"neither flash_attn.*nor triton.*using the slower torch"):
            cfg = plan_of(device="cuda", enforce_eager=True, **options)
    else:
        cfg = plan_of(device="cuda", enforce_eager=True, **options)
    assert (cfg.attention_backend, cfg.block_size) == want


@pytest.mark.parametrize("options,missing,match", [
    ({"attention_backend": "flash_attn", "dtype": "bfloat16", "block_size": 16}, (),
     r"multiple of 256, not block_size=16; leave block_size unset \(256\) or use attention_backend='triton'"),
    ({"attention_backend": "flash_attn", "dtype": "float32"}, (),
     r"float16 or bfloat16, not dtype='float32'"),
    ({"attention_backend": "flash_attn", "dtype": "bfloat16"}, ("flash_attn",),
     r"flash_attn is missing; pip install flash-attn, or use attention_backend='triton'"),
    ({"attention_backend": "triton"}, ("triton",), r"'triton' cannot run here: triton is missing"),
    ({"attention_backend": "triton", "block_size": 100}, (),
     r"power-of-two block_size, not 100; use 64 or 128"),
    ({"attention_backend": "cpu"}, (), r"'cpu' runs on device='cpu' only; on CUDA use 'auto'"),
])
def test_cuda_refuses_a_backend_or_block_size_that_cannot_work(fake_cuda, options, missing, match):

    for name in missing:
        fake_cuda[name] = f"{name} is missing"
    with pytest.raises(ValueError, match=match):
        plan_of(device="cuda", **options)


@pytest.mark.parametrize("dims,tp,match", [
    ({"num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152}, 2,  # SmolLM2-135M's heads
     r"tensor_parallel_size=2 must divide the model's 9 attention heads.*3 KV heads"
     r".*sizes that work.*: 1, 3$"),
    ({"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1001}, 2,
     r"1001 vocabulary \(vocab_size\).*sizes that work for this model: 1$"),
    ({"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}, 4,
     r"must divide the model's 2 KV heads \(num_key_value_heads\) evenly.*: 1, 2$"),
])
def test_tensor_parallel_size_must_divide_heads_kv_heads_and_vocab(dims, tp, match):
    """Refused while resolving the config, before any worker process starts, with the sizes that would
    work."""
    from transformers import Qwen3Config

    from nanoengine import assets

    hf = Qwen3Config(**{**assets.TINY_QWEN3_DIMS, **dims})
    with pytest.raises(ValueError, match=match):
        plan_of(hf, device="cpu", tensor_parallel_size=tp)
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)




def test_fused_decode_only_where_it_mirrors_the_forward():
    """Decode steps run the layers in one C++ call on CPU with the cpu backend, and not with enforce_eager,
    the graphs' stand-in, the learner's pieces or tensor parallelism (what FusedDecode does not mirror)."""

    resolved = plan_of(device="cpu")
    assert (resolved.decode_mode is DecodeMode.FUSED_CPU) is (resolved.attention_backend == "cpu")
    if resolved.attention_backend != "cpu":
        pytest.skip("the C++ kernels cannot be built here")
    for options in ({"attention_backend": "torch"}, {"graph_stand_in": True}, {"enforce_eager": True},
                    {"tensor_parallel_size": 2}, {"use_exercises": ["ch05"], "exercises_dir": "solutions"}):
        assert plan_of(device="cpu", **options).decode_mode is not DecodeMode.FUSED_CPU, options


def test_resolving_never_compiles(monkeypatch):
    """'auto' asks whether the CPU kernels are built or buildable; it never builds them itself."""
    from nanoengine.kernels import cpu

    def no_build():
        raise AssertionError("resolve_plan must not load or compile the kernels")

    monkeypatch.setattr(cpu, "load", no_build)
    monkeypatch.setattr(cpu, "build_problem", lambda: None)
    assert plan_of(device="cpu").attention_backend == "cpu"
    monkeypatch.setattr(cpu, "build_problem", lambda: "no C++ compiler ('c++' not found)")
    with pytest.warns(UserWarning, match=r"cannot be built here \(no C\+\+ compiler.*using the slower torch"):
        assert plan_of(device="cpu").attention_backend == "torch"
    with pytest.raises(ValueError, match=r"attention_backend='cpu' cannot be built here.*'torch'"):
        plan_of(device="cpu", attention_backend="cpu")


def test_auto_dtype_on_cpu_follows_the_checkpoint_unless_bf16_is_slow_here(monkeypatch):
    """'auto' keeps a bf16 checkpoint in bf16 where oneDNN has fast bf16 (AVX-512, AMX), else runs float32
    (bf16 matmuls are ~8x slower than float32 on an AVX2-only CPU); an explicit dtype is kept."""
    from nanoengine.layers import linear

    cfg = tiny_hf_config()
    cfg.dtype = "bfloat16"
    for fast, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(linear, "onednn_bf16_available", lambda fast=fast: fast)
        assert plan_of(cfg, device="cpu", attention_backend="torch").dtype == want
        assert plan_of(cfg, device="cpu", attention_backend="torch", dtype="bfloat16").dtype == "bfloat16"


def test_the_plan_is_frozen_and_concrete():
    """Settings apart from the plan: the config keeps what was asked ('auto', None), the plan a concrete value
    for each (nothing downstream checks for None), and it cannot be changed after it is made."""
    import dataclasses

    config = EngineConfig(device="cpu")
    plan = plan_of(device="cpu")
    assert (config.attention_backend, config.block_size, config.max_model_len) == ("auto", None, None)
    assert all(getattr(plan, f.name) is not None for f in dataclasses.fields(plan))
    assert plan.attention_backend in ("cpu", "torch") and plan.block_size == 16 and plan.max_model_len == 4096
    assert plan.kv_cache.num_blocks >= 1 and isinstance(plan.decode_mode, DecodeMode)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.block_size = 32
    described = plan.describe()
    assert described["decode_mode"] == plan.decode_mode.value and "hf_config" not in described
