"""The house's rules, checked on the source: no import cycles inside nanoengine/ (imports inside functions
count; typing-only ones do not), `engine/` never imports `distributed/`, the model runner knows nothing of
processes, the config and the plan name no chapter and read no global state, every attention backend
implements the declared interface, a default generate imports no extension it does not use, and the core
files branch on no extension by name (scripts/core_size.py counts)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nanoengine"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str) -> set[str]:
    """The nanoengine modules `name` imports, anywhere in it except under `if TYPE_CHECKING:`.
    `from pkg import x` is an import of pkg.x when that is a module, else of pkg."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test)
                   for stmt in node.body for n in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in MODULES}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found |= {sub} if sub in MODULES else ({base} if base in MODULES else set())
    return found - {name}


GRAPH = {name: imports_of(name) for name in MODULES}


def cycles() -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_the_import_finder_sees_imports_inside_functions():
    tree_has = imports_of("nanoengine.serve.server")  # it imports the engine builder inside Server.__init__
    assert "nanoengine.launch" in tree_has


def test_no_module_imports_one_that_imports_it_back():
    assert cycles() == []


def test_engine_never_imports_distributed():
    """distributed/ may import engine/ (a worker hosts a ModelRunner), never the reverse."""
    wrong = {m: sorted(i for i in GRAPH[m] if i.startswith("nanoengine.distributed"))
             for m in GRAPH if m.startswith("nanoengine.engine")}
    assert not {m: i for m, i in wrong.items() if i}


def test_the_model_runner_knows_nothing_of_processes():
    source = MODULES["nanoengine.engine.model_runner"].read_text()
    for word in ("Workers", "worker", "multiprocessing", "lockstep", "collective_rpc", "spawn"):
        assert word not in source, word


@pytest.mark.parametrize("module", ["nanoengine.config", "nanoengine.plan", "nanoengine.plan_cpu",
                                    "nanoengine.plan_backend"])
def test_the_config_and_the_plan_name_no_chapter_and_read_no_global_state(module):
    source = MODULES[module].read_text()
    assert not [c for c in ("ch02", "ch03", "ch04", "ch05", "ch06", "ch07") if c in source]
    assert "_default" not in source and "global " not in source
    assert "nanoengine.engine" not in " ".join(GRAPH[module])


def test_the_data_parallel_front_end_loads_no_torch():
    """The front end only forwards HTTP; its replicas load the engine (gpus_for imports torch when called)."""
    code = ("import sys, nanoengine.serve.data_parallel, nanoengine.distributed.exits; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_chapter_selection_imports_nothing_from_the_engine():
    assert not [m for m in GRAPH["nanoengine.pieces"] if m.startswith("nanoengine.engine")]


def test_every_attention_backend_implements_the_interface():
    from nanoengine.attention import BACKENDS, AttentionBackend, TorchAttention

    assert set(BACKENDS) == {"torch", "cpu", "triton", "flash_attn"}
    for name, cls in BACKENDS.items():
        assert issubclass(cls, AttentionBackend) and cls.name == name
        assert not inspect.isabstract(cls), f"{name}: {sorted(cls.__abstractmethods__)} not implemented"
        assert isinstance(cls.cuda_graphs, bool)
        assert len(cls.kv_cache_shape(8, 16, 2, 64)) == 4
    # the reference is one implementation, not the base of the others (the cpu backend is the torch
    # backend with its decode step in C++: a variant of it, as the learner's pieces are)
    assert not any(issubclass(BACKENDS[n], TorchAttention) for n in ("triton", "flash_attn"))
    with pytest.raises(TypeError, match="abstract"):
        AttentionBackend(4, 2, 64, 0.125)


EXTENSIONS = ("nanoengine.spec", "nanoengine.structured", "nanoengine.layers.logprobs", "nanoengine.serve",
              "nanoengine.viz", "nanoengine.bench", "nanoengine.parsers", "nanoengine.tools", "xgrammar",
              "nanoengine.engine.overlap",
              # tensor parallelism's ranks (one process needs only the launcher's check for torchrun)
              "nanoengine.distributed.executor", "nanoengine.distributed.workers",
              "nanoengine.distributed.worker", "nanoengine.distributed.ranks",
              "nanoengine.distributed.channel", "nanoengine.distributed.launched_ranks")


def extensions_imported(params: str) -> list[str]:
    """The extension packages a fresh process has imported after one LLM(...).generate(..., params)."""
    code = ("import sys\nfrom nanoengine import LLM, SamplingParams\n"
            f"LLM('tiny-qwen3').generate(['hi'], SamplingParams({params}), use_tqdm=False)\n"
            f"print(sorted(m for m in sys.modules if m.startswith({EXTENSIONS!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_a_default_generate_imports_no_extension_it_does_not_use():
    assert extensions_imported("max_tokens=4") == []
    # (and they are imported where they are used)
    assert {"nanoengine.layers.logprobs", "nanoengine.structured"} <= set(extensions_imported(
        "max_tokens=4, logprobs=1, structured_outputs=__import__('nanoengine').sampling_params"
        ".StructuredOutputsParams(regex='[a-z]+')"))


def load_core_size():
    spec = importlib.util.spec_from_file_location("core_size", PACKAGE.parent / "scripts" / "core_size.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_core_files_branch_on_no_extension_by_name():
    """An extension enters at a declared hook (engine/hooks.py), chosen in assemble(): the scheduler, the
    input builder, the engine loop, the model runner and the executor never test for one by name."""
    core_size = load_core_size()
    found = core_size.extension_branches(PACKAGE.parent)
    assert not found, ("the core files branch on an extension by name:\n" +
                       "\n".join(f"  nanoengine/{f}:{line}: {test}" for f, line, test in found) +
                       "\ngive it a hook (engine/hooks.py) that assemble() chooses, and call the hook")
    missing = [f for f in core_size.READING_PATH if not (PACKAGE / f).is_file()]
    assert not missing, f"scripts/core_size.py's reading path names files that do not exist: {missing}"
