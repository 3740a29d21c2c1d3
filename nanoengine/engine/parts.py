"""The parts an engine is built from, assembled in one place: the engine's own, or the learner's where the
plan's pieces say so (`use_exercises`, nanoengine.pieces). All chapters.

`assemble(plan)` loads the learner's chapter files once (an untouched stub is an error naming its exercise,
right here) and returns `EngineParts`, which the engine hands down: each rank's ModelRunner builds its model
and decode graphs with them, the driver its block manager, scheduler, input builder, sampler and step loop
(engine/step.py's `StepLoop`, or overlap scheduling's `OverlapLoop`, engine/overlap.py, where the plan's
`async_scheduling` says so). A worker process calls `assemble` on the plan it is sent, so every rank runs the
same pieces.

| pieces | replace |
|---|---|
| ch02 | the model's kernels (norms, rotary); a prompt's attention over its own tokens |
| ch03 | the attention metadata; the K/V store, Triton decode kernel, prefill attention (blocks first) |
| ch04 | the block manager's hashes, prefix lookup and freeing; the scheduler's admission |
| ch05 | the scheduler's step; the sampler |
| ch06 | the decode graphs (the CPU stand-in) |
| ch07 | the tensor-parallel group's sharding, and its column-, row- and vocab-parallel forwards |
| ch09 | speculation's n-gram proposer, its acceptance rule, the block manager's `rollback_blocks` |
| ch10 | an MoE model's router and expert forward (`moe`, handed to the model when it is built) |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanoengine import kernels
from nanoengine.attention import AttentionBackend, get_backend
from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.graphs import DecodeGraphs
from nanoengine.engine.inputs import PAGED, AttentionLayout
from nanoengine.engine.scheduler import Scheduler
from nanoengine.engine.step import StepLoop
from nanoengine.kernels import triton_support
from nanoengine.layers.moe import ENGINE_MOE, MoEPieces
from nanoengine.layers.sampler import Sampler
from nanoengine.layers.tp_group import TPGroup
from nanoengine.models.hf_config import rope_theta
from nanoengine.pieces import PIECES

# (forward, kind, max_num_seqs, max_blocks, hidden_size, block_size, dtype, device) -> decode graphs, which
# answer can_replay(inp), replay(inp) and capture(buckets) as DecodeGraphs does
GraphsFactory = Callable[..., Any]


@dataclass(frozen=True)
class EngineParts:
    attention_backend: type[AttentionBackend]
    kernels: Any  # the model's fused ops (C++ or torch.compile'd), the learner's, or None (eager PyTorch)
    tp_group: Callable[[TPGroup], TPGroup]  # a rank's group as the layers see it
    graphs: GraphsFactory
    block_manager_class: type[BlockManager]
    scheduler_class: type[Scheduler]
    attention_layout: AttentionLayout  # how the input builder lays out attention metadata
    sampler: Sampler
    # speculative decoding's "ngram" proposer and acceptance rule (drafts, verified -> kept tokens): the
    # learner's (chapter 09), or None for the engine's own (nanoengine/spec/, imported only when it drafts)
    ngram_proposer_class: type | None = None
    accept: Callable[[list[int], list[int]], list[int]] | None = None
    moe: MoEPieces = ENGINE_MOE  # an MoE model's router and expert forward (layers/moe.py)
    loop: type[Any] = StepLoop  # the engine's step loop, made over the engine: loop(engine)


def same_group(group: TPGroup) -> TPGroup:
    return group


def fused_moe_on_triton(plan: Any) -> bool:
    """Do an MoE model's experts run the Triton fused-MoE kernel (kernels/triton_moe.py)? With
    attention_backend='triton' (the plan checked that triton runs here: on CPU, in its interpreter), and on
    CUDA wherever triton can run, whichever attention backend serves."""
    if plan.attention_backend == "triton":
        return True
    return plan.device == "cuda" and triton_support.problem("cuda") is None


def moe_pieces(plan: Any) -> MoEPieces:
    """The router and expert forward of an MoE model under this plan: the Triton fused-MoE kernel where
    `fused_moe_on_triton`, else the torch grouped GEMM (ENGINE_MOE). Imports triton only when it is used: on
    CPU the interpreter must be switched on before the kernels are defined."""
    if fused_moe_on_triton(plan):
        from nanoengine.kernels.triton_moe import triton_fused_experts

        return MoEPieces(ENGINE_MOE.route, triton_fused_experts)
    return ENGINE_MOE


def assemble(plan: Any) -> EngineParts:
    """The parts of an engine under this EnginePlan (see the module docstring)."""
    chosen = plan.pieces
    modules = {}
    if chosen:  # (the adapters are imported only for a learner's pieces)
        from nanoengine.pieces import ch02, ch03, ch04, ch05, ch06, ch07, ch09, ch10, learner

        folder = Path(chosen.folder)
        modules = {ch: learner.load(ch, folder) for ch in chosen.chapters}
        learner.check_done([(modules[ch], name, ch) for ch in modules for name in PIECES[ch]])

    backend = get_backend(plan.attention_backend)
    model_kernels = kernels.for_plan(plan)
    tp_group: Callable[[TPGroup], TPGroup] = same_group
    graphs: GraphsFactory = DecodeGraphs
    block_manager_class, scheduler_class = BlockManager, Scheduler
    attention_layout: AttentionLayout = PAGED
    sampler = Sampler(plan.seed, compile=plan.torch_compile)
    if "ch02" in modules:
        model_kernels = ch02.Kernels(modules["ch02"], rope_theta(plan.hf_config))
    if "ch03" in modules:
        backend = ch03.with_paged_kv(backend, modules["ch03"])
        attention_layout = ch03.LearnerLayout(modules["ch03"])
    if "ch02" in modules:  # over ch03's backend when both are used
        backend = ch02.with_prompt_attention(backend, modules["ch02"])
    if "ch04" in modules:
        block_manager_class = ch04.block_manager_class(modules["ch04"])
    if "ch05" in modules:  # your whole scheduling step (5.2, which admits through your 5.0)
        scheduler_class = ch05.scheduler_class(modules["ch05"], scheduler_class)
        sampler = ch05.LearnerSampler(modules["ch05"], plan.seed)
    if "ch06" in modules:
        graphs = ch06.graphs_factory(modules["ch06"])
    if "ch07" in modules:
        tp_group = ch07.group_wrapper(modules["ch07"])
    ngram_proposer_class, accept = None, None
    if "ch09" in modules:  # over ch04's block manager when both are used
        ngram_proposer_class = ch09.ngram_proposer_class(modules["ch09"])
        accept = ch09.accept(modules["ch09"])
        block_manager_class = ch09.block_manager_class(modules["ch09"], block_manager_class)
    moe = moe_pieces(plan)
    if "ch10" in modules:  # the learner's router and grouped forward, over the engine's choice
        moe = ch10.moe_pieces(modules["ch10"])
    loop: type[Any] = StepLoop
    if plan.async_scheduling:  # overlap scheduling's loop (chapter 06), imported only then
        from nanoengine.engine.overlap import OverlapLoop

        loop = OverlapLoop
    return EngineParts(backend, model_kernels, tp_group, graphs, block_manager_class, scheduler_class,
                       attention_layout, sampler, ngram_proposer_class, accept, moe, loop)

