"""nanoengine's Triton kernels (store, paged decode with split-K, paged prefill) == the torch reference, run
in Triton's interpreter on CPU (compiled on CUDA): float32 and bfloat16, ragged lengths, slot -1 rows, GQA
4/2, 9/3 and 2/2, block sizes 16 and 256, cached prefixes. The oracle is float64 attention on the same inputs
(the torch backend's decode in float64, or dense causal attention); bfloat16 results are within one bf16
step of it in the interpreter, which computes in float32 and truncates when it stores bf16."""

from __future__ import annotations

import pytest
import torch
from test_attention import SEQS, expected_outputs, make_batch, make_layout, triton_kernels  # noqa: F401

import nanoengine.attention.torch_backend as torch_backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled there; else the interpreter
GQA = [(4, 2, 32), (9, 3, 64), (2, 2, 128)]  # (num_heads, num_kv_heads, head_dim)
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bfloat16")]
pytestmark = pytest.mark.usefixtures("triton_kernels")


def assert_matches(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """got (the kernel, float32 or bf16) against the float64 oracle `want` on the same inputs."""
    got = got.cpu()
    if got.dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5, msg=lambda m: f"{what}: {m}")
        return
    from nanoengine.kernels import triton_store, triton_support

    if not triton_support.is_interpreted(triton_store.store_kv_kernel):  # a GPU: bf16 tensor-core products
        torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1.6e-2, msg=lambda m: f"{what}: {m}")
        return
    # one bf16 step (ulp) at the value's magnitude: 2^(exponent - 7)
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
    err = (got.double() - want).abs()
    bad = err > ulp * 1.001 + 1e-6
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} values differ from float64 by more "
                           f"than one bf16 step (worst {float((err / ulp).max()):.2f} steps)")


