"""Three ways to run the same engine, side by side on this machine: one process (TP=1), TP=2 with rank 0's
own local workers (calls over a socket pair), and TP=2 from two torchrun launchers acting as two "nodes" on
loopback (calls by broadcast over gloo, as across machines). Chapter 07 ("beyond one machine").

For each: the greedy tokens of a few prompts (they must be equal), and the decode step time at batch 1 and 8
(`decode_batches.decode_points`: the median gap between decode steps, host work included). On CPU the ranks
share the cores: TP=1 gets all the threads, each TP rank its share, so the figures say what the transport
costs, not what a second GPU would buy (chapter 07's `tp_cost` model says that).

    python -m nanoengine.bench.tp_launch [--model smollm2-135m] [--out-dir bench_results]

The torchrun run starts this module again as its job (`--job OUT`), on every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from nanoengine import LLM, SamplingParams
from nanoengine.bench import hardware
from nanoengine.bench.decode_batches import decode_points
from nanoengine.bench.host import with_json

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,",
           "def fibonacci(n):", "The paged KV cache stores keys and values in blocks so that"]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
OPTIONS = dict(dtype="float32", async_scheduling=False)
BATCHES = (1, 8)


def measure(llm: LLM) -> dict[str, Any]:
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    points = decode_points(llm, BATCHES, prompt_len=8, steps=24)
    return {"tokens": tokens, "step_ms": {str(p["batch"]): p["step_s"] * 1e3 for p in points}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_node(node_rank: int, port: int, *command: str, nnodes: int = 2, nproc: int = 1) -> list[str]:
    """The torchrun command of "node" `node_rank` of `nnodes` on this machine, running `command` on `nproc`
    ranks. The static rendezvous: node 0 hosts the store at 127.0.0.1:port and holds rank 0 (with c10d's the
    ranks go in the order the nodes join, and the store lives with whichever node bound the endpoint first).
    Also tests/test_torchrun.py's."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
            f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port}",
            "--local-addr=127.0.0.1", "--max-restarts=0", *command]


def two_launchers(model: str, threads: int, timeout_s: float = 900) -> dict[str, Any]:
    """TP=2 from two torchrun launchers (--nnodes 2, static rendezvous on 127.0.0.1), one rank each."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        job = ("-m", "nanoengine.bench.tp_launch", "--model", model, "--job", str(out))
        nodes = [subprocess.Popen(loopback_node(rank, port, *job), env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
                 for rank in range(2)]
        logs = [n.communicate(timeout=timeout_s)[0] for n in nodes]
        if any(n.returncode for n in nodes):
            raise RuntimeError("the torchrun run failed:\n" + "\n".join(logs))
        return json.loads(out.read_text())


def run(model: str = "smollm2-135m", out_dir: str | None = "bench_results") -> dict[str, Any]:
    threads = torch.get_num_threads()
    with LLM(model, **OPTIONS) as one:
        results = {"tp1": measure(one)}
    with LLM(model, tensor_parallel_size=2, **OPTIONS) as two:
        results["tp2_local_workers"] = measure(two)
    results["tp2_two_torchrun_nodes"] = two_launchers(model, max(1, threads // 2))
    want = results["tp1"]["tokens"]
    result = {"workload": "tp-launch", "model": model, "threads": threads, "batches": list(BATCHES),
              "runs": {name: {"tokens_equal_tp1": r["tokens"] == want, "step_ms": r["step_ms"]}
                       for name, r in results.items()},
              "hardware": hardware.describe("cpu")}
    return with_json(result, out_dir)


def report(result: dict[str, Any]) -> str:
    lines = [f"{result['model']}, {result['threads']} threads in all; decode step (ms), median",
             f"{'run':<26}" + "".join(f"{'batch ' + str(b):>10}" for b in result["batches"])
             + "  tokens = TP=1"]
    for name, r in result["runs"].items():
        lines.append(f"{name:<26}" + "".join(f"{r['step_ms'][str(b)]:>10.2f}" for b in result["batches"])
                     + f"  {r['tokens_equal_tp1']}")
    return "\n".join(lines)


def job(model: str, out: str) -> None:
    """Every torchrun rank runs this; ranks 1.. serve rank 0 inside LLM(...) and exit there."""
    with LLM(model, tensor_parallel_size=2, **OPTIONS) as llm:
        Path(out).write_text(json.dumps(measure(llm)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanoengine.bench.tp_launch",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out-dir", default="bench_results")
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.job:
        job(args.model, args.job)
        return 0
    result = run(args.model, args.out_dir)
    print(report(result))
    print(f"JSON: {result.get('json_path')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
