"""The exercise tests run against one implementation of the chapter modules:

- `exercises` (default): the learner's files in exercises/;
- `solutions`: the reference answers in solutions/ (CI: `NANOENGINE_IMPL=solutions make test`);
- a folder path: chNN_*.py files there (the meta test runs freshly generated stubs this way).

Choose with `pytest tests/exercises --impl=solutions` or the NANOENGINE_IMPL environment variable.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMPLS = ("exercises", "solutions")


def impl_dir(config) -> Path:
    value = config.getoption("--impl", default=None) or os.environ.get("NANOENGINE_IMPL") or "exercises"
    path = ROOT / value if value in IMPLS else Path(value).expanduser().resolve()
    if not path.is_dir():
        raise pytest.UsageError(f"--impl / NANOENGINE_IMPL={value!r}: choose {' or '.join(IMPLS)} or an "
                                f"existing folder of chNN_*.py files")
    return path


def pytest_report_header(config):
    return f"exercise implementation: {impl_dir(config)}"


_loaded: dict[Path, object] = {}


def load_chapter(config, name: str):
    """Import chNN_topic.py from the chosen folder (by path, under a name that cannot clash)."""
    path = impl_dir(config) / f"{name}.py"
    if path in _loaded:
        return _loaded[path]
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; regenerate exercises with "
                                "`python scripts/make_exercises.py`")
    mod_name = f"_nanoengine_impl_{abs(hash(str(path.parent)))}_{name}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    _loaded[path] = module
    return module


@pytest.fixture(scope="module")
def ex(request):
    """The chapter module under test; a test module names it with CHAPTER = "chNN_topic"."""
    return load_chapter(request.config, request.module.CHAPTER)
