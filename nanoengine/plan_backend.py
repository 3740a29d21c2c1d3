"""What a plan chooses to run the model with: the attention backend, the block size, how decode steps run and
torch.compile (`resolve_plan` in nanoengine/plan.py calls these). Chapters 03 and 06.

- attention backend: on CPU `cpu` (the C++ kernels) if they are built or can be built here, else `torch`;
  `triton` only when asked for, and only with TRITON_INTERPRET=1 set (its interpreter). On CUDA `flash_attn`
  if it imports and can serve the config (fp16/bf16; block size unset or a multiple of 256), else `triton`,
  else `torch`. Pieces of the learner's that run inside the model's forward take the torch backend;
- block size: 256 for flash_attn, else 16 (`triton` takes any power of two, `torch` and `cpu` any size);
- one decode mode (chapter 06): CUDA graphs on CUDA unless enforce_eager=True (or the backend cannot run in a
  graph); the graphs' CPU stand-in with graph_stand_in=True (or the learner's stand-in graphs); on CPU with
  the `cpu` backend the whole layer stack in one C++ call; else eager. A mixture-of-experts model decodes
  eagerly or through the CPU stand-in;
- torch.compile of the small fused ops and the sampler (default: on CUDA only).
Nothing here compiles: it asks whether the CPU kernels are built or can be built here, whether triton is
installed (and on CPU, whether its interpreter is on), and whether flash_attn imports.
"""

from __future__ import annotations

import warnings
from enum import StrEnum

from nanoengine.attention import flash_attn_backend, get_backend
from nanoengine.config import EngineConfig
from nanoengine.errors import InvalidValueError
from nanoengine.kernels import cpu as cpu_kernels
from nanoengine.kernels import triton_support
from nanoengine.pieces import PieceSelection

# Block size each attention backend works best with (the torch backend gathers whole blocks; flash-attn's
# paged KV cache needs a multiple of 256 tokens per block).
DEFAULT_BLOCK_SIZE = {"torch": 16, "cpu": 16, "triton": 16, "flash_attn": 256}
FLASH_ATTN_DTYPES = ("float16", "bfloat16")
FLASH_ATTN_BLOCK_MULTIPLE = 256


class DecodeMode(StrEnum):
    """How a decode-only step runs (every other step runs eagerly). Chapter 06."""
    CUDA_GRAPHS = "cuda_graphs"  # replay a CUDA graph captured per batch-size bucket
    STAND_IN = "stand_in"  # the CPU stand-in of CUDA graphs: the same buckets, padding and static buffers
    FUSED_CPU = "fused_cpu"  # every decoder layer in one C++ call (the CPU's analogue of a graph)
    EAGER = "eager"  # layer by layer, as every other step


def pick_attention_backend(config: EngineConfig, device: str, dtype: str, pieces: PieceSelection) -> str:
    """The backend for this device and dtype: 'auto' picks (see the module docstring), an explicit choice is
    checked; both say why when a backend cannot run here."""
    want = config.attention_backend
    if pieces.forward_pieces:
        allowed = pieces.attention_backends
        if want == "auto" or (want in allowed and want != "cpu"):
            return allowed[0] if want == "auto" else want
        if want in allowed and device == "cpu":
            return pick_cpu_kernels(want)
        raise InvalidValueError(f"EngineConfig: {pieces.option} plugs your "
                                f"{', '.join(pieces.forward_pieces)} pieces into the {' or '.join(allowed)} "
                                f"attention backend, so attention_backend={want!r} cannot be used with them; "
                                f"leave attention_backend='auto' (or '{allowed[0]}')")
    if want == "torch":
        return want
    if want == "triton":
        problem = triton_support.problem(device)
        if problem:
            raise InvalidValueError(f"EngineConfig: attention_backend='triton' cannot run here: {problem}")
        return want
    if device == "cpu":
        if want == "flash_attn":
            raise InvalidValueError("EngineConfig: attention_backend='flash_attn' runs on device='cuda' "
                                    "only; on CPU use 'auto' (the C++ kernels), 'cpu', 'torch' or 'triton' "
                                    "(TRITON_INTERPRET=1)")
        return pick_cpu_kernels(want)
    if want == "cpu":
        raise InvalidValueError("EngineConfig: attention_backend='cpu' runs on device='cpu' only; on CUDA "
                                "use 'auto', 'flash_attn', 'triton' or 'torch'")
    flash_problem = flash_attn_problem(flash_attn_backend.problem(), dtype, config.block_size)
    if want == "flash_attn":
        if flash_problem:
            raise InvalidValueError(f"EngineConfig: attention_backend='flash_attn' cannot run here: "
                                    f"{flash_problem}")
        return want
    if flash_problem is None:  # auto on CUDA
        return "flash_attn"
    triton_problem = triton_support.problem(device)
    if triton_problem is None:
        return "triton"
    warnings.warn(f"nanoengine: neither flash_attn ({flash_problem}) nor triton ({triton_problem}) can run "
                  "here; using the slower torch attention backend", stacklevel=4)
    return "torch"


