"""Generate the learner's `exercises/chNN_topic.py` from the reference `solutions/chNN_topic.py`.

Every `# BEGIN SOLUTION` ... `# END SOLUTION` block in a solution file becomes one line,
`raise NotImplementedError("Exercise N.k: <what> - see book/NN_topic.ipynb")`, at the marker's indentation.
The label comes from the nearest line above the block that reads `Exercise N.k: <what>` (the function's
docstring), so every exercise names itself in the book's terms. The notebook named is the one that sets the
exercise (its `### Exercise N.k` heading): a chapter split into parts (book/03a_..., book/03b_...) names the
part (nanoengine.book).

    python scripts/make_exercises.py            # (re)write exercises/ from solutions/
    python scripts/make_exercises.py --check    # exit 1 if exercises/ is out of sync (CI)
    python scripts/make_exercises.py --out DIR  # write fresh stubs somewhere else (the meta test does)

`make test` runs the check through tests/test_exercises_meta.py.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

from nanoengine import book

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "# BEGIN SOLUTION"
END = "# END SOLUTION"
LABEL = re.compile(r"Exercise (\d+)\.(\d+): (.+?)\.?(?:\"\"\"|''')?\s*$")
NAME = re.compile(r"ch(\d\d)_(\w+)\.py")
HEADER = '''\
# Your exercises for book/{notebook} -- this file is yours to edit.
# Replace each `raise NotImplementedError(...)` with your code, then run the chapter's check cell
# (`check("ch{nn}")`, from nanoengine.check) or: pytest tests/exercises/test_ch{nn}_{topic}.py
# Generated from solutions/{name} by scripts/make_exercises.py (maintainers: edit the solution, regenerate).
'''


class MarkerError(ValueError):
    pass


def stub_source(solution: Path, book_dir: Path | None = None) -> str:
    """The exercise file generated from one solution file (raises MarkerError on malformed markers)."""
    m = NAME.fullmatch(solution.name)
    if not m:
        raise MarkerError(f"{solution}: solution files are named chNN_topic.py")
    nn, topic = m.groups()
    notebook = f"{nn}_{topic}.ipynb"
    parts = book.chapter_notebooks(nn, book_dir) if book_dir is not None else []
    if book_dir is not None and not parts:
        raise MarkerError(f"{solution}: its chapter book/{notebook} (or its parts book/{nn}a_*.ipynb, ...) "
                          "does not exist")
    if len(parts) > 1 or parts and parts[0].name != notebook:
        notebook = ", ".join(p.name for p in parts)
    lines = solution.read_text().splitlines()
    out = [HEADER.format(notebook=notebook, nn=nn, topic=topic, name=solution.name).rstrip("\n")]
    label = None
    inside = None  # line number of the open BEGIN marker
    seen: set[str] = set()
    for no, line in enumerate(lines, 1):
        stripped = line.strip()
        if inside is None:
            lm = LABEL.search(line)
            if lm:
                label = lm
            if stripped == BEGIN:
                if label is None:
                    raise MarkerError(f"{solution}:{no}: {BEGIN} without an 'Exercise N.k: ...' line "
                                      "above it")
                if label.group(1) != str(int(nn)):
                    raise MarkerError(f"{solution}:{no}: Exercise {label.group(1)}.{label.group(2)} "
                                      f"in chapter {nn}'s file")
                number = f"{label.group(1)}.{label.group(2)}"
                what = label.group(3).replace('"', "'")
                indent = line[: len(line) - len(line.lstrip())]
                where = book.notebook_of(number, book_dir) if book_dir is not None else None
                where_name = where.name if where else notebook.split(", ")[0]
                msg = f"Exercise {number}: {what} - see book/{where_name}"
                out.append(f'{indent}raise NotImplementedError("{msg}")')
                seen.add(number)
                inside = no
            elif stripped == END:
                raise MarkerError(f"{solution}:{no}: {END} without a {BEGIN}")
            else:
                out.append(line)
        elif stripped == END:
            inside = None
            label = None  # each block needs its own label
        elif stripped == BEGIN:
            raise MarkerError(f"{solution}:{no}: nested {BEGIN} (the one on line {inside} is still open)")
    if inside is not None:
        raise MarkerError(f"{solution}:{inside}: {BEGIN} is never closed")
    if not seen:
        raise MarkerError(f"{solution}: no {BEGIN} blocks")
    return "\n".join(out) + "\n"


def generate(solutions_dir: Path = ROOT / "solutions", book_dir: Path | None = None) -> dict[str, str]:
    """{file name: generated exercise source} for every solutions/chNN_*.py."""
    return {p.name: stub_source(p, book_dir) for p in sorted(solutions_dir.glob("ch[0-9][0-9]_*.py"))}


def check(root: Path = ROOT) -> list[str]:
    """Problems that make exercises/ differ from what solutions/ generates (empty list: in sync)."""
    try:
        want = generate(root / "solutions", root / "book")
    except MarkerError as e:
        return [str(e)]
    problems = []
    ex_dir = root / "exercises"
    for name, text in want.items():
        path = ex_dir / name
        if not path.is_file():
            problems.append(f"exercises/{name} is missing")
            continue
        have = path.read_text()
        if have != text:
            diff = difflib.unified_diff(have.splitlines(), text.splitlines(), f"exercises/{name}",
                                        "generated", lineterm="", n=1)
            problems.append(f"exercises/{name} differs from what solutions/{name} generates:\n"
                            + "\n".join(list(diff)[:30]))
    for path in sorted(ex_dir.glob("ch[0-9][0-9]_*.py")):
        if path.name not in want:
            problems.append(f"exercises/{path.name} has no solutions/{path.name}")
    return problems


def write(out_dir: Path, solutions_dir: Path = ROOT / "solutions",
          book_dir: Path | None = ROOT / "book") -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in generate(solutions_dir, book_dir).items():
        (out_dir / name).write_text(text)
        written.append(out_dir / name)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if exercises/ is out of sync with solutions/")
    ap.add_argument("--out", type=Path, default=None, help="write the stubs here instead of exercises/")
    args = ap.parse_args(argv)
    if args.check:
        problems = check()
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("\nexercises/ is out of sync: run `python scripts/make_exercises.py` (this overwrites "
                  "exercises/; a learner's filled-in exercises make this check fail on purpose)",
                  file=sys.stderr)
            return 1
        print(f"exercises/ in sync with solutions/ ({len(generate())} chapters)")
        return 0
    try:
        written = write(args.out or ROOT / "exercises", book_dir=ROOT / "book")
    except MarkerError as e:
        print(e, file=sys.stderr)
        return 1
    for p in written:
        print(f"wrote {p.relative_to(ROOT) if p.is_relative_to(ROOT) else p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
