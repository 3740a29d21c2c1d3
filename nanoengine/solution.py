"""`show_solution("5.2")`: print the reference answer of one exercise, clearly labelled. All chapters.

The book's hints stop before the answer (a question, an idea, pseudo-code at most); when you want to compare
your code with one answer that passes, this prints the function (or method) of solutions/chNN_*.py whose
docstring starts with "Exercise 5.2:", with the lines between its `# BEGIN SOLUTION` and `# END SOLUTION`
markers. It is one answer, not the answer: the checks judge behaviour, so a different design passes too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_NUMBER = re.compile(r"(\d{1,2})\.(\d{1,2})")


def solution_source(exercise: str, folder: Path | None = None) -> str:
    """The source of the reference function or method for `exercise` ("5.2"), markers included."""
    m = _NUMBER.fullmatch(str(exercise).strip())
    if not m:
        raise ValueError(f"show_solution: name one exercise as 'chapter.number', e.g. '5.2', got "
                         f"{exercise!r}")
    folder = folder or ROOT / "solutions"
    files = sorted(folder.glob(f"ch{int(m.group(1)):02d}_*.py"))
    if not files:
        raise FileNotFoundError(f"show_solution: no solutions/ch{int(m.group(1)):02d}_*.py in {folder} (the "
                                "reference answers ship with the book's repository, not with the package)")
    label = f"Exercise {int(m.group(1))}.{int(m.group(2))}:"
    text = files[0].read_text()
    lines = text.splitlines()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node) or ""
            if doc.startswith(label) and not isinstance(node, ast.ClassDef):
                start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
                return "\n".join(lines[start:node.end_lineno])
    raise LookupError(f"show_solution: {files[0].name} has no function whose docstring starts {label!r}")


def show_solution(exercise: str) -> None:
    """Print the reference answer of `exercise` ("5.2") under a banner that says what it is."""
    source = solution_source(exercise)
    bar = "=" * 100
    print(f"{bar}\nREFERENCE SOLUTION of Exercise {exercise} (one answer that passes; yours may differ and "
          f"pass too)\n{bar}")
    print(source)
    print(bar)
