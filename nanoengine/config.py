"""EngineConfig: what the user asked for, every engine option validated in one place. Chapter 00.

Unknown options are an error (with a suggestion), never silently dropped; a value of the wrong type or out of
range is an error naming the option. Resolving the options against the checkpoint and the machine (device,
dtype, attention backend, block size, KV pool, how decode steps run) is `nanoengine.plan`'s job: it turns an
EngineConfig into a frozen `EnginePlan` of concrete values, and everything downstream reads the plan.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass
from typing import Any

from nanoengine import pieces
from nanoengine.assets import DEFAULT_MODEL
from nanoengine.errors import InvalidTypeError, InvalidValueError

DTYPES = ("auto", "bfloat16", "float32", "float16")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "torch", "cpu", "triton", "flash_attn")
# how admission treats a waiting request whose blocks do not fit (chapter 05): "fcfs" stops there, as vLLM v1
# does; "skip_ahead" tries up to SKIP_AHEAD_LIMIT later ones per step (they may fit; the first may starve)
SCHEDULING_POLICIES = ("fcfs", "skip_ahead")
# quantization at load time (vLLM's option name; chapter 08): "int8", weight-only, symmetric, per-group
# scales; "w8a8", the same int8 weights times activations quantized per row and group of 32 on the fly (int8
# dot products; named after vLLM's and llm-compressor's W8A8 int8 scheme) (nanoengine/layers/quant.py); None
# keeps the checkpoint's weights
QUANTIZATIONS = (None, "int8", "w8a8")
# the KV cache's element type (vLLM's `kv_cache_dtype`): "auto" = the model's compute dtype; "bfloat16" (or
# vLLM's spelling "bf16") stores K/V rounded to bf16, half the bytes of a float32 cache (nanoengine/plan.py)
KV_CACHE_DTYPES = ("auto", "bfloat16", "bf16")
# what prefill-sized linears compute in (named like dtype and kv_cache_dtype): "auto" = the compute dtype;
# "bfloat16" (opt-in: activations rounded to bf16 change results slightly) multiplies a bf16 checkpoint run in
# float32 on CPU through torch's bf16 matmul (oneDNN, AMX where the CPU has it), where measured faster
PREFILL_DTYPES = ("auto", "bfloat16")
# speculative decoding's proposers (nanoengine/spec/): "ngram" looks the last tokens up in the prompt and the
# output so far; "draft_model" runs a small model that shares the target's tokenizer (`model`)
SPECULATIVE_METHODS = ("ngram", "draft_model")
# which distribution a request's logprobs come from (vLLM's `logprobs_mode`; chapter 05): "raw_logprobs" is
# the model's own (log_softmax of the logits, before temperature and filters; vLLM v1's default),
# "processed_logprobs" the one the token was drawn from (after temperature, top-k, top-p, min-p)
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): propose `num_speculative_tokens` tokens per step
    and verify them in one forward of the model. "ngram" (prompt lookup) matches the last n tokens, n from
    prompt_lookup_max down to prompt_lookup_min, against the tokens before them; "draft_model" decodes them
    greedily with `model` (a checkpoint folder, an asset name or a Hub id, as `assets.resolve_model` takes;
    it must share the target's tokenizer), its weights quantized as `quantization` says (e.g. the target
    itself in int8 is a draft that agrees often). `row_cost` (nanoengine's own, not vLLM's) is what one
    more verified row costs a sequence decoding alone, in plain decode steps, which decides how many drafts
    pay (spec/policy.py): "measured" fits it to the engine's own step times as it runs (the fastest, but
    which steps draft then depends on timing), a number in [0, 1) fixes it (a greedy run's schedule is the
    same every time: the capstone and the tests compare schedules step by step)."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None  # the draft model ("draft_model" only)
    quantization: str | None = None  # the draft's weights ("draft_model" only; see QUANTIZATIONS)
    row_cost: float | str = "measured"  # one more verified row's cost at one stream: "measured", or fixed

    @classmethod
    def of(cls, value: Any) -> SpeculativeConfig | None:
        """A SpeculativeConfig from a dict (or its JSON text, as the command line gives it), checked."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise InvalidValueError(f"EngineConfig: speculative_config is not valid JSON ({e}); pass "
                                        'e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        if not isinstance(value, dict):
            raise InvalidTypeError(f"EngineConfig: speculative_config must be a dict, got {value!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in value if k not in names]
        if unknown:
            raise InvalidValueError(f"EngineConfig: unknown speculative_config key(s) {unknown}; valid keys: "
                                    f"{names}")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise InvalidValueError(f"EngineConfig: speculative_config needs {key!r}, e.g. "
                                        '{"method": "ngram", "num_speculative_tokens": 4}')
        method = value["method"]
        if method not in SPECULATIVE_METHODS:
            raise InvalidValueError(f"EngineConfig: speculative_config method must be one of "
                                    f"{SPECULATIVE_METHODS}, got {method!r}")
        given = set(value) - {"method", "num_speculative_tokens", "row_cost"}
        own = {"ngram": {"prompt_lookup_max", "prompt_lookup_min"},
               "draft_model": {"model", "quantization"}}[method]
        if given - own:
            raise InvalidValueError(f"EngineConfig: speculative_config key(s) {sorted(given - own)} do not "
                                    f"apply to method {method!r}, which takes {sorted(own)}")
        if method == "draft_model" and not isinstance(value.get("model"), str):
            raise InvalidValueError("EngineConfig: speculative_config method 'draft_model' needs 'model', "
                                    "the draft's checkpoint folder, asset name or Hub id (a small model "
                                    'with the target\'s tokenizer), e.g. {"method": "draft_model", "model": '
                                    '"/path/to/draft", "num_speculative_tokens": 4}')
        if value.get("quantization") not in QUANTIZATIONS:
            raise InvalidValueError(f"EngineConfig: speculative_config quantization must be one of "
                                    f"{QUANTIZATIONS}, got {value['quantization']!r}")
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = value.get(key, 1)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidValueError(f"EngineConfig: speculative_config {key} must be an integer >= 1, "
                                        f"got {v!r}")
        cost = value.get("row_cost", "measured")
        if cost != "measured" and (isinstance(cost, bool) or not isinstance(cost, (int, float))
                                   or not 0 <= cost < 1):
            raise InvalidValueError(f"EngineConfig: speculative_config row_cost must be \"measured\" or a "
                                    f"number in [0, 1) (a verified row's cost in decode steps, e.g. 0.15), "
                                    f"got {cost!r}")
        spec = cls(**value)
        if spec.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise InvalidValueError(f"EngineConfig: speculative_config num_speculative_tokens must be <= "
                                    f"{MAX_SPECULATIVE_TOKENS}, got {spec.num_speculative_tokens}")
        if spec.prompt_lookup_min > spec.prompt_lookup_max:
            raise InvalidValueError(f"EngineConfig: speculative_config prompt_lookup_min="
                                    f"{spec.prompt_lookup_min} is above prompt_lookup_max="
                                    f"{spec.prompt_lookup_max}")
        return spec


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    block_size: int | None = None
    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 256
    scheduling_policy: str = "fcfs"  # see SCHEDULING_POLICIES
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    num_kvcache_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    kv_cache_dtype: str = "auto"  # see KV_CACHE_DTYPES
    prefill_dtype: str = "auto"  # see PREFILL_DTYPES
    gpu_memory_utilization: float = 0.9
    # vLLM's switch for CUDA graphs (chapter 06): on CUDA, decode steps replay graphs captured per batch-size
    # bucket unless enforce_eager=True. On CPU there are no graphs: with the `cpu` backend decode steps run
    # the layers in one C++ call instead, which enforce_eager=True also turns off (see graph_stand_in).
    enforce_eager: bool = False
    # CPU only: run decode steps through the CPU stand-in of CUDA graphs (the same buckets, padding and static
    # buffers; "replay" calls the recorded forward on them), so chapter 06 and the tests run the graph logic
    graph_stand_in: bool = False
    # torch.compile on the small fused ops (RMSNorm with residual add, SiLU-and-mul, rotary) and the sampler;
    # None = on CUDA only (on CPU inductor made these ops slower; the C++ kernels fuse them there)
    torch_compile: bool | None = None
    prepack_weights: bool | None = None  # CPU bf16: oneDNN-packed linear weights; None = when supported
    quantization: str | None = None  # see QUANTIZATIONS (CPU only for now)
    tensor_parallel_size: int = 1
    # a mixture of experts across the tensor_parallel_size ranks (vLLM's name; layers/moe.py): True = each
    # rank holds E / N whole experts (expert parallelism), False = 1/N of every expert (tensor parallelism)
    enable_expert_parallel: bool = False
    # overlap scheduling (vLLM's name; chapter 06): step N+1 is scheduled and built while step N runs, and
    # its input ids for the sequences step N samples come from step N's tokens on the device. None = on where
    # it pays (see plan.pick_async_scheduling); False = every step waits for the one before
    async_scheduling: bool | None = None
    # speculative decoding (vLLM's shape; nanoengine/spec/): {"method": "ngram", "num_speculative_tokens": k,
    # ...}, see SpeculativeConfig; None = off. Its steps wait for their tokens (no overlap scheduling)
    speculative_config: dict | SpeculativeConfig | None = None
    # the most top logprobs a request may ask for (vLLM's `max_logprobs`, default 20): SamplingParams.logprobs
    # and prompt_logprobs above it are refused when the request is made
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"  # see LOGPROBS_MODES
    seed: int = 0
    trace: bool = False
    # the learner's pieces (nanoengine.pieces): chapters whose exercises replace the engine's own components,
    # from exercises_dir (default exercises/); None = what nanoengine.pieces.use_exercises() set, else none
    use_exercises: tuple[str, ...] | None = None
    exercises_dir: str | None = None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k, names, n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise InvalidTypeError(f"unknown engine option(s): {', '.join(hints)}. Valid options: "
                                   f"{', '.join(names)}")
        return cls(**kwargs)

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise InvalidValueError(f"EngineConfig: {msg}")

        if isinstance(self.exercises_dir, os.PathLike):
            self.exercises_dir = os.fspath(self.exercises_dir)
        self._check_types()
        self.use_exercises, self.exercises_dir = pieces.checked_option(self.use_exercises, self.exercises_dir)
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)

        check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        check(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        check(self.attention_backend in BACKENDS,
              f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        check(self.block_size is None or self.block_size >= 1,
              f"block_size must be a positive integer, got {self.block_size!r}")
        check(self.quantization in QUANTIZATIONS,
              f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        check(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        check(self.max_logprobs >= 0, f"max_logprobs must be >= 0, got {self.max_logprobs}")
        check(self.logprobs_mode in LOGPROBS_MODES,
              f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        check(self.scheduling_policy in SCHEDULING_POLICIES,
              f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1")
        check(self.num_kvcache_blocks is None or self.num_kvcache_blocks >= 1,
              "num_kvcache_blocks must be >= 1 (or None to size the cache from memory)")
        check(self.kv_cache_memory_gb is None or self.kv_cache_memory_gb > 0,
              "kv_cache_memory_gb must be > 0 (or None to size the cache by the default)")
        check(self.kv_cache_dtype in KV_CACHE_DTYPES,
              f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        check(self.prefill_dtype in PREFILL_DTYPES,
              f"prefill_dtype must be one of {PREFILL_DTYPES}, got {self.prefill_dtype!r}")
        check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]")
        check(self.tensor_parallel_size >= 1,
              f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        check(not self.enable_expert_parallel or self.tensor_parallel_size > 1,
              "enable_expert_parallel=True splits a mixture of experts' experts across the tensor-parallel "
              "ranks, but tensor_parallel_size=1; use tensor_parallel_size >= 2 with it, or leave "
              "enable_expert_parallel=False")
        check(not (self.speculative_config and self.async_scheduling),
              "speculative decoding does not overlap steps (the next step's drafts and positions depend on "
              "how many of this step's were accepted); use async_scheduling=False or None with "
              "speculative_config")
        check(not (self.speculative_config and self.trace),
              "trace=True with speculative_config is not supported yet (a step trace records one decode "
              "token per sequence, not its drafts); trace without speculation, or speculate without trace")

    def _check_types(self) -> None:
        """Each option has the type its annotation says (bool is not an int here, an int is a float)."""
        accepts = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
                   "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                   "bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str),
                   "None": lambda v: v is None}
        for f in dataclasses.fields(self):
            kinds = [k.strip() for k in str(f.type).split("|")]
            if not all(k in accepts for k in kinds):
                continue
            value = getattr(self, f.name)
            if not any(accepts[k](value) for k in kinds):
                raise InvalidTypeError(f"EngineConfig: {f.name} must be {' or '.join(kinds)}, got {value!r} "
                                       f"({type(value).__name__})")
