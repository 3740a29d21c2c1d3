"""The book: every chapter, or every part of a chapter split into parts of an hour (book/03a_..., 03b_...),
executes top to bottom, headless, on one CPU thread within 2 minutes, every cell included, as Run All does
for a learner (a cell tagged `gpu` guards itself with torch.cuda.is_available()); notebooks are stored
without outputs; each chapter has its exercises and a check cell, and each part its own exercises, learning
objectives at the top and a checkpoint with a check cell at the end.

Where the browser test can run (tests/test_browser.py: JupyterLab in headless Chromium, which .ci/run
installs), it executes the chapters, with the same time limit, and the nbclient run here skips, so that the
book runs once per test run; NANOENGINE_NBCLIENT=1 runs it here as well."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
from book_run import NOTEBOOK_LIMIT_S as LIMIT_S
from book_run import browser_problem

from nanoengine import book

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = book.notebooks(ROOT / "book")  # chapters and parts, in reading order
# nbclient waits for each cell's reply with this timeout. Under load the client sometimes misses the zmq
# wake-up for a reply that has already arrived (the kernel sat idle, seen with faulthandler) and only finds it
# when the wait times out; a per-cell limit well above any cell's run time bounds that stall. The longest
# cell, chapter 08's benchmark run, takes ~30-36 s on an AVX2-only EPYC (under 10 s with AVX-512).
CELL_TIMEOUT_S = 75


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def test_book_has_chapters():
    names = [p.stem for p in NOTEBOOKS]
    for nn in ("00", "01", "02", "03", "04"):
        assert book.chapter_notebooks(nn, ROOT / "book"), (
            f"book/{nn}_*.ipynb (or its parts book/{nn}a_*.ipynb, ...) is missing (have {names})")
    for nn in sorted({p.name[:2] for p in NOTEBOOKS}):
        parts = book.chapter_notebooks(nn, ROOT / "book")
        letters = [book.part_of(p)[2:] for p in parts]
        assert letters == [""] or letters == [chr(ord("a") + i) for i in range(len(parts))], (
            f"chapter {nn} is one notebook or parts a, b, c, ... in order; have {[p.name for p in parts]}")
        numbers = [n for p in parts for n in book.exercises_in(p)]
        assert len(set(numbers)) == len(numbers), f"chapter {nn} sets an exercise twice: {numbers}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_stored_clean_with_exercises_and_check(path):
    nn = path.name[:2]
    for i, cell in enumerate(cells(path)):
        if cell["cell_type"] == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None, (
                f"{path.name} cell {i} has stored outputs; clear them (Jupyter: Edit > Clear Outputs of All "
                f"Cells) before committing")
            if "gpu" in cell.get("metadata", {}).get("tags", []):
                assert "torch.cuda.is_available()" in source(cell), (
                    f"{path.name} cell {i} is tagged gpu but does not guard itself: wrap it in "
                    "`if torch.cuda.is_available():` so that Run All on a CPU laptop does not stop there")
    text = "\n".join(source(c) for c in cells(path))
    part = book.part_of(path)
    if part == nn:  # a chapter in one notebook
        exercises = set(re.findall(rf"Exercise {int(nn)}\.(\d+)", text))
        assert len(exercises) >= 3, (
            f"{path.name} presents {len(exercises)} exercises; a chapter has at least 3")
        assert re.search(rf"from nanoengine\.check import check\s+check\(\s*[\"']ch{nn}[\"']\s*\)", text), (
            f"{path.name} needs a check cell: from nanoengine.check import check, then check(\"ch{nn}\")")
        return
    parts = book.chapter_notebooks(nn, ROOT / "book")
    assert book.exercises_in(path), (
        f"{path.name} sets no exercise (a heading '### Exercise {int(nn)}.k: ...')")
    assert len({n for p in parts for n in book.exercises_in(p)}) >= 3, (
        f"chapter {nn} sets fewer than 3 exercises")
    first = source(cells(path)[0])
    assert first.startswith(f"# {part} ") and "Learning objectives" in first, (
        f"{path.name} opens with its title '# {part} · ...' and its learning objectives")
    last = "\n".join(source(c) for c in cells(path)[-3:])
    assert "## Checkpoint" in last, (
        f"{path.name} closes with a '## Checkpoint' (what you can now do, what to run)")
    ends = [f"ch{part}"] + ([f"ch{nn}"] if path == parts[-1] else [])
    found = re.findall(r"from nanoengine\.check import check\s+check\(\s*[\"'](ch\d\d[a-z]?)[\"']\s*\)", text)
    assert any(e in found for e in ends), (
        f"{path.name} needs a check cell: from nanoengine.check import check, then check(\"{ends[-1]}\")")


@pytest.mark.notebooks
@pytest.mark.slow
@pytest.mark.xdist_group("notebooks")
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, monkeypatch):
    if browser_problem() is None and not os.environ.get("NANOENGINE_NBCLIENT"):
        pytest.skip("executed in the browser by tests/test_browser.py "
                    "(NANOENGINE_NBCLIENT=1 runs it here too)")
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")

    # the kernel inherits this environment: one thread (two fight over two busy cores), no GUI backend
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    monkeypatch.delenv("MPLBACKEND", raising=False)
    for var in [v for v in os.environ if v.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))]:
        monkeypatch.delenv(var)
    nb = nbformat.read(path, as_version=4)  # every cell, the gpu-tagged ones too
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - t0
    assert seconds < LIMIT_S, f"{path.name} took {seconds:.0f} s to execute; the limit is {LIMIT_S} s"
