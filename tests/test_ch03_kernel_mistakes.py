"""Exercises 3.7 and 3.8's checkers name the classic mistakes when they are made in a Triton kernel, not only
in the torch variants they compare with: the reference kernels (solutions/ch03_paged_kv.py) with one mistake
edited in, run in Triton's interpreter (or compiled on CUDA), must fail the exercise test's check with the
mistake's own words. Chapter 03."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "exercises"))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as the chapter file does, before any kernel is defined

import test_ch03_paged_kv as ex_test  # noqa: E402

pytest.importorskip("triton")

RIGHT = {  # the reference kernels' lines a mistake changes
    "pad": 'mask=mask, other=float("-inf"))',
    "row_max": "p = tl.exp(x - tl.max(x, axis=0))",
    "p": "p = tl.exp(scores - m_new[:, None])",
    "l": "l_i = l_i * alpha + tl.sum(p, axis=1)",
    "acc": "acc = acc * alpha[:, None] + tl.sum(",
    "valid": "(j * BLOCK_SIZE + n < context)",
    "q_mask": "q = tl.load(q_ptr + q_rows, mask=g_mask[:, None] & d_mask[None, :], other=0.0)",
    "out_mask": "out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])",
}
ROW_MISTAKES = {  # Exercise 3.7: mode of ROW_SOFTMAX_MISTAKES -> the edits that make it
    "zero_pad": {"pad": "mask=mask, other=0.0)"},
    "no_max": {"row_max": "p = tl.exp(x)"},
}
PAGED_MISTAKES = {  # Exercise 3.8: mode of ONLINE_MISTAKES (or "unmasked_rows") -> the edits that make it
    "no_max": {"p": "p = tl.exp(scores)", "l": "l_i = l_i + tl.sum(p, axis=1)", "acc": "acc = acc + tl.sum("},
    "no_rescale": {"l": "l_i = l_i + tl.sum(p, axis=1)", "acc": "acc = acc + tl.sum("},
    "one_more": {"valid": "(j * BLOCK_SIZE + n < context + 1)"},
    "one_fewer": {"valid": "(j * BLOCK_SIZE + n < context - 1)"},
    "unmasked_rows": {"q_mask": "q = tl.load(q_ptr + q_rows, mask=d_mask[None, :], other=0.0)",
                      "out_mask": "out.to(out_ptr.dtype.element_ty), mask=d_mask[None, :])"},
}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def chapter_with(edits: dict[str, str], name: str, tmp_path: Path):
    """The solution file with `edits` made, imported as a module of its own."""
    source = (ROOT / "solutions" / "ch03_paged_kv.py").read_text()
    for key, wrong in edits.items():
        assert source.count(RIGHT[key]) == 1, f"test bug: the reference kernel no longer has {RIGHT[key]!r}"
        source = source.replace(RIGHT[key], wrong)
    path = tmp_path / f"ch03_{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"_ch03_kernel_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mode", list(ROW_MISTAKES))
def test_a_mistake_in_the_row_softmax_kernel_is_named(mode, tmp_path):
    module = chapter_with(ROW_MISTAKES[mode], f"row_{mode}", tmp_path)
    with pytest.raises(AssertionError) as e:
        ex_test.check_row_softmax(module.triton_row_softmax,
                                  "(Exercise 3.7; see book/03c_online_softmax.ipynb)", DEVICE)
    assert f"This looks like {ex_test.ROW_SOFTMAX_MISTAKES[mode]}" in str(e.value), str(e.value)


@pytest.mark.parametrize("mode", list(PAGED_MISTAKES))
def test_a_mistake_in_the_paged_kernel_is_named(mode, tmp_path):
    module = chapter_with(PAGED_MISTAKES[mode], f"paged_{mode}", tmp_path)
    where = "(Exercise 3.8; see book/03d_triton_kernel.ipynb)"
    with pytest.raises(AssertionError) as e:  # as test_3_8 checks: its own heads first, then the values
        ex_test.check_own_heads(functools.partial(ex_test.launch_first_kv_head, module.paged_decode_kernel),
                                where, DEVICE)
        ex_test.check_online_decode(module.triton_paged_decode, where, DEVICE)
    description = ex_test.UNMASKED_ROWS if mode == "unmasked_rows" else ex_test.ONLINE_MISTAKES[mode]
    assert f"This looks like {description}" in str(e.value), str(e.value)
