"""Ranks from torchrun (the external launcher), on CPU over gloo and loopback: two launchers acting as two
"nodes" give one process's greedy tokens (chunked prefill, a preemption, prefix hits); killing the second
launcher mid-run makes rank 0 raise within 10 s and leaves no process; `nanoengine serve` under torchrun
listens on rank 0 alone and stops cleanly on SIGTERM; the launcher's variables are checked."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tp_workload import GREEDY, PROMPTS, TORCHRUN_OPTIONS

from nanoengine import LLM
from nanoengine.bench.tp_launch import free_port, loopback_node
from nanoengine.distributed import launcher
from nanoengine.errors import InvalidValueError

JOB = str(Path(__file__).with_name("torchrun_job.py"))
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, needs pidfd")
distributed = pytest.mark.xdist_group("notebooks")  # these start several processes (as test_tp's do)


def node(rank: int, port: int, *command: str, nproc: int = 1, nnodes: int = 2) -> subprocess.Popen:
    """One torchrun launcher ("node" `rank` of `nnodes`) on loopback, running `command` on `nproc` ranks."""
    return subprocess.Popen(loopback_node(rank, port, *command, nnodes=nnodes, nproc=nproc),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
                            start_new_session=True)


def processes_running(marker: str) -> list[int]:
    """Live processes whose command line holds marker (a launcher or one of its ranks)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline").read()
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z" and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def finish(*procs: subprocess.Popen, timeout: float = 120) -> list[str]:
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            outs.append(p.communicate()[0])
    return outs


@distributed
def test_two_launcher_nodes_give_one_process_tokens(tmp_path):
    port, out = free_port(), tmp_path / "tokens.json"
    nodes = [node(r, port, JOB, "tokens", str(out)) for r in range(2)]
    logs = finish(*nodes, timeout=240)
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(logs)
    got = json.loads(out.read_text())
    with LLM("tiny-qwen3", **TORCHRUN_OPTIONS) as one:
        want = [[o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
                for _ in range(2)]
    for round in range(2):
        for i, (g, w) in enumerate(zip(got["tokens"][round], want[round])):
            assert g == w, f"round {round}: prompt {i} differs between torchrun TP=2 and one process"
    assert got["chunked"] and got["preempted"], "the workload should chunk a prefill and preempt"
    assert got["hit_tokens"] > 0, "round 2 should hit the prefix cache"


@distributed
def test_killing_the_second_launcher_makes_rank_0_raise_within_10_s():
    port = free_port()
    first, second = node(0, port, JOB, "long"), node(1, port, JOB, "long")
    line, t0, deadline = "", time.monotonic(), time.monotonic() + 180
    while "STARTED" not in line and time.monotonic() < deadline:
        ready, _, _ = select.select([first.stdout], [], [], 1)
        line = first.stdout.readline() if ready else ""
    assert "STARTED" in line, "rank 0 never started generating"
    time.sleep(1)
    killed_at = time.time()
    os.kill(second.pid, signal.SIGKILL)  # the launcher alone: its rank must die with it
    started_s = time.monotonic() - t0
    out = finish(first, timeout=60)[0]
    second.wait(10)
    raised = re.search(r"RAISED (\S+) (.*)", out)
    assert raised, (f"rank 0 started after {started_s:.1f} s, then ended with {first.returncode} "
                    f"{time.time() - killed_at:.1f} s after the kill, saying: {out!r}")
    noticed = float(raised.group(1)) - killed_at
    assert noticed < 10, f"rank 0 noticed the lost node after {noticed:.1f} s"
    print(f"the lost node was noticed after {noticed:.2f} s")
    assert "tensor-parallel rank" in raised.group(2), raised.group(2)
    assert first.returncode != 0
    deadline = time.monotonic() + 10
    while processes_running(JOB) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_running(JOB) == [], "a launcher or a rank outlived the job"


@distributed
def test_a_rank_that_raises_reaches_rank_0_with_its_traceback():
    port = free_port()
    nodes = [node(r, port, JOB, "raise") for r in range(2)]
    first, _ = finish(*nodes, timeout=180)
    raised = re.search(r"RAISED \S+ (.*)", first)
    assert raised, first
    assert "tensor-parallel rank 1 failed" in raised.group(1)
    assert "RuntimeError: injected failure in rank 1" in raised.group(1), "rank 1's own traceback"
    assert [n.returncode for n in nodes] == [1, 1], "both launchers report the failed job"


@distributed
def test_serve_under_torchrun_listens_on_rank_0_and_stops_on_sigterm():
    import openai

    from nanoengine import SamplingParams

    name = f"torchrun-test-{os.getpid()}"  # marks this job's processes
    job = node(0, free_port(), "-m", "nanoengine", "serve", "tiny-qwen3", "--tensor-parallel-size", "2",
               "--served-model-name", name, "--dtype", "float32", "--port", "0", "--log-level", "warning",
               nproc=2, nnodes=1)
    try:
        line, deadline = "", time.monotonic() + 180
        while "/v1" not in line and time.monotonic() < deadline and job.poll() is None:
            ready, _, _ = select.select([job.stdout], [], [], 1)
            line = job.stdout.readline() if ready else ""
        url = re.search(r"(http://\S+/v1)", line)
        assert url, line
        client = openai.OpenAI(base_url=url.group(1), api_key="none", max_retries=0, timeout=60)
        got = client.completions.create(model=name, prompt="Once upon a time", max_tokens=8,
                                        temperature=0).choices[0].text
        with LLM("tiny-qwen3", dtype="float32") as one:
            want = one.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=8),
                                use_tqdm=False)[0].outputs[0].text
        assert got == want, "rank 0's server should give one process's greedy text"
        os.killpg(job.pid, signal.SIGTERM)  # the whole job, as a scheduler stops it
        out = finish(job, timeout=60)[0]
        # (torchrun itself exits 1 when signalled; the ranks are what must stop cleanly)
        assert "nanoengine serve: stopped" in out and "engine failed" not in out, out
        assert "did not stop the engine" not in out, "rank 1 should have been stopped by rank 0"
        deadline = time.monotonic() + 10
        while processes_running(name) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert processes_running(name) == [], "a rank outlived the job"
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


