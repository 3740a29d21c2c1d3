"""The learner's pieces inside the engine (nanoengine.pieces, `use_exercises`): the reference solutions
plugged in give the engine's own tokens and schedule (the capstone), an untouched stub is an error naming its
exercise, and a wrong piece makes the capstone fail with a message that says where."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from nanoengine import LLM, SamplingParams
from nanoengine.config import EngineConfig
from nanoengine.errors import ExerciseError, ExerciseNotDoneError, InvalidValueError
from nanoengine.pieces import CHAPTERS, PieceSelection, chapters_of, selected, use_exercises
from nanoengine.pieces.capstone import CHAPTER_MODELS, CHAPTER_OPTIONS, capstone

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "solutions"
STUBS = ROOT / "exercises"  # generated from solutions/, untouched in the repository

pytestmark = pytest.mark.xdist_group("tiny")


def chapter_with(tmp_path: Path, chapter: str, extra: str) -> Path:
    """A folder holding the solution of `chapter` with `extra` code appended (redefining one piece)."""
    src = next(SOLUTIONS.glob(f"{chapter}_*.py"))
    shutil.copy(src, tmp_path / src.name)
    with open(tmp_path / src.name, "a") as f:
        f.write("\n\n" + textwrap.dedent(extra))
    return tmp_path


def model_of(chapter: str) -> str:
    """The smallest model a chapter's pieces run in (tiny-qwen3, or tiny-qwen3-moe for ch10's)."""
    return CHAPTER_MODELS.get(chapter, ("tiny-qwen3",))[0]


@pytest.mark.slow
@pytest.mark.parametrize("chapter", list(CHAPTERS))
def test_capstone_passes_on_the_solutions(chapter):
    result = capstone(chapter, SOLUTIONS, models=(model_of(chapter),))
    assert result.passed, result.rows
    assert "preemptions" in result.rows[0][2]


@pytest.mark.slow
def test_all_chapters_pieces_together_give_the_engines_tokens():
    prompts = ["The capital of France is", "Once upon a time, in a land far away, there lived a"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    opts = dict(dtype="float32", max_num_batched_tokens=16)
    want = [o.outputs[0].token_ids
            for o in LLM("tiny-qwen3", **opts).generate(prompts, params, use_tqdm=False)]
    # (ch09's pieces run only while speculating, which ch05's scheduler pass does not, and ch10's only in an
    # MoE model: tested apart below)
    llm = LLM("tiny-qwen3", use_exercises=[c for c in CHAPTERS if c not in ("ch09", "ch10")],
              exercises_dir=str(SOLUTIONS), **opts)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    # the pieces really are in place: the learner's backend, block manager, scheduler and sampler
    runner = llm.engine.executor.runner
    assert runner.attn_backend.__name__ == "LearnerPromptAttention"
    assert type(llm.engine.block_manager).__name__ == "LearnerBlockManager"
    assert type(llm.engine.scheduler).__name__ == "LearnerScheduler"
    assert type(llm.engine.executor.sampler).__name__ == "LearnerSampler"
    assert runner.kv_cache_shape[1] == llm.plan.block_size  # chapter 03's blocks-first layout


@pytest.mark.parametrize("chapter", list(CHAPTERS))
def test_a_stub_is_an_error_naming_its_exercise(chapter):
    spec = {k: v for k, v in CHAPTER_OPTIONS.get(chapter, {}).items() if k == "speculative_config"}
    with pytest.raises(ExerciseNotDoneError, match=rf"Exercise {int(chapter[2:])}\.\d") as e:
        LLM(model_of(chapter), use_exercises=[chapter], exercises_dir=str(STUBS), dtype="float32", **spec)
    assert "stub" in str(e.value) and chapter in str(e.value)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def test_ch09_pieces_speculate_over_ch04s_block_manager_or_are_refused_without_speculation():
    prompt = ["The cat sat on the mat. The cat sat on the mat. The cat"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = LLM("tiny-qwen3", dtype="float32").generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM("tiny-qwen3", dtype="float32", use_exercises=["ch04", "ch09"], exercises_dir=str(SOLUTIONS),
              speculative_config=NGRAM, num_kvcache_blocks=8, block_size=4)
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == want
    engine = llm.engine
    assert type(engine.drafts.proposer).__name__ == "LearnerNgramProposer"
    assert engine.drafts.accept.__name__ == "learner_accept"
    bm_classes = [c.__name__ for c in type(engine.block_manager).__mro__]
    assert bm_classes[:2] == ["LearnerRollbackBlockManager", "LearnerBlockManager"]  # 9.4 over 4.1-4.4
    counts = engine.spec_counts
    assert 0 < counts.accepted <= counts.proposed and len(counts.record) == counts.verifications
    with pytest.raises(InvalidValueError, match="run only while speculating.*speculative_config is not set"):
        LLM("tiny-qwen3", use_exercises=["ch09"], exercises_dir=str(SOLUTIONS))


def test_ch10_pieces_route_every_moe_layer_or_are_refused_on_a_dense_model():
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids
            for o in LLM("tiny-qwen3-moe", dtype="float32").generate(prompts, params, use_tqdm=False)]
    llm = LLM("tiny-qwen3-moe", dtype="float32", use_exercises=["ch02", "ch10"], exercises_dir=str(SOLUTIONS))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    blocks = [m for m in llm.engine.executor.runner.model.modules() if type(m).__name__ == "SparseMoeBlock"]
    assert blocks and all(b.route.__name__ == "learner_route" for b in blocks)
    assert all(b.experts.experts_forward.__name__ == "learner_experts" for b in blocks)
    with pytest.raises(InvalidValueError, match=r"run only in a mixture-of-experts.*'qwen3' is dense"):
        LLM("tiny-qwen3", use_exercises=["ch10"], exercises_dir=str(SOLUTIONS))


@pytest.mark.slow
def test_a_ch10_router_without_renormalization_fails_the_capstone(tmp_path):
    folder = chapter_with(tmp_path, "ch10", '''
        def route(logits, top_k, norm_topk_prob):
            """Exercise 10.1: the classic mistake, the top-k probabilities never renormalized."""
            weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
            return weights.to(logits.dtype), ids
        ''')
    result = capstone("ch10", folder)
    assert not result.passed and "differs" in result.rows[0][2], result.rows


@pytest.mark.slow
def test_a_ch09_rule_that_keeps_no_draft_fails_the_capstone_with_the_same_text(tmp_path):
    folder = chapter_with(tmp_path, "ch09", '''
        def accept_greedy(drafts, verified):
            """Exercise 9.2: the model's first token only, never a draft (exact, but no faster)."""
            return verified[:1]
    ''')
    result = capstone("ch09", folder, models=("tiny-qwen3",))
    assert not result.passed and "same text, but" in result.rows[0][2], result.rows


@pytest.mark.slow
def test_a_wrong_rope_fails_the_capstone_at_the_first_wrong_token(tmp_path):
    folder = chapter_with(tmp_path, "ch02", '''
        def apply_rope(x, positions, theta):
            """Exercise 2.2: the classic mistake, the interleaved layout (pairs 2i, 2i+1)."""
            d = x.shape[-1]
            inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
            ang = positions.float()[:, None] * inv_freq[None, :]
            cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
            a, b = x.float()[..., 0::2], x.float()[..., 1::2]
            return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2).to(x.dtype)
        ''')
    result = capstone("ch02", folder, models=("tiny-qwen3",))
    assert not result.passed
    assert "differs" in result.rows[0][2] and "token" in result.rows[0][2], result.rows


@pytest.mark.slow
def test_a_prefix_lookup_that_never_hits_keeps_the_text_but_fails_on_the_schedule(tmp_path):
    folder = chapter_with(tmp_path, "ch04", '''
        def count_cached_tokens(token_ids, cached, block_size):
            """Exercise 4.2: never a hit (the text stays right; the schedule does not)."""
            return 0
        ''')
    result = capstone("ch04", folder, models=("tiny-qwen3",))
    assert not result.passed
    assert "same text" in result.rows[0][2] and "prefix-hit tokens" in result.rows[0][2], result.rows


@pytest.mark.slow
def test_a_row_parallel_forward_without_its_all_reduce_fails_the_tp_capstone(tmp_path):
    # the learner's collectives really are the engine's: a row-parallel forward that keeps its rank's
    # partial sum changes the two-process run's tokens
    folder = chapter_with(tmp_path, "ch07", '''
        def row_parallel_forward(x_shard, weight_shard, bias):
            """Exercise 7.6: the classic mistake, no all-reduce (each rank keeps its partial sum)."""
            out = F.linear(x_shard, weight_shard)
            return out if bias is None else out + bias
        ''')
    result = capstone("ch07", folder, models=("tiny-qwen3",))
    assert not result.passed
    assert "differs" in result.rows[0][2] and "token" in result.rows[0][2], result.rows


def test_what_a_piece_raises_or_returns_wrongly_names_the_exercise(tmp_path):
    folder = chapter_with(tmp_path, "ch02", '''
        def rms_norm(x, weight, eps):
            """Exercise 2.1: returns the wrong shape."""
            return x.sum(-1)
        ''')
    llm = LLM("tiny-qwen3", use_exercises=["ch02"], exercises_dir=str(folder), dtype="float32")
    with pytest.raises(ExerciseError, match=r"Exercise 2\.1 \(rms_norm\) returned a tensor of shape"):
        llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)


def test_options_are_checked():
    assert chapters_of(["ch03", 2, "02"]) == ("ch02", "ch03")
    with pytest.raises(InvalidValueError, match="not a chapter with engine pieces"):
        EngineConfig(use_exercises=["ch08"])
    with pytest.raises(InvalidValueError, match="is not a folder"):
        EngineConfig(use_exercises=["ch02"], exercises_dir="/no/such/folder")
    with pytest.raises(InvalidValueError, match="use_exercises is empty"):
        EngineConfig(use_exercises=[], exercises_dir=str(SOLUTIONS))
    with pytest.raises(InvalidValueError, match="use_exercises is empty"):  # and no use_exercises() default
        LLM("tiny-qwen3", exercises_dir=str(SOLUTIONS))
    with pytest.raises(InvalidValueError, match="attention_backend='triton' cannot be used"):
        LLM("tiny-qwen3", use_exercises=["ch03"], exercises_dir=str(SOLUTIONS), attention_backend="triton")


def test_use_exercises_sets_the_default_of_later_engines():
    """The default is applied where an engine is built (pieces.selected), never read by EngineConfig."""
    with use_exercises(["ch04"], exercises_dir=SOLUTIONS):
        assert EngineConfig().use_exercises is None  # the config keeps what was asked: nothing
        assert selected(None, None) == PieceSelection(("ch04",), str(SOLUTIONS))
        assert not selected((), None)  # an engine that says otherwise
        llm = LLM("tiny-qwen3", dtype="float32", num_kvcache_blocks=8)
        assert llm.plan.pieces.chapters == ("ch04",)
        assert type(llm.engine.block_manager).__name__ == "LearnerBlockManager"
    assert not selected(None, None)


def test_chapter_03_decode_needs_a_kernel_that_can_run_here(tmp_path):
    """ch03 decodes with the learner's 3.8 Triton kernel: with no GPU and a kernel not defined under Triton's
    interpreter, building the engine says what to change. (Without triton it decodes with the learner's 3.6:
    tests/test_no_triton.py.)"""
    import types

    import torch

    from nanoengine.pieces import ch03

    no_triton = types.SimpleNamespace(__file__="ch03_paged_kv.py", triton=None, paged_decode_kernel=None)
    ch03.check_kernel_can_run(no_triton)  # nothing to check: decode runs the learner's 3.6
    triton = pytest.importorskip("triton")
    if not torch.cuda.is_available():
        compiled = triton.runtime.jit.JITFunction(identity)  # what @triton.jit gives without the interpreter
        with pytest.raises(ExerciseError, match="TRITON_INTERPRET"):
            ch03.check_kernel_can_run(types.SimpleNamespace(__file__="ch03_paged_kv.py", triton=triton,
                                                            paged_decode_kernel=compiled))
        # the kernel interpreted, but triton.language imported before the interpreter was on (torch.compile
        # first, say): its own jit functions (tl.zeros) are compiled ones, which the interpreter cannot call
        interpreted = triton.runtime.interpreter.InterpretedFunction(identity)
        tl = types.SimpleNamespace(zeros=compiled)
        with pytest.raises(ExerciseError, match="triton was imported before TRITON_INTERPRET=1"):
            ch03.check_kernel_can_run(types.SimpleNamespace(__file__="ch03_paged_kv.py", triton=triton, tl=tl,
                                                            paged_decode_kernel=interpreted))
        ch03.check_kernel_can_run(types.SimpleNamespace(__file__="ch03_paged_kv.py", triton=triton,
                                                        tl=types.SimpleNamespace(zeros=interpreted),
                                                        paged_decode_kernel=interpreted))


def identity(x):
    return x


@pytest.mark.slow
def test_chapter_03_decodes_with_the_learners_kernel(tmp_path):
    """The capstone's decode goes through the learner's 3.8 launcher: one token too few fails it."""
    folder = chapter_with(tmp_path, "ch03", '''
        _right = triton_paged_decode

        def triton_paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
            """Exercise 3.8's launcher, one token too few (the new token's own K/V left out)."""
            return _right(q, k_cache, v_cache, block_tables, (context_lens - 1).clamp_min(0), scale)
        ''')
    result = capstone("ch03", folder, models=("tiny-qwen3",))
    assert not result.passed
    assert "differs" in result.rows[0][2] and "token" in result.rows[0][2], result.rows
