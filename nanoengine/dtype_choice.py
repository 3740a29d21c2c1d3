"""dtype="auto" on CPU decided by measurement: the faster of a 16-bit checkpoint's decode paths on this
machine, timed once and kept. Chapter 08.

A bf16 (or fp16) checkpoint can decode on a CPU with the C++ kernels in two ways (the plan's `dtype`,
`prepack_weights`, `bf16_weight_rows` and `decode_mode` follow from the dtype, nanoengine/plan.py):
- "float32": float32 activations, the linears' bf16 weight copies (the C++ `bf16_linear`; a bf16 checkpoint's
  copies are exact) and the whole layer stack in one C++ call (`DecodeMode.FUSED_CPU`);
- "bfloat16": bf16 throughout, the linears' weights packed for oneDNN (`torch.ops.mkldnn._linear_pointwise`),
  layer by layer; only where this torch has oneDNN bf16 on this CPU (`linear.onednn_bf16_available()`).
Which one is faster is a fact of the CPU, not of whether bf16 exists: on an AVX-512 Zen 4 the first ran 2.3x
faster at one stream than the second. So where both can run (`plan_cpu.dtype_candidates`), `choose` times them
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
it times one decoder layer's linears at each of `ROW_SIZES` rows through the path the plan would run them on
(the C++ bf16_linear with the bf16 copies up to their rows, float32 above) against bf16 activations times
oneDNN-packed bf16 weights (torch's matmul; AMX tiles where the CPU has them), keeps the times beside the
dtype choice (`bf16rows<rows>-<key>.json`), and the plan sends batches of more rows than the measured
threshold (`row_threshold`: bf16 clearly faster there and at every larger size) to bf16, decode steps
included (the fused step's C++ `Linear` takes the same threshold); nowhere if bf16 never measured faster.
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
    """One decode path, as the plan would run it (plan_cpu.dtype_candidates makes them)."""
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
    write_record(path, {"dtype": choice.dtype, "ms_per_step": dict(choice.ms_per_step), "key": path.stem,
                        "stand_in": {"vocab": STAND_IN_VOCAB, "context": CONTEXT, "rows": ROWS}})


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


# ------------------------------------------------------------------------------------------ bf16 rows

# rows at which prefill_choice times one layer's linears: decode batches (1..256 streams) and prefill chunks
ROW_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# bf16 must take at most this share of the other path's time to be taken: rounding the activations costs
# accuracy, so a near tie keeps float32 activations (on a Xeon with AMX, 1 thread, SmolLM2: 0.97 at 4 rows
# and 0.92 at 8 timed alone, while whole decode steps of 4 and 8 streams ran 9-15% slower in bf16; 0.49 at
# 16 rows, where the whole step ran 1.5x faster)
BF16_MARGIN = 0.9


@dataclass(frozen=True)
class PrefillChoice:
    """Batches of more than `min_rows` rows multiply bf16 activations (None: bf16 was never the faster)."""
    min_rows: int | None
    source: str  # MEASURED or CACHED
    ms_by_rows: tuple[tuple[int, float, float], ...]  # (rows, ms of the plan's own path, ms in bf16), a layer

    @property
    def bf16_faster(self) -> bool:
        return self.min_rows is not None


def row_threshold(ms_by_rows: Sequence[tuple[int, float, float]]) -> int | None:
    """From (rows, ms of the plan's path, ms in bf16) at increasing rows: the rows above which bf16 is taken,
    R - 1 for the smallest measured R where bf16 was clearly faster (under BF16_MARGIN of the other's time)
    there and at every larger size measured (one size in between where it was not keeps the smaller sizes on
    the plan's path); None where bf16 was not clearly faster at the largest size."""
    threshold = None
    for rows, base, bf16 in sorted(ms_by_rows, reverse=True):
        if bf16 >= BF16_MARGIN * base:
            break
        threshold = rows - 1
    return threshold


def prefill_choice(hf_config: Any, bf16_rows: int,
                   measure_with: Callable[[Any, int], list[tuple[int, float, float]]] | None = None
                   ) -> PrefillChoice:
    """The row threshold above which bf16 activations x bf16 weights (oneDNN) beat the linears' own path on
    this machine (the C++ bf16_linear up to `bf16_rows` rows, float32 above): measured once at ROW_SIZES
    (`measure_prefill`) and kept, as `choose` keeps its choice."""
    path = cache_path(hf_config).with_name(f"bf16rows{bf16_rows}-{cache_key(hf_config)}.json")
    try:
        data = json.loads(path.read_text())
        ms = [(int(r), float(a), float(b)) for r, a, b in data["ms_by_rows"]]
        if sorted(r for r, _, _ in ms) != sorted(ROW_SIZES):
            raise ValueError("other row sizes")
        return PrefillChoice(row_threshold(ms), CACHED, tuple(ms))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    ms = [(int(r), round(float(a), 4), round(float(b), 4))
          for r, a, b in (measure_with or measure_prefill)(hf_config, bf16_rows)]
    choice = PrefillChoice(row_threshold(ms), MEASURED, tuple(ms))
    write_record(path, {"min_rows": choice.min_rows, "ms_by_rows": [list(m) for m in ms], "key": path.stem})
    where = ("never faster: prefill stays in float32" if choice.min_rows is None
             else f"batches of over {choice.min_rows} rows in bfloat16")
    print(f"nanoengine: prefill_dtype='bfloat16' timed one layer's linears at {ROW_SIZES[0]}.."
          f"{ROW_SIZES[-1]} rows on this CPU: {where} (kept in {path.parent})", file=sys.stderr, flush=True)
    return choice


def write_record(path: Path, record: dict) -> None:
    """`record` as JSON in `path`, written whole under a temporary name and renamed."""
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        tmp = Path(name)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: the choice stands for this process, and is measured next time
        warnings.warn(f"nanoengine: could not keep a measured choice in {path} ({e})", stacklevel=2)
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def measure_prefill(hf_config: Any, bf16_rows: int) -> list[tuple[int, float, float]]:
    """(rows, ms, ms) of one decoder layer's linears (merged q/k/v, o, merged gate/up, down) at each of
    ROW_SIZES rows: through the path the plan runs them on otherwise (the C++ bf16_linear up to `bf16_rows`
    rows, float32 above), and through bf16 activations x oneDNN-packed bf16 weights cast back to float32 (the
    C++ onednn_bf16_linear, as layers.linear and the fused step run it). Needs the C++ kernels built."""
    import torch.nn.functional as F

    from nanoengine.kernels import cpu as cpu_kernels

    kernels = cpu_kernels.load()
    hidden, q = hf_config.hidden_size, hf_config.num_attention_heads * shapes.head_dim(hf_config)
    kv = shapes.num_kv_heads(hf_config) * shapes.head_dim(hf_config)
    inter = hf_config.intermediate_size
    gen = torch.Generator().manual_seed(0)
    shapes_ = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]
    w32 = [(torch.randn(s, generator=gen) * 0.02).bfloat16().float() for s in shapes_]
    packed = [kernels.bf16_pack(w) for w in w32]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16()) for w in w32]
    def own(xs: list[torch.Tensor]) -> None:
        for x, w, p, s in zip(xs, w32, packed, shapes_):
            kernels.bf16_linear(x, p, None, s[0]) if x.shape[0] <= bf16_rows else F.linear(x, w)

    def bf16(xs: list[torch.Tensor]) -> None:
        for x, w in zip(xs, onednn):
            kernels.onednn_bf16_linear(x, w)

    out = []
    with torch.inference_mode():
        for rows in ROW_SIZES:
            xs = [torch.randn(rows, s[1], generator=gen) for s in shapes_]
            ms_own, ms_bf16 = best_time(lambda xs=xs: own(xs)), best_time(lambda xs=xs: bf16(xs))
            out.append((rows, 1e3 * ms_own, 1e3 * ms_bf16))
    return out