def test_the_launchers_variables_are_read_and_checked():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    got = launcher.launched(env)
    assert (got.rank, got.world_size, got.local_rank, got.local_world_size) == (1, 2, 0, 1)
    assert not got.agent_store and launcher.launched({}) is None
    assert launcher.launched({**env, "WORLD_SIZE": "1", "RANK": "0"}) is None
    with pytest.raises(InvalidValueError, match="MASTER_PORT is not"):
        launcher.launched({k: v for k, v in env.items() if k != "MASTER_PORT"})
    with pytest.raises(InvalidValueError, match=r"RANK=2 must be in 0\.\.WORLD_SIZE-1"):
        launcher.launched({**env, "RANK": "2"})


PARTIAL_SETS = [{"RANK": "1"}, {"RANK": "0", "MASTER_ADDR": "10.0.0.1"}, {"LOCAL_RANK": "0"},
                {"WORLD_SIZE": "2", "RANK": "1", "MASTER_PORT": "29500"}]


@pytest.mark.parametrize("partial", PARTIAL_SETS)
def test_a_partial_set_of_the_launchers_variables_is_refused_naming_what_is_set_and_missing(partial):
    """Not ignored (a run that would be one process where the user meant a rank of many): the error names
    what is set and what is missing."""
    with pytest.raises(InvalidValueError) as e:
        launcher.launched(partial)
    message = str(e.value)
    set_part, missing_part = message.split(" set but ")
    assert all(v in set_part for v in partial), message
    missing = [v for v in launcher.VARIABLES if v not in partial]
    assert all(v in missing_part.split(" not:")[0] for v in missing), message
    assert not any(v in missing_part.split(" not:")[0] for v in partial), message


def test_a_launcher_world_that_is_not_the_tp_size_is_refused(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(InvalidValueError, match="WORLD_SIZE=2, but tensor_parallel_size=1"):
        LLM("tiny-qwen3")


def test_a_second_engine_under_a_launcher_is_refused_clearly(monkeypatch):
    from nanoengine.distributed.launched_ranks import LauncherRanks

    for var, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(LauncherRanks, "joined", True)  # as after a first engine closed
    with pytest.raises(InvalidValueError, match="a job serves one tensor-parallel engine"):
        LLM("tiny-qwen3", tensor_parallel_size=2)
