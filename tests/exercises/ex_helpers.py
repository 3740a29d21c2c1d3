"""Comparisons for the exercise tests whose failure messages say what differs and where to read, and the
naming of classic mistakes: a test computes the wrong variants, says "this looks like ..." when the learner's
answer matches one (`explained`), and checks first that its checker names each of them (`assert_detects`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.sequence import Sequence
from nanoengine.sampling_params import SamplingParams


def book(chapter_file: str, exercise: str) -> str:
    """Where to read: the notebook that sets `exercise` (a chapter's part, nanoengine.book), else
    `chapter_file`."""
    from nanoengine.book import see

    return see(exercise, chapter_file)


def _fmt(x: Any) -> str:
    s = repr(x)
    return s if len(s) < 120 else s[:117] + "..."


def assert_same_list(got: Any, want: list, what: str, where: str) -> None:
    """Equal sequences, or a message with the length or the first differing index."""
    if got is None or not hasattr(got, "__len__"):
        raise AssertionError(f"{what}: expected a list of {len(want)} items, got {_fmt(got)} {where}")
    got = list(got)
    if len(got) != len(want):
        raise AssertionError(f"{what}: length {len(got)}, expected {len(want)}; yours {_fmt(got)}, "
                             f"expected {_fmt(want)} {where}")
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            raise AssertionError(f"{what}: first difference at index {i}: yours {_fmt(a)}, expected {_fmt(b)}"
                                 f" (yours {_fmt(got[max(0, i - 3): i + 4])} vs expected "
                                 f"{_fmt(want[max(0, i - 3): i + 4])} around it) {where}")


def assert_equal(got: Any, want: Any, what: str, where: str) -> None:
    if got != want:
        raise AssertionError(f"{what}: yours {_fmt(got)}, expected {_fmt(want)} {where}")


def assert_close(got: Any, want: torch.Tensor, what: str, where: str, atol: float = 1e-5,
                 rtol: float = 1e-5, check_dtype: bool = True) -> None:
    """Same shape (and dtype), values within tolerance; else the max error and the first wrong index."""
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what}: expected a tensor of shape {tuple(want.shape)}, got "
                             f"{type(got).__name__} {where}")
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)} {where}")
    if check_dtype and got.dtype != want.dtype:
        raise AssertionError(f"{what}: dtype {got.dtype}, expected {want.dtype} {where}")
    g, w = got.detach().double(), want.detach().double()
    bad = ~torch.isclose(g, w, atol=atol, rtol=rtol, equal_nan=False)
    if bad.any():
        err = (g - w).abs().nan_to_num(float("inf"))
        idx = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} values differ, max abs error {float(err.max()):.3g} "
            f"(tolerance {atol:g} + {rtol:g} * |expected|); first wrong index {idx}: yours "
            f"{float(g[idx]):.6g}, expected {float(w[idx]):.6g} {where}")


def same_answer(a: Any, b: Any, atol: float = 1e-5, rtol: float = 1e-5) -> bool:
    """Whether two answers agree: tensors of one shape within tolerance, anything else by ==."""
    if isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and a.shape == b.shape
                and bool(torch.allclose(a.detach().double(), b.detach().double(), atol=atol, rtol=rtol)))
    return a == b


def looks_like(got: Any, variants: dict[str, Callable[[], Any]], same: Callable[[Any, Any], bool] = same_answer) -> str:
    """" This looks like <mistake>." for every classic mistake (its description -> a function computing that
    wrong answer) whose answer equals the learner's; "" when none does."""
    named = []
    for description, compute in variants.items():
        try:
            wrong = compute()
        except Exception:  # a variant that cannot run on this input is not the learner's answer
            continue
        if same(got, wrong):
            named.append(description)
    return "".join(f" This looks like {d}." for d in named)


@contextmanager
def explained(got: Any, variants: dict[str, Callable[[], Any]],
              same: Callable[[Any, Any], bool] = same_answer) -> Iterator[None]:
    """`with explained(got, variants): <assertions about got>`: when they fail, add which classic mistake
    `got` matches."""
    try:
        yield
    except AssertionError as e:
        hint = looks_like(got, variants, same)
        if not hint:
            raise
        raise AssertionError(with_hint(str(e), hint)) from None


_WHERE = re.compile(r"\s*(\(Exercise \d+\.\d+; see book/[^)]*\))\s*$")


def with_hint(message: str, hint: str) -> str:
    """The message with the hint before its closing "(Exercise N.M; see book/...)", if it has one."""
    m = _WHERE.search(message)
    return f"{message[:m.start()]}.{hint} {m.group(1)}" if m else f"{message}{hint}"


def assert_detects(checker: Callable[[Callable], None], wrong: Callable, phrase: str) -> None:
    """The test checks itself (after the learner's answer, so an untouched stub fails at once): its checker, run
    on a classic wrong answer, must fail with a message that names the mistake (`phrase`). A failure here is a
    bug in the test, not in the learner's code."""
    try:
        checker(wrong)
    except AssertionError as e:
        if phrase not in str(e):
            raise AssertionError(f"test bug: the check of the wrong answer {wrong.__name__} fails without saying "
                                 f"{phrase!r}: {e}") from None
        return
    raise AssertionError(f"test bug: the check passes on the wrong answer {wrong.__name__}")


# chi-square critical values at p = 0.001, by degrees of freedom (a correct sampler fails 1 run in 1000)
CHI2_P001 = {3: 16.27, 4: 18.47, 5: 20.52, 7: 24.32, 15: 37.70}


def chi_square(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson's statistic of the draws `tokens` [N] int64 against the law p [V] (V - 1 degrees of freedom)."""
    counts = torch.bincount(tokens, minlength=p.numel()).double()  # [V]
    expected = p.double() * tokens.numel()  # [V]
    return float(((counts - expected) ** 2 / expected).sum())


# ------------------------------------------------------------------ sequences as the engine admits them
def make_seq(tokens, bs):
    return Sequence(list(tokens), SamplingParams(), bs)


def engine_prefill(bm: BlockManager, seq: Sequence) -> int:
    """Admit and compute a whole prompt the way the scheduler and model runner do; return hit tokens."""
    hits = bm.match_prefix(seq)
    seq.num_cached_tokens = hits
    seq.num_computed_tokens = min(hits, seq.num_tokens - 1)  # the last token is always recomputed
    bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return hits