@pytest.mark.parametrize("layout", ["heads_first", "flash_attn"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_writes_each_row_at_its_slot_and_skips_minus_one(layout, dtype):
    """Slots in scattered blocks, -1 rows (padding, prefix-cache hits) left alone, K/V given as strided views
    of a fused qkv tensor (as the model hands them over); both cache layouts, through the same kernel."""
    from nanoengine.attention.flash_attn_backend import heads_first
    from nanoengine.kernels.triton_store import store_kv

    gen = torch.Generator().manual_seed(1)
    num_kv_heads, head_dim, block_size, num_blocks, n = 3, 48, 16, 12, 40
    qkv = torch.randn(n, (4 + 2 * num_kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    k = qkv[:, 4 * head_dim:][:, :num_kv_heads * head_dim].view(n, num_kv_heads, head_dim)  # strided rows
    v = qkv[:, (4 + num_kv_heads) * head_dim:].view(n, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[::5] = -1
    slots = slots.to(DEVICE)
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    want_k, want_v = (torch.full(shape, 7.0, dtype=dtype, device=DEVICE) for _ in "kv")
    torch_backend.store_kvcache(k, v, want_k, want_v, slots)
    if layout == "heads_first":
        k_cache, v_cache = (torch.full(shape, 7.0, dtype=dtype, device=DEVICE) for _ in "kv")
        store_kv(k, v, k_cache, v_cache, slots)
    else:  # [num_blocks, block_size, num_kv_heads, head_dim], stored through a permuted view
        flash = (num_blocks, block_size, num_kv_heads, head_dim)
        fk, fv = (torch.full(flash, 7.0, dtype=dtype, device=DEVICE) for _ in "kv")
        store_kv(k, v, heads_first(fk), heads_first(fv), slots)
        k_cache, v_cache = heads_first(fk), heads_first(fv)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


# every GQA shape and block size in bf16; float32 (also in tests/test_attention.py, without splits) once each
DECODE_CASES = ([(torch.bfloat16, *g, bs) for g in GQA for bs in (16, 256)]
                + [(torch.float32, *GQA[1], bs) for bs in (16, 256)])


@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,block_size", DECODE_CASES,
                         ids=[f"{str(c[0])[6:]}-{c[1]}/{c[2]}-d{c[3]}-bs{c[4]}" for c in DECODE_CASES])
def test_decode_with_and_without_split_k_equals_reference(dtype, num_heads, num_kv_heads, head_dim,
                                                          block_size):
    """Ragged contexts (1 token, within one block, across blocks) in scattered blocks, padded tables; one
    program per (sequence, kv head), or the context split 3 ways (short contexts leave splits empty), merged;
    and a context of 0 (CUDA-graph padding) gives zeros."""
    from nanoengine.kernels.triton_decode import paged_decode

    gen = torch.Generator().manual_seed(num_heads * 10 + block_size)
    lens = [1, 37, 150] if block_size == 16 else [1, 37, 300]  # 300: across a block of 256
    num_blocks = 32 if block_size == 16 else 6
    tables = make_layout(lens, block_size, num_blocks, gen)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    context = torch.tensor(lens)
    scale = head_dim ** -0.5
    want = torch_backend.decode_attention(q.double(), k_cache.double(), v_cache.double(), block_tables,
                                          context, scale)
    args = [t.to(DEVICE) for t in (q, k_cache, v_cache, block_tables, context)]
    padded = [t.to(DEVICE) for t in (q[:2], k_cache, v_cache, block_tables[:2], torch.tensor([0, 37]))]
    for splits in (1, 3):
        got = paged_decode(*args, scale, num_splits=splits)
        assert got.dtype == dtype and got.shape == q.shape
        assert_matches(got, want, f"decode, {splits} split(s)")
        # a CUDA-graph padding row (context 0) reads nothing and gives zeros, not 0/0; its neighbour is intact
        got = paged_decode(*padded, scale, num_splits=splits).cpu()
        assert got[0].eq(0).all(), f"context 0, {splits} split(s): {got[0].abs().max()}"
        assert_matches(got[1:], want[1:2], "decode next to a padding row")


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", GQA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_step_equals_dense_attention(dtype, num_heads, num_kv_heads, head_dim, block_size):
    """One whole step of the Triton backend (store, decode rows, prefill rows): decodes, a fresh prompt, and
    chunks after cached prefixes (some within one block, one after a full 256-token block), plus a decode
    row whose K/V the prefix cache already holds (slot -1: the fully cached prompt whose last token is
    recomputed). Compared per token with dense float64 causal attention, and the cache with the new rows."""
    if dtype == torch.float32 and block_size == 16:
        pytest.skip("tests/test_attention.py covers float32 with small blocks")
    gen = torch.Generator().manual_seed(num_heads + block_size)
    # a chunk after a whole block of 256; a fully cached 1-block prompt
    seqs = SEQS + [(300, 256), (256, 255)]
    b = make_batch("triton", seqs, num_heads, num_kv_heads, head_dim, block_size, gen,
                   num_blocks=16 if block_size == 256 else 100, dtype=dtype, device=DEVICE)
    # the fully cached prompt's last token: its K/V is in the cache already, so its slot is -1 and the
    # K/V handed to the layer must not be written (garbage here)
    row = b.seqs.index((256, 255))  # a decode: rows of decodes come first, one each
    n, _ = b.seqs[row]
    _, k_full, v_full = b.full[row]
    table = b.meta.decode_block_tables[row]
    b.attn.k_cache[:, table[(n - 1) // block_size], (n - 1) % block_size] = k_full[n - 1].to(DEVICE)
    b.attn.v_cache[:, table[(n - 1) // block_size], (n - 1) % block_size] = v_full[n - 1].to(DEVICE)
    b.meta.slot_mapping[row] = -1
    b.k[row], b.v[row] = 1e4, -1e4
    b.meta.prepared = b.attn.prepare(b.meta, b.attn.k_cache.shape)
    out = b.attn(b.q, b.k, b.v, b.meta)
    assert out.dtype == dtype and out.shape == b.q.shape
    assert_matches(out, expected_outputs(b), "triton backend step")
    assert not (b.attn.k_cache == 1e4).any(), "a slot -1 row was written"
    written = [i for i, s in enumerate(b.slots) if i != row]
    flat_k = b.attn.k_cache.view(num_kv_heads, -1, head_dim)
    assert torch.equal(flat_k[:, torch.tensor(b.slots, device=DEVICE)[written]].transpose(0, 1), b.k[written])


def test_kernels_imported_before_the_interpreter_was_switched_on_are_a_clear_error():
    """triton decides at a kernel's definition whether it is interpreted: a CPU process that imported the
    kernels before setting TRITON_INTERPRET=1 gets an error naming the fix, not a crash inside triton."""
    import os
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("CPU-only rule")
    code = ("import os; import nanoengine.kernels.triton_store; os.environ['TRITON_INTERPRET'] = '1'\n"
            "from nanoengine.attention import get_backend\n"
            "try:\n    get_backend('triton')(4, 2, 32, 0.1)\nexcept RuntimeError as e:\n    print(e)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "imported before TRITON_INTERPRET=1 was set" in out.stdout, out.stdout + out.stderr
