"""EngineConfig: every engine option, validated in one place, plus the one place that picks
device, dtype, attention backend and block size. Chapter 00.

Unknown options are an error (with a suggestion), never silently dropped; an option that cannot work here
(a backend whose package is missing, a block size a backend cannot use) is an error that says why and what
would work, never accepted and ignored. Resolving a config never compiles anything: it asks whether the
CPU kernels are built or can be built here (`nanoengine.kernels.cpu.build_problem`), whether triton is
installed (and on CPU, whether its interpreter is switched on), and whether flash_attn imports.

Attention backend and block size ('auto'/None are picked, an explicit choice is checked):
- cpu: `cpu` (the C++ kernels) if they build here, else `torch`; `triton` only when asked for, and only with
  TRITON_INTERPRET=1 set (its interpreter); block size 16.
- cuda: `flash_attn` if it imports and can serve the config (fp16/bf16; block size unset or a multiple of
  256), else `triton`, else `torch`; block size 256 for flash_attn, else 16.
`triton` takes any power-of-two block size; `torch` and `cpu` any positive one.

Per-step overhead (chapter 06), decided here once: decode steps replay CUDA graphs on CUDA unless
enforce_eager=True (or the backend is `torch`, whose store syncs with the host: eager, with a warning); on
CPU with the `cpu` backend they run the whole layer stack in one C++ call (`fused_decode`) unless
enforce_eager=True, else eagerly, or through the graphs' CPU stand-in with graph_stand_in=True. torch_compile
compiles the small fused ops and the sampler (default: on CUDA only).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from nanoengine.assets import DEFAULT_MODEL
from nanoengine.errors import InvalidTypeError, InvalidValueError

DTYPES = ("auto", "bfloat16", "float32", "float16")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "torch", "cpu", "triton", "flash_attn")
# Block size each attention backend works best with (the torch backend gathers whole blocks; flash-attn's
# paged KV cache needs a multiple of 256 tokens per block).
DEFAULT_BLOCK_SIZE = {"torch": 16, "cpu": 16, "triton": 16, "flash_attn": 256}
FLASH_ATTN_DTYPES = ("float16", "bfloat16")
FLASH_ATTN_BLOCK_MULTIPLE = 256


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    block_size: int | None = None
    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    num_kvcache_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    # vLLM's switch for CUDA graphs (chapter 06): on CUDA, decode steps replay graphs captured per batch-size
    # bucket unless enforce_eager=True. On CPU there are no graphs: with the `cpu` backend decode steps run the
    # layers in one C++ call instead (fused_decode), which enforce_eager=True also turns off (see graph_stand_in).
    enforce_eager: bool = False
    # CPU only: run decode steps through the CPU stand-in of CUDA graphs (the same buckets, padding and static
    # buffers; "replay" calls the recorded forward on them), so chapter 06 and the tests run the graph logic
    graph_stand_in: bool = False
    # torch.compile on the small fused ops (RMSNorm with residual add, SiLU-and-mul, rotary) and the sampler;
    # None = on CUDA only (on CPU inductor made these ops 1.5-6x slower; the C++ kernels fuse them there)
    torch_compile: bool | None = None
    prepack_weights: bool | None = None  # CPU bf16: oneDNN-packed linear weights; None = when supported
    tensor_parallel_size: int = 1
    seed: int = 0
    trace: bool = False
    # the learner's pieces (nanoengine.pieces): chapters whose exercises replace the engine's own components,
    # from exercises_dir (default exercises/); None = what nanoengine.pieces.use_exercises() set, else none
    use_exercises: tuple[str, ...] | None = None
    exercises_dir: str | None = None
    # filled by resolve(): the model's Hugging Face config
    hf_config: Any = field(default=None, repr=False)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        names = [f.name for f in dataclasses.fields(cls) if f.name != "hf_config"]
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k, names, n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise InvalidTypeError(f"unknown engine option(s): {', '.join(hints)}. Valid options: {', '.join(names)}")
        return cls(**kwargs)

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise InvalidValueError(f"EngineConfig: {msg}")

        if isinstance(self.exercises_dir, os.PathLike):
            self.exercises_dir = os.fspath(self.exercises_dir)
        self._check_types()
        from nanoengine import pieces

        self.use_exercises, self.exercises_dir = pieces.settle(self.use_exercises, self.exercises_dir)

        check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        check(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        check(self.attention_backend in BACKENDS,
              f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        check(self.block_size is None or (isinstance(self.block_size, int) and self.block_size >= 1),
              f"block_size must be a positive integer, got {self.block_size!r}")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        check(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1")
        check(self.num_kvcache_blocks is None or self.num_kvcache_blocks >= 1,
              "num_kvcache_blocks must be >= 1 (or None to size the cache from memory)")
        check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]")
        check(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
              f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")

    def _check_types(self) -> None:
        """Each option has the type its annotation says (bool is not an int here, an int is a float)."""
        accepts = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
                   "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                   "bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str),
                   "None": lambda v: v is None}
        for f in dataclasses.fields(self):
            kinds = [k.strip() for k in str(f.type).split("|")]
            if f.name == "hf_config" or not all(k in accepts for k in kinds):
                continue
            value = getattr(self, f.name)
            if not any(accepts[k](value) for k in kinds):
                raise InvalidTypeError(f"EngineConfig: {f.name} must be {' or '.join(kinds)}, got {value!r} "
                                       f"({type(value).__name__})")

    def resolve(self, hf_config: Any) -> EngineConfig:
        """Fill the 'auto' choices from the machine and the model's config (the one place for them)."""
        import torch

        from nanoengine.models.hf_config import checkpoint_dtype

        self.hf_config = hf_config
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise InvalidValueError("EngineConfig: device='cuda' but CUDA is not available; use device='cpu' or 'auto'")
        self._check_tensor_parallel(hf_config)
        from nanoengine.layers.linear import onednn_bf16_available

        if self.dtype == "auto":
            self.dtype = str(checkpoint_dtype(hf_config)).removeprefix("torch.")
            if self.device == "cpu" and self.dtype in ("float16", "bfloat16") and not onednn_bf16_available():
                # a CPU without AVX-512 or AMX has no fast 16-bit matmul: bf16 linears ran 8x slower than
                # float32 on an AVX2-only EPYC (and so does most of a laptop's prefill)
                self.dtype = "float32"
        if self.device == "cpu" and self.dtype == "float16":
            # fp16 matmuls have no fast path on CPU (~400x slower than bf16 here)
            self.dtype = "bfloat16"
        self.attention_backend = self._pick_attention_backend()
        if self.block_size is None:
            self.block_size = DEFAULT_BLOCK_SIZE[self.attention_backend]
        self._check_block_size()
        if self.prepack_weights is not False:  # None (auto) or True (asked for)
            packable = self.device == "cpu" and self.dtype == "bfloat16" and onednn_bf16_available()
            if self.prepack_weights and not packable:
                raise InvalidValueError("EngineConfig: prepack_weights=True needs device='cpu', dtype='bfloat16' and a "
                                 "torch build with oneDNN bf16 on this CPU; leave prepack_weights=None (auto)")
            self.prepack_weights = packable
        self._resolve_graphs_and_compile()
        model_max = getattr(hf_config, "max_position_embeddings", None) or 4096
        if self.max_model_len is None:
            self.max_model_len = model_max
        elif self.max_model_len > model_max:
            raise InvalidValueError(f"EngineConfig: max_model_len={self.max_model_len} is longer than the model's "
                             f"max_position_embeddings={model_max}; use max_model_len <= {model_max}")
        return self

    def _check_tensor_parallel(self, hf_config: Any) -> None:
        """Tensor parallelism splits attention heads, KV heads and the vocabulary evenly across ranks, and
        puts one rank on each GPU: refuse a size that cannot, before any process starts."""
        import torch

        tp = self.tensor_parallel_size
        if tp == 1:
            return
        from nanoengine.models.hf_config import num_kv_heads

        sizes = {"attention heads (num_attention_heads)": hf_config.num_attention_heads,
                 "KV heads (num_key_value_heads)": num_kv_heads(hf_config),
                 "vocabulary (vocab_size)": hf_config.vocab_size}
        bad = [f"{n} {what}" for what, n in sizes.items() if n % tp]
        if bad:
            works = [d for d in range(1, max(sizes.values()) + 1) if all(n % d == 0 for n in sizes.values())]
            works = [d for d in works if d <= sizes["attention heads (num_attention_heads)"]]
            raise InvalidValueError(f"EngineConfig: tensor_parallel_size={tp} must divide the model's "
                             f"{', '.join(bad)} evenly, since each rank holds an equal share; "
                             f"sizes that work for this model: {', '.join(map(str, works))}")
        if self.device == "cuda" and tp > torch.cuda.device_count():
            raise InvalidValueError(f"EngineConfig: tensor_parallel_size={tp} needs one GPU per rank, but "
                             f"{torch.cuda.device_count()} CUDA device(s) are visible; use tensor_parallel_size <= "
                             f"{torch.cuda.device_count()} or device='cpu' (gloo, for learning and testing)")

    def _resolve_graphs_and_compile(self) -> None:
        """CUDA graphs (or their CPU stand-in) and torch.compile, decided once, here (chapter 06)."""
        if self.graph_stand_in and self.device != "cpu":
            raise InvalidValueError("EngineConfig: graph_stand_in=True is the CPU stand-in of CUDA graphs; on CUDA the "
                             "engine captures real graphs (leave graph_stand_in=False; enforce_eager=True turns "
                             "them off)")
        if "ch06" in self.use_exercises and (self.device != "cpu" or self.enforce_eager):
            raise InvalidValueError("EngineConfig: use_exercises with 'ch06' runs decode steps through your stand-in "
                                    "graphs, which run on device='cpu' only and not with enforce_eager=True; drop "
                                    "'ch06' or use device='cpu' without enforce_eager")
        if self.graph_stand_in and self.enforce_eager:
            raise InvalidValueError("EngineConfig: graph_stand_in=True runs decode through (stand-in) graphs and "
                             "enforce_eager=True forbids graphs; pick one")
        if self.device == "cuda" and not self.enforce_eager and self.attention_backend == "torch":
            warnings.warn("nanoengine: attention_backend='torch' cannot run inside a CUDA graph (its store decides "
                          "on the host which slots to skip), so decode steps run eagerly; use attention_backend="
                          "'triton' for CUDA graphs, or enforce_eager=True to say so", stacklevel=4)
        if self.model_pieces and self.torch_compile:
            raise InvalidValueError(f"EngineConfig: torch_compile=True compiles the engine's own norm and rotary ops, "
                                    f"but use_exercises={list(self.use_exercises)} runs yours; leave torch_compile unset")
        if self.torch_compile is None:
            self.torch_compile = self.device == "cuda" and not self.model_pieces
        elif self.torch_compile and self.attention_backend == "cpu":
            raise InvalidValueError("EngineConfig: torch_compile=True compiles the ops that attention_backend='cpu' already "
                             "runs as fused C++ kernels; use attention_backend='torch' to compile them instead, "
                             "or leave torch_compile unset")

    @property
    def decode_graphs(self) -> str | None:
        """How decode steps run after resolve(): 'cuda' (captured CUDA graphs), 'stand_in' (their CPU
        stand-in) or None (eagerly)."""
        if self.graph_stand_in or "ch06" in self.use_exercises:  # the learner's graphs are stand-ins
            return "stand_in"
        # the learner's pieces inside the model run eagerly (their Python may read tensors on the host)
        graphs = (self.device == "cuda" and not self.enforce_eager and self.attention_backend != "torch"
                  and not self.model_pieces)
        return "cuda" if graphs else None

    @property
    def fused_decode(self) -> bool:
        """After resolve(): whether decode steps run the whole layer stack in one C++ call (CPU, backend 'cpu':
        nanoengine.models.fused_decode), the CPU's analogue of CUDA graphs; enforce_eager=True turns it off.
        Not with what it does not mirror: the graphs' stand-in, the learner's pieces, tensor parallelism, or
        oneDNN-prepacked weights."""
        return (self.device == "cpu" and self.attention_backend == "cpu" and not self.enforce_eager
                and self.decode_graphs is None and not self.use_exercises and self.tensor_parallel_size == 1
                and not self.prepack_weights)

    @property
    def dist_backend(self) -> str:
        """The torch.distributed backend for tensor parallelism: NCCL when every rank has a GPU, else gloo."""
        return "nccl" if self.device == "cuda" else "gloo"

    def _pick_attention_backend(self) -> str:
        """The backend for this device and dtype: 'auto' picks (see the module docstring), an explicit
        choice is checked; both say why when a backend cannot run here."""
        from nanoengine.attention import flash_attn_backend
        from nanoengine.kernels import triton_support

        want = self.attention_backend
        if want == "torch":
            return want
        if self.model_pieces:
            return self._pick_backend_for_pieces(want)
        if want == "triton":
            problem = triton_support.problem(self.device)
            if problem:
                raise InvalidValueError(f"EngineConfig: attention_backend='triton' cannot run here: {problem}")
            return want
        if self.device == "cpu":
            if want == "flash_attn":
                raise InvalidValueError("EngineConfig: attention_backend='flash_attn' runs on device='cuda' only; on CPU "
                                 "use 'auto' (the C++ kernels), 'cpu', 'torch' or 'triton' (TRITON_INTERPRET=1)")
            return self._pick_cpu_kernels()
        if want == "cpu":
            raise InvalidValueError("EngineConfig: attention_backend='cpu' runs on device='cpu' only; on CUDA use 'auto', "
                             "'flash_attn', 'triton' or 'torch'")
        flash_problem = self._flash_attn_problem(flash_attn_backend.problem())
        if want == "flash_attn":
            if flash_problem:
                raise InvalidValueError(f"EngineConfig: attention_backend='flash_attn' cannot run here: {flash_problem}")
            return want
        if flash_problem is None:  # auto on CUDA
            return "flash_attn"
        triton_problem = triton_support.problem(self.device)
        if triton_problem is None:
            return "triton"
        warnings.warn(f"nanoengine: neither flash_attn ({flash_problem}) nor triton ({triton_problem}) can run "
                      "here; using the slower torch attention backend", stacklevel=4)
        return "torch"

    @property
    def model_pieces(self) -> tuple[str, ...]:
        """The chapters of use_exercises whose pieces run inside the model's forward (ch02, ch03)."""
        from nanoengine.pieces import MODEL_CHAPTERS

        return tuple(c for c in self.use_exercises if c in MODEL_CHAPTERS)

    def _pick_backend_for_pieces(self, want: str) -> str:
        """The learner's ch02/ch03 pieces replace parts of the torch backend (ch02 also the CPU backend's)."""
        names = ", ".join(self.model_pieces)
        if want == "auto" or (want == "cpu" and self.device == "cpu" and "ch03" not in self.model_pieces):
            return "torch" if want == "auto" else self._pick_cpu_kernels()
        raise InvalidValueError(f"EngineConfig: use_exercises={list(self.use_exercises)} plugs your {names} pieces "
                                f"into the torch attention backend, so attention_backend={want!r} cannot be used "
                                "with them; leave attention_backend='auto' (or 'torch')")

    def _flash_attn_problem(self, import_problem: str | None) -> str | None:
        """Why flash_attn cannot serve this config (import, dtype, block size), or None."""
        if import_problem:
            return f"{import_problem}; pip install flash-attn, or use attention_backend='triton'"
        if self.dtype not in FLASH_ATTN_DTYPES:
            return (f"flash-attn computes in float16 or bfloat16, not dtype={self.dtype!r}; use dtype='bfloat16' "
                    "or attention_backend='triton' (any dtype)")
        if self.block_size is not None and self.block_size % FLASH_ATTN_BLOCK_MULTIPLE:
            return (f"flash-attn's paged KV cache needs a block size that is a multiple of "
                    f"{FLASH_ATTN_BLOCK_MULTIPLE}, not block_size={self.block_size}; leave block_size unset "
                    f"({DEFAULT_BLOCK_SIZE['flash_attn']}) or use attention_backend='triton' for smaller blocks")
        return None

    def _pick_cpu_kernels(self) -> str:
        """'cpu' (the C++ kernels) on CPU when they are built or can be built here, else 'torch'."""
        from nanoengine.kernels import cpu as cpu_kernels

        problem = cpu_kernels.build_problem()
        if problem is None:
            return "cpu"
        if self.attention_backend == "cpu":
            raise InvalidValueError(f"EngineConfig: attention_backend='cpu' cannot be built here ({problem}); "
                             "install a C++ compiler or use attention_backend='torch'")
        warnings.warn(f"nanoengine: the CPU kernels cannot be built here ({problem}); using the slower torch "
                      "backend. Install a C++ compiler (e.g. build-essential) to get them.", stacklevel=5)
        return "torch"

    def _check_block_size(self) -> None:
        """A block size the chosen backend can use, or an error saying what would work (flash_attn's was
        checked when it was picked)."""
        bs = self.block_size
        if self.attention_backend == "triton" and bs & (bs - 1):
            lower = 1 << (bs.bit_length() - 1)
            raise InvalidValueError(f"EngineConfig: attention_backend='triton' needs a power-of-two block_size, not "
                             f"{bs}; use {lower} or {lower * 2} (default {DEFAULT_BLOCK_SIZE['triton']})")

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)
