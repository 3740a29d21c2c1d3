"""Build the book to read without running it: execute every chapter the way tests/test_notebooks.py does
(every cell, the reference solutions in the check cells) and write build/book/NN_topic.html, with the
widgets' state embedded so that each widget shows, as it was after the run, while a reader scrolls.

    python scripts/book_html.py                  # every chapter into build/book/ (make book-html)
    python scripts/book_html.py 01 03 --out DIR  # some chapters, by number or name

A page loads the widget renderer (@jupyter-widgets/html-manager) from a CDN, so the widgets need a network
connection; without one the page shows each widget's text fallback. Moving a widget that redraws through
Python (the step sliders) needs a kernel: `make lab`.
"""

from __future__ import annotations

import argparse
import html
import os
import sys
import time
from pathlib import Path

import nbclient
import nbformat
from nbclient.exceptions import CellExecutionError
from nbconvert import HTMLExporter

from nanoengine import book

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
OUT = ROOT / "build" / "book"
CELL_TIMEOUT_S = 120  # the longest cell (chapter 08's benchmark) takes ~30 s on one slow core
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def chapters(selected: list[str] | None = None) -> list[Path]:
    """The book's chapters and parts, or those named in `selected` ("03": every part of chapter 03; "03b",
    "03b_paged_attention" or "03b_paged_attention.ipynb": one part)."""
    every = book.notebooks(BOOK)
    if not selected:
        return every
    picked = []
    for name in selected:
        found = [p for p in every if name in (p.name, p.stem, p.name[:2], book.part_of(p))]
        if not found:
            raise SystemExit(f"no chapter {name!r} in book/; the chapters are {[p.stem for p in every]}")
        picked += found
    return picked


def execute(path: Path, timeout: int = CELL_TIMEOUT_S) -> nbformat.NotebookNode:
    """Run every cell of a chapter in a fresh kernel (cwd book/) and keep the widgets' state in the notebook's
    metadata; a cell that fails raises nbclient's CellExecutionError naming it."""
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", store_widget_state=True,
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def to_html(nb: nbformat.NotebookNode) -> str:
    """The executed notebook as one HTML page (JupyterLab's look), widget state included."""
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    return body


def build(path: Path, out: Path = OUT, timeout: int = CELL_TIMEOUT_S) -> tuple[Path, nbformat.NotebookNode]:
    """Execute one chapter and write out/<chapter>.html; returns the page's path and the executed notebook."""
    nb = execute(path, timeout)
    out.mkdir(parents=True, exist_ok=True)
    page = out / f"{path.stem}.html"
    page.write_text(to_html(nb), encoding="utf-8")
    return page, nb


def write_index(out: Path) -> Path:
    """out/index.html: a link to each chapter's page found in `out`."""
    links = "\n".join(f'<li><a href="{html.escape(p.name)}">{html.escape(p.stem)}</a></li>'
                      for p in sorted(out.glob("[0-9][0-9]*_*.html")))
    index = out / "index.html"
    index.write_text(f"<!doctype html>\n<meta charset='utf-8'>\n<title>nanoengine: the book</title>\n"
                     f"<h1>nanoengine: the book</h1>\n<ol start='0'>\n{links}\n</ol>\n", encoding="utf-8")
    return index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("chapters", nargs="*", help="chapter numbers or names (default: every chapter)")
    parser.add_argument("--out", type=Path, default=OUT,
                        help=f"output folder (default: {OUT.relative_to(ROOT)})")
    parser.add_argument("--timeout", type=int, default=CELL_TIMEOUT_S, help="seconds allowed per cell")
    args = parser.parse_args(argv)
    # the kernels inherit this environment, as in tests/test_notebooks.py: the check cells run the reference
    # solutions (NANOENGINE_IMPL=exercises shows your own), and matplotlib picks the inline backend
    os.environ.setdefault("NANOENGINE_IMPL", "solutions")
    os.environ.pop("MPLBACKEND", None)
    for path in chapters(args.chapters):
        t0 = time.perf_counter()
        try:
            page, _ = build(path, args.out, args.timeout)
        except CellExecutionError as e:
            print(f"{path.name} failed:\n{e}", file=sys.stderr)
            return 1
        print(f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page}  "
              f"({time.perf_counter() - t0:.0f} s)")
    print(f"open {write_index(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
