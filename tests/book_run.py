"""Where the book's chapters are executed in a test run, and their time limit (tests/test_notebooks.py and
tests/test_browser.py).

The book is executed once per test run: in headless Chromium through JupyterLab (tests/test_browser.py, as a
learner runs it) where that can run, else headless through nbclient (tests/test_notebooks.py). Either way a
chapter's Run All must finish within NOTEBOOK_LIMIT_S.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

NOTEBOOK_LIMIT_S = 120
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


def browser_problem() -> str | None:
    """What the browser test lacks here (with how to get it), or None when it can run."""
    if importlib.util.find_spec("playwright") is None:
        return ("the playwright package: PIP_CONSTRAINT=constraints.txt .venv/bin/pip install playwright "
                "(it is in the dev extra: make setup)")
    if importlib.util.find_spec("jupyterlab") is None:
        return "JupyterLab: make setup"
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        return (f"Chromium at {CHROMIUM}: apt-get install chromium (Debian/Ubuntu), or set CHROMIUM to a "
                "Chromium binary")
    return None
