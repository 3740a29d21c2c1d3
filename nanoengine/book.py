"""The book's notebooks and where each exercise is set. All chapters.

A chapter is one number and one Python module (solutions/chNN_topic.py, exercises/chNN_topic.py,
tests/exercises/test_chNN_topic.py); its notebook is book/NN_topic.ipynb, or, for a chapter of more than an
hour of learner time, its parts book/NNa_topic.ipynb, book/NNb_topic.ipynb, ... (sortable names). An
exercise is set in the notebook whose markdown has its heading (`### Exercise 3.4: ...`). `check()`,
scripts/make_exercises.py and the exercise tests' messages ask this module, so that they name the notebook a
learner has open. It reads the source checkout's book/ folder (the book ships with the repository, not with
the package).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
NAME = re.compile(r"(\d\d)([a-z]?)_(\w+)\.ipynb")  # "03b_paged_attention.ipynb": chapter 03, part b
HEADING = re.compile(r"^#{2,4} Exercise (\d+)\.(\d+)\b", re.M)


def notebooks(book: Path | None = None) -> list[Path]:
    """Every chapter notebook and part in `book` (default: the checkout's book/), in reading order
    (00_overview, ..., 03a_..., 03b_..., 04_...)."""
    return sorted(p for p in (book or BOOK).glob("[0-9][0-9]*_*.ipynb") if NAME.fullmatch(p.name))


def part_of(path: Path | str) -> str:
    """"03b" for book/03b_paged_attention.ipynb, "09" for book/09_speculative_decoding.ipynb."""
    m = NAME.fullmatch(Path(path).name)
    if not m:
        raise ValueError(f"{path}: book notebooks are named NN_topic.ipynb or NNx_topic.ipynb")
    return m.group(1) + m.group(2)


def chapter_notebooks(nn: str | int, book: Path | None = None) -> list[Path]:
    """The notebooks of chapter `nn` ("03" or 3): its one notebook, or its parts in order."""
    nn = f"{int(nn):02d}"
    return [p for p in notebooks(book) if p.name[:2] == nn]


@lru_cache(maxsize=256)
def _headings(path: str, mtime_ns: int) -> tuple[str, ...]:
    cells = json.loads(Path(path).read_text())["cells"]
    found: list[str] = []
    for cell in cells:
        if cell["cell_type"] != "markdown":
            continue
        text = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        found += [f"{int(a)}.{int(b)}" for a, b in HEADING.findall(text)]
    return tuple(found)


def exercises_in(path: Path) -> list[str]:
    """The exercises a notebook sets ("3.4", ...), in its order: those with a heading in its markdown."""
    return list(_headings(str(path), path.stat().st_mtime_ns))


def notebook_of(exercise: str, book: Path | None = None) -> Path | None:
    """The notebook that sets `exercise` ("3.4"), or None when no notebook has its heading."""
    chapter = exercise.split(".")[0]
    for path in chapter_notebooks(chapter, book) if chapter.isdigit() else []:
        if exercise in exercises_in(path):
            return path
    return None


def see(exercise: str, fallback: str | None = None) -> str:
    """"(Exercise 3.4; see book/03b_paged_attention.ipynb)": where a message sends the learner (the notebook
    that sets the exercise; `fallback`, a notebook's name, where no notebook has its heading)."""
    found = notebook_of(exercise)
    name = found.name if found else fallback
    return f"(Exercise {exercise}; see book/{name})" if name else f"(Exercise {exercise})"


def part_exercises(part: str, book: Path | None = None) -> list[str]:
    """The exercises set in one part ("03b"), or in every notebook of a chapter ("03")."""
    m = re.fullmatch(r"(\d{1,2})([a-z]?)", part)
    if not m:
        raise ValueError(f"{part!r}: a chapter ('03') or a part ('03b')")
    nn, letter = f"{int(m.group(1)):02d}", m.group(2)
    return [n for p in chapter_notebooks(nn, book) if not letter or part_of(p) == nn + letter
            for n in exercises_in(p)]