def flash_attn_problem(import_problem: str | None, dtype: str, block_size: int | None) -> str | None:
    """Why flash_attn cannot serve this config (import, dtype, block size), or None."""
    if import_problem:
        return f"{import_problem}; pip install flash-attn, or use attention_backend='triton'"
    if dtype not in FLASH_ATTN_DTYPES:
        return (f"flash-attn computes in float16 or bfloat16, not dtype={dtype!r}; use dtype='bfloat16' or "
                "attention_backend='triton' (any dtype)")
    if block_size is not None and block_size % FLASH_ATTN_BLOCK_MULTIPLE:
        return (f"flash-attn's paged KV cache needs a block size that is a multiple of "
                f"{FLASH_ATTN_BLOCK_MULTIPLE}, not block_size={block_size}; leave block_size unset "
                f"({DEFAULT_BLOCK_SIZE['flash_attn']}) or use attention_backend='triton' for smaller blocks")
    return None


def pick_cpu_kernels(want: str) -> str:
    """'cpu' (the C++ kernels) on CPU when they are built or can be built here, else 'torch'."""
    problem = cpu_kernels.build_problem()
    if problem is None:
        return "cpu"
    if want == "cpu":
        raise InvalidValueError(f"EngineConfig: attention_backend='cpu' cannot be built here ({problem}); "
                                f"{cpu_kernels.FIX}; or use attention_backend='torch'")
    warnings.warn(cpu_kernels.fallback_line(problem), stacklevel=5)  # one line: why, and how to get them
    return "torch"


def check_block_size(backend: str, block_size: int) -> None:
    """A block size the chosen backend can use, or an error saying what would work (flash_attn's was
    checked when it was picked)."""
    if backend == "triton" and block_size & (block_size - 1):
        lower = 1 << (block_size.bit_length() - 1)
        raise InvalidValueError("EngineConfig: attention_backend='triton' needs a power-of-two block_size, "
                                f"not {block_size}; use {lower} or {lower * 2} "
                                f"(default {DEFAULT_BLOCK_SIZE['triton']})")


def pick_torch_compile(config: EngineConfig, device: str, backend: str, pieces: PieceSelection) -> bool:
    if pieces.forward_pieces and config.torch_compile:
        raise InvalidValueError("EngineConfig: torch_compile=True compiles the engine's own norm and rotary "
                                f"ops, but {pieces.option} runs yours; leave torch_compile unset")
    if config.torch_compile is None:
        return device == "cuda" and not pieces.forward_pieces
    if config.torch_compile and backend == "cpu":
        raise InvalidValueError("EngineConfig: torch_compile=True compiles the ops that "
                                "attention_backend='cpu' already runs as fused C++ kernels; use "
                                "attention_backend='torch' to compile them instead, or leave "
                                "torch_compile unset")
    return config.torch_compile


def pick_decode_mode(config: EngineConfig, device: str, backend: str, prepack: bool,
                     pieces: PieceSelection, moe: bool = False) -> DecodeMode:
    """How decode steps run, decided once (chapter 06; see DecodeMode). A mixture-of-experts model decodes
    eagerly or through the CPU stand-in (see the module docstring)."""
    if config.graph_stand_in and device != "cpu":
        raise InvalidValueError("EngineConfig: graph_stand_in=True is the CPU stand-in of CUDA graphs; on "
                                "CUDA the engine captures real graphs (leave graph_stand_in=False; "
                                "enforce_eager=True turns them off)")
    if pieces.graph_pieces and (device != "cpu" or config.enforce_eager):
        names = ", ".join(map(repr, pieces.graph_pieces))
        raise InvalidValueError(f"EngineConfig: use_exercises with {names} runs decode steps through your "
                                "stand-in graphs, which run on device='cpu' only and not with "
                                f"enforce_eager=True; drop {names} or use device='cpu' without enforce_eager")
    if config.graph_stand_in and config.enforce_eager:
        raise InvalidValueError("EngineConfig: graph_stand_in=True runs decode through (stand-in) graphs and "
                                "enforce_eager=True forbids graphs; pick one")
    if config.graph_stand_in or pieces.graph_pieces:  # the learner's graphs are stand-ins
        return DecodeMode.STAND_IN
    if device == "cuda" and not config.enforce_eager:
        if moe:
            warnings.warn("nanoengine: a mixture-of-experts model's expert forward reads its per-expert "
                          "token counts on the host, which a CUDA graph cannot capture, so decode steps run "
                          "eagerly (enforce_eager=True says so)", stacklevel=4)
            return DecodeMode.EAGER
        if not get_backend(backend).cuda_graphs:
            warnings.warn(f"nanoengine: attention_backend={backend!r} cannot run inside a CUDA graph (its "
                          "store decides on the host which slots to skip), so decode steps run eagerly; use "
                          "attention_backend='triton' for CUDA graphs, or enforce_eager=True to say so",
                          stacklevel=4)
            return DecodeMode.EAGER
        # the learner's pieces inside the model run eagerly (their Python may read tensors on the host)
        return DecodeMode.EAGER if pieces.forward_pieces else DecodeMode.CUDA_GRAPHS
    # the fused step mirrors the engine's own layers on one rank, with its bf16 (or int8) weight copies (with
    # oneDNN's packed bf16 weights and no int8, the layer-by-layer forward's linears are those)
    # (the fused step has no experts: a mixture-of-experts model decodes eagerly)
    if (device == "cpu" and backend == "cpu" and not config.enforce_eager and not pieces and not moe
            and config.tensor_parallel_size == 1 and (not prepack or config.quantization)):
        return DecodeMode.FUSED_CPU
    return DecodeMode.EAGER
