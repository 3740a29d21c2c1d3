"""dtype="auto" on CPU decided by measurement: the faster of a 16-bit checkpoint's decode paths on this
machine, timed once and kept. Chapter 08.

A bf16 (or fp16) checkpoint can decode on a CPU with the C++ kernels in two ways (the plan's `dtype`,
`prepack_weights`, `bf16_weight_rows` and `decode_mode` follow from the dtype, nanoengine/plan.py):
- "float32": float32 activations, the linears' bf16 weight copies (the C++ `bf16_linear`; a bf16 checkpoint's
  copies are exact) and the whole layer stack in one C++ call (`DecodeMode.FUSED_CPU`);
- "bfloat16": bf16 throughout, the linears' weights packed for oneDNN (`torch.ops.mkldnn._linear_pointwise`),
  layer by layer; only where this torch has oneDNN bf16 on this CPU (`linear.onednn_bf16_available()`).
Which one is faster is a fact of the CPU, not of whether bf16 exists: on an AVX-512 Zen 4 the first ran 2.3x
faster at one stream than the second. So where both can run (`plan.dtype_candidates`), `choose` times them
once per machine and keeps the answer; elsewhere there is one candidate and nothing is timed.

`measure` times a stand-in of the model's decode step rather than the model: `STAND_IN_LAYERS` decoder layers
(one for layers of over `ONE_LAYER_BYTES`) with the model's hidden and intermediate sizes, heads and
head size, random bf16-exact weights, a KV cache of `CONTEXT` tokens, and an LM head of at most
`STAND_IN_VOCAB` rows, run through the engine's own code (the model class, `FusedDecode`,
`prepack_weights`, the attention backend's `prepare`). A decode step at one stream is bound by reading the
weights from memory, and a stand-in small enough to build in a moment fits in the CPU's cache: so before
each timed step it reads as many bytes as the model's other layers and LM-head rows hold (at most twice the
last-level cache), as the model does between two visits of a layer. Its times are scaled to the model's
layers and vocabulary. It builds nothing: it runs only where the C++ kernels are built already.

The answer is kept in `$NANOENGINE_HOME/kernels/dtype-choice/<key>.json`, the key naming the CPU kind, the
torch version, the kernel sources, the thread count and the model's shape: each kind of machine and model is
measured once. A file that cannot be read is measured again and replaced; a file is written whole under a
temporary name and renamed, so processes starting together (tensor-parallel ranks, replicas) never read half
of one. The choice is printed once, when measured; `dtype=` given explicitly measures nothing.

`prefill_choice` does the same for the opt-in prefill_dtype="bfloat16" (a bf16 checkpoint run in float32):
it times one decoder layer's linears at `PREFILL_ROWS` rows in float32 against bf16 activations times bf16
weights through torch's matmul (oneDNN; AMX tiles where the CPU has them), keeps the answer beside the
dtype choice (`prefill-<key>.json`), and the plan uses bf16 for prefill only where it measured faster.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanoengine.models import hf_config as shapes

# where the choice came from (EnginePlan.dtype_source)
GIVEN = "given"  # dtype= asked for explicitly
ONLY_CANDIDATE = "only candidate"  # one decode path here (or none to choose between): nothing to time
MEASURED = "measured"  # timed now, and kept
CACHED = "cached"  # timed before on this kind of machine, for this shape
UNMEASURED = "unmeasured"  # two candidates, but the C++ kernels are not built yet, or timing failed: the rule

STAND_IN_LAYERS = 2
ONE_LAYER_BYTES = 256 * 2**20  # float32 bytes of one layer's linears above which the stand-in has one layer
STAND_IN_VOCAB = 8192  # LM-head rows of the stand-in (its time is scaled to the model's vocabulary)
CONTEXT = 256  # tokens in the KV cache of the timed decode step (the benchmarks' 256 + 256)
ROWS = 1  # sequences in the timed decode step: one stream, where the weights' bytes decide
BUDGET_S = 0.25  # seconds per candidate, untimed reads included (MIN_STEPS to MAX_STEPS steps)
FLUSH_BYTES = 256 * 2**20  # read between timed steps at most (twice the last-level cache, or this if unknown)
MIN_STEPS, MAX_STEPS = 3, 20


@dataclass(frozen=True)
class Candidate:
    """One decode path, as the plan would run it (plan.dtype_candidates makes them)."""
    dtype: str  # "float32" or "bfloat16": the name it is kept and shown under
    prepack: bool  # oneDNN-packed weights, layer by layer
    fused: bool  # the fused C++ decode step
    bf16_rows: int  # batches of up to this many rows use bf16 weight copies (plan.bf16_weight_rows)
    block_size: int  # KV block size

    @property
    def what(self) -> str:
        how = ["oneDNN-packed weights" if self.prepack else "",
               "bf16 weight copies" if self.bf16_rows else "",
               "fused step" if self.fused else "layer by layer"]
        return f"{self.dtype} ({', '.join(h for h in how if h)})"


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str
    source: str  # GIVEN, ONLY_CANDIDATE, MEASURED, CACHED or UNMEASURED
    ms_per_step: tuple[tuple[str, float], ...] = ()  # (candidate, ms of one decode step), when timed


def cache_key(hf_config: Any) -> str:
    """This machine's kind, torch, the kernel sources, the thread count and the model's shape."""
    from nanoengine.kernels import cpu as cpu_kernels

    facts = (f"cpu{cpu_kernels.cpu_signature()}-torch{torch.__version__}-src{cpu_kernels.source_signature()}"
             f"-threads{torch.get_num_threads()}-{str(shapes.checkpoint_dtype(hf_config)).removeprefix('torch.')}"
             f"-h{hf_config.hidden_size}-i{hf_config.intermediate_size}-l{hf_config.num_hidden_layers}"
             f"-a{hf_config.num_attention_heads}-kv{shapes.num_kv_heads(hf_config)}-d{shapes.head_dim(hf_config)}"
             f"-v{hf_config.vocab_size}")
    return facts.replace("+", "_")


def cache_path(hf_config: Any) -> Path:
    from nanoengine import assets

    return assets.home() / "kernels" / "dtype-choice" / f"{cache_key(hf_config)}.json"


def read_cached(path: Path, candidates: Sequence[str]) -> DtypeChoice | None:
    """The kept choice among exactly these candidates, or None (no file, or one that cannot be read)."""
    try:
        data = json.loads(path.read_text())
        ms = {str(k): float(v) for k, v in data["ms_per_step"].items()}
        dtype = data["dtype"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if set(ms) != set(candidates) or dtype not in ms:
        return None
    return DtypeChoice(dtype, CACHED, tuple(ms.items()))


def write_cached(path: Path, choice: DtypeChoice) -> None:
    """Write the file whole under a temporary name, then rename it (atomic on one file system)."""
    record = {"dtype": choice.dtype, "ms_per_step": dict(choice.ms_per_step), "key": path.stem,
              "stand_in": {"vocab": STAND_IN_VOCAB, "context": CONTEXT, "rows": ROWS}}
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        tmp = Path(name)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: the choice stands for this process, and is measured next time
        warnings.warn(f"nanoengine: could not keep the dtype choice in {path} ({e})", stacklevel=2)
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def choose(candidates: Sequence[Candidate], hf_config: Any, rule: str,
           measure_with: Callable[[Any, Sequence[Candidate]], dict[str, float]] | None = None) -> DtypeChoice:
    """dtype='auto' among `candidates`: the fastest, measured once per machine and kept; `rule` (the old
    rule's dtype) where there are fewer than two. `measure_with` times them (default `measure`)."""
    if len(candidates) < 2:
        return DtypeChoice(rule, ONLY_CANDIDATE)
    path = cache_path(hf_config)
    names = [c.dtype for c in candidates]
    cached = read_cached(path, names)
    if cached is not None:
        return cached
    try:
        ms = (measure_with or measure)(hf_config, candidates)
    except Exception as e:  # a failed measurement must not stop the engine: the rule's answer, unkept
        warnings.warn(f"nanoengine: dtype='auto' could not time its candidates ({type(e).__name__}: {e}); "
                      f"using {rule}", stacklevel=2)
        return DtypeChoice(rule, UNMEASURED)
    best = min(names, key=lambda n: ms[n])
    choice = DtypeChoice(best, MEASURED, tuple((n, round(ms[n], 4)) for n in names))
    write_cached(path, choice)
    timings = ", ".join(f"{c.what} {ms[c.dtype]:.2f} ms" for c in candidates)
    print(f"nanoengine: dtype='auto' timed one decode step of this model's shape on this CPU ({timings}): "
          f"picked {best} (kept in {path.parent}; dtype= overrides)", file=sys.stderr, flush=True)
    return choice


# ------------------------------------------------------------------------------------------ the measurement

def measure(hf_config: Any, candidates: Sequence[Candidate]) -> dict[str, float]:
    """Milliseconds of one decode step (ROWS sequences of CONTEXT tokens) of the model, per candidate's dtype,
    estimated from a stand-in (see the module docstring). Needs the C++ kernels built."""
    from nanoengine.kernels import cpu as cpu_kernels

    kernels = cpu_kernels.load()
    params = layer_params(hf_config)
    layers = 1 if 4 * params > ONE_LAYER_BYTES else min(STAND_IN_LAYERS, hf_config.num_hidden_layers)
    vocab = min(hf_config.vocab_size, STAND_IN_VOCAB)
    cfg = copy.deepcopy(hf_config)
    cfg.num_hidden_layers, cfg.vocab_size, cfg.tie_word_embeddings = layers, vocab, False
    cfg.max_position_embeddings = CONTEXT + 1
    # between two steps the model reads its other layers' and LM head's weights (2 bytes each in either
    # path for a bf16 checkpoint), which push the stand-in's out of the caches: read as many (at most
    # FLUSH_BYTES) between timed steps, or a stand-in that fits in the cache would time the cache
    other = 2 * ((hf_config.num_hidden_layers - layers) * params + (hf_config.vocab_size - vocab)
                 * hf_config.hidden_size)
    flush = torch.ones(min(other, 2 * (last_level_cache_bytes() or FLUSH_BYTES // 2), FLUSH_BYTES) // 4)
    out = {}
    for cand in candidates:
        stack_s, head_s = time_stand_in(cfg, cand, kernels, lambda: flush.sum())
        out[cand.dtype] = 1e3 * (stack_s * hf_config.num_hidden_layers / layers
                           + head_s * hf_config.vocab_size / vocab)
    return out


def last_level_cache_bytes() -> int | None:
    """The size of CPU 0's largest cache level (Linux sysfs), or None where it cannot be read."""
    best: tuple[int, int] | None = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip().upper()
            units = {"K": 2**10, "M": 2**20, "G": 2**30}
            n = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (OSError, ValueError, IndexError):
            continue
        best = max(best or (level, n), (level, n))
    return best[1] if best else None


def layer_params(hf_config: Any) -> int:
    """Weights of one decoder layer's linears (q, k, v, o, gate, up, down)."""
    hidden, q = hf_config.hidden_size, hf_config.num_attention_heads * shapes.head_dim(hf_config)
    kv = shapes.num_kv_heads(hf_config) * shapes.head_dim(hf_config)
    return hidden * (q + 2 * kv) + q * hidden + 3 * hidden * hf_config.intermediate_size


def time_stand_in(cfg: Any, cand: Candidate, kernels: Any,
                  between: Callable[[], Any] = lambda: None) -> tuple[float, float]:
    """Seconds of the stand-in's decode step through `cand`'s path: (the layer stack, the LM head), each
    timed with `between()` run (untimed) before it."""
    from nanoengine.attention import get_backend
    from nanoengine.attention.metadata import AttentionMetadata
    from nanoengine.engine.inputs import ModelInput
    from nanoengine.layers.linear import prepack_weights, use_bf16_weights
    from nanoengine.models import get_model_class
    from nanoengine.models.fused_decode import FusedDecode

    backend = get_backend("cpu")
    dtype = getattr(torch, cand.dtype)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = get_model_class(cfg)(cfg, backend, kernels).eval()
    finally:
        torch.set_default_dtype(default)
    fill_bf16_exact(model)
    if cand.prepack:
        prepack_weights(model)
    if cand.bf16_rows:
        use_bf16_weights(model, kernels, cand.bf16_rows)
    block = cand.block_size
    per_seq = -(-(CONTEXT + 1) // block)
    kv_shape = backend.kv_cache_shape(ROWS * per_seq, block, shapes.num_kv_heads(cfg), shapes.head_dim(cfg))
    kv_cache = torch.zeros((2, cfg.num_hidden_layers, *kv_shape), dtype=dtype)
    model.bind_kv_cache(kv_cache)
    tables = torch.arange(ROWS * per_seq, dtype=torch.int64).view(ROWS, per_seq)  # [ROWS, per_seq]
    positions = torch.full((ROWS,), CONTEXT, dtype=torch.int64)  # [ROWS]
    slots = tables[:, CONTEXT // block] * block + CONTEXT % block  # [ROWS]
    meta = AttentionMetadata(slot_mapping=slots, num_decode_seqs=ROWS, decode_block_tables=tables,
                             decode_context_lens=positions + 1, prefill_query_starts=[],
                             prefill_query_lens=[], prefill_context_lens=[], prefill_block_tables=[],
                             block_size=block)
    inp = ModelInput(torch.arange(ROWS, dtype=torch.int64) % cfg.vocab_size, positions, meta)
    with torch.inference_mode():
        if cand.fused:
            fused = FusedDecode(model, kernels)
            stack: Callable[[], torch.Tensor] = lambda: fused(inp)  # noqa: E731
        else:
            def stack() -> torch.Tensor:  # the runner's eager_forward
                meta.prepared = backend.prepare(meta, kv_shape)
                return model(inp.input_ids, inp.positions, meta)
        hidden = stack()  # [ROWS, hidden]
        return best_time(stack, between), best_time(lambda: model.compute_logits(hidden), between)


def fill_bf16_exact(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights that are exact in bf16 (what a bf16 checkpoint loads to), cheaply: a random block, tiled;
    norms at 1."""
    gen = torch.Generator().manual_seed(seed)
    block = (torch.randn(4099, generator=gen) * 0.02).bfloat16()  # [4099] (odd: rows do not repeat)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
                continue
            flat = p.view(-1)
            n = flat.numel()
            flat.copy_(block.repeat(-(-n // block.numel()))[:n])


def best_time(fn: Callable[[], Any], between: Callable[[], Any] = lambda: None) -> float:
    """The fastest of a few timed calls of `fn`, in seconds, each after an untimed `between()` (after one
    warm-up call; the fastest is the least disturbed by other work on the machine)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < MIN_STEPS or (len(times) < MAX_STEPS and time.perf_counter() - start < BUDGET_S / 2):
        between()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


# ------------------------------------------------------------------------------------------ prefill GEMM

PREFILL_ROWS = 128  # rows of the timed prefill linears: a small prompt chunk (2 x BF16_PREFILL_MIN_ROWS)


@dataclass(frozen=True)
class PrefillChoice:
    bf16_faster: bool
    source: str  # MEASURED or CACHED
    ms_per_layer: tuple[tuple[str, float], ...]  # ("float32" | "bfloat16", ms of one layer's linears)


def prefill_choice(hf_config: Any, measure_with: Callable[[Any], dict[str, float]] | None = None
                   ) -> PrefillChoice:
    """Whether bf16 activations x bf16 weights (torch's matmul) beat float32 for one layer's linears at
    PREFILL_ROWS rows on this machine: measured once (`measure_prefill`) and kept, as `choose` keeps its."""
    path = cache_path(hf_config).with_name(f"prefill{PREFILL_ROWS}-{cache_key(hf_config)}.json")
    try:
        data = json.loads(path.read_text())
        ms = {k: float(data["ms_per_step"][k]) for k in ("float32", "bfloat16")}  # (write_cached's record)
        return PrefillChoice(ms["bfloat16"] < ms["float32"], CACHED, tuple(ms.items()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    ms = (measure_with or measure_prefill)(hf_config)
    choice = PrefillChoice(ms["bfloat16"] < ms["float32"], MEASURED,
                           tuple((k, round(ms[k], 4)) for k in ("float32", "bfloat16")))
    write_cached(path, DtypeChoice("bfloat16" if choice.bf16_faster else "float32", MEASURED,
                                   choice.ms_per_layer))
    print(f"nanoengine: prefill_dtype='bfloat16' timed one layer's linears at {PREFILL_ROWS} rows on this "
          f"CPU (float32 {ms['float32']:.2f} ms, bfloat16 {ms['bfloat16']:.2f} ms): prefill in "
          f"{'bfloat16' if choice.bf16_faster else 'float32'} (kept in {path.parent})", file=sys.stderr,
          flush=True)
    return choice


def measure_prefill(hf_config: Any) -> dict[str, float]:
    """Milliseconds of one decoder layer's linears (merged q/k/v, o, merged gate/up, down) over PREFILL_ROWS
    rows: float32, and bf16 activations x bf16 weights cast back to float32 (as layers.linear runs them)."""
    import torch.nn.functional as F

    hidden, q = hf_config.hidden_size, hf_config.num_attention_heads * shapes.head_dim(hf_config)
    kv = shapes.num_kv_heads(hf_config) * shapes.head_dim(hf_config)
    inter = hf_config.intermediate_size
    gen = torch.Generator().manual_seed(0)
    shapes_ = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]
    w32 = [(torch.randn(s, generator=gen) * 0.02).bfloat16().float() for s in shapes_]
    w16 = [w.bfloat16() for w in w32]
    xs = [torch.randn(PREFILL_ROWS, s[1], generator=gen) for s in shapes_]

    def f32() -> None:
        for x, w in zip(xs, w32):
            F.linear(x, w)

    def bf16() -> None:
        for x, w in zip(xs, w16):
            F.linear(x.bfloat16(), w).float()

    with torch.inference_mode():
        return {"float32": 1e3 * best_time(f32), "bfloat16": 1e3 * best_time(bf16)}
