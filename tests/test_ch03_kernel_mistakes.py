"""Exercise 3.7's checker names the classic mistakes when they are made in a Triton kernel, not only in the
torch variants it compares with: the reference kernel (solutions/ch03_paged_kv.py) with one mistake edited
in, run in Triton's interpreter (or compiled on CUDA), must fail the exercise test's check with the mistake's
own words. Chapter 03."""

from __future__ import annotations

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

RIGHT = {  # the reference kernel's lines a mistake changes
    "p": "p = tl.exp(scores - m_new[:, None])",
    "l": "l_i = l_i * alpha + tl.sum(p, axis=1)",
    "acc": "acc = acc * alpha[:, None] + tl.sum(",
    "valid": "(j * BLOCK_SIZE + n < context)",
}
MISTAKES = {  # mode of ONLINE_MISTAKES -> the edits that make it
    "no_max": {"p": "p = tl.exp(scores)", "l": "l_i = l_i + tl.sum(p, axis=1)", "acc": "acc = acc + tl.sum("},
    "no_rescale": {"l": "l_i = l_i + tl.sum(p, axis=1)", "acc": "acc = acc + tl.sum("},
    "one_more": {"valid": "(j * BLOCK_SIZE + n < context + 1)"},
    "one_fewer": {"valid": "(j * BLOCK_SIZE + n < context - 1)"},
}


def kernel_with(mode: str, tmp_path: Path):
    source = (ROOT / "solutions" / "ch03_paged_kv.py").read_text()
    for key, wrong in MISTAKES[mode].items():
        assert source.count(RIGHT[key]) == 1, f"test bug: the reference kernel no longer has {RIGHT[key]!r}"
        source = source.replace(RIGHT[key], wrong)
    path = tmp_path / f"ch03_{mode}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"_ch03_kernel_{mode}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.triton_paged_decode


@pytest.mark.parametrize("mode", list(MISTAKES))
def test_a_mistake_in_the_kernel_is_named(mode, tmp_path):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    where = "(Exercise 3.7; see book/03_paged_kv.ipynb)"
    with pytest.raises(AssertionError) as e:
        ex_test.check_online_decode(kernel_with(mode, tmp_path), where, device)
    assert f"This looks like {ex_test.ONLINE_MISTAKES[mode]}" in str(e.value), str(e.value)
