"""`make book-html` (scripts/book_html.py): one short chapter built to HTML places each widget view where the
notebook shows it, embeds the widgets' state (every view's model is in it), and has no error output."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("book_html", ROOT / "scripts" / "book_html.py")
book_html = importlib.util.module_from_spec(spec)
spec.loader.exec_module(book_html)

VIEW = "application/vnd.jupyter.widget-view+json"


def test_unknown_chapter_is_named():
    with pytest.raises(SystemExit, match=r"no chapter '99'.*01_"):
        book_html.chapters(["99"])


@pytest.mark.notebooks
@pytest.mark.slow
@pytest.mark.xdist_group("notebooks")
def test_chapter_html_has_widget_state(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("NANOENGINE_IMPL", "solutions")
    monkeypatch.delenv("MPLBACKEND", raising=False)
    [path] = book_html.chapters(["01"])  # the tokenizer chapter: short, with a text box widget
    page, nb = book_html.build(path, tmp_path)
    text = page.read_text()

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"], f"{path.name} has error outputs"
    assert "Traceback (most recent call last)" not in text
    views = [o.data[VIEW]["model_id"] for o in outputs if VIEW in o.get("data", {})]
    assert views, f"{path.name} shows no widget; pick a chapter that does"
    placed = [json.loads(v)["model_id"] for v in re.findall(
        r'<script type="application/vnd\.jupyter\.widget-view\+json">(.*?)</script>', text, re.S)]
    assert placed == views, f"{page.name} places widget views {placed}; the notebook shows {views}"
    found = re.search(r'<script type="application/vnd\.jupyter\.widget-state\+json">(.*?)</script>', text,
                      re.S)
    assert found, f"{page.name} has no embedded widget state (application/vnd.jupyter.widget-state+json)"
    state = json.loads(found.group(1))["state"]
    missing = [m for m in views if m not in state]
    assert not missing, f"{page.name}: widget views {missing} have no model in the embedded state"
