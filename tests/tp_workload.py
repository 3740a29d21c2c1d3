"""The prompts the tensor-parallel tests run (test_tp.py, and torchrun_job.py for test_torchrun.py): a shared
prefix that hits the prefix cache on a second round, a long prompt that chunks, short ones."""

import os

from nanoengine import SamplingParams

SHARED = "The paged KV cache stores keys and values in fixed-size blocks, so that " * 2
PROMPTS = [SHARED + "prompt one", "Hi", SHARED + "and prompt two is a little longer than one", "x " * 70,
           SHARED + "three", "Once upon a time, in a land far away,"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
TORCHRUN_OPTIONS = dict(dtype="float32", trace=True, num_kvcache_blocks=14, block_size=16,
                        max_num_batched_tokens=32)  # chunked prefill and a preemption in one run


def child_pids() -> list[int]:
    """Live (not zombie) children of this process, except multiprocessing's resource tracker (one per
    process that ever spawned, shared by all; it ends with its parent)."""
    me, kids = os.getpid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            cmdline = open(f"/proc/{pid}/cmdline").read()
        except OSError:
            continue
        if int(stat[1]) == me and stat[0] != "Z" and "resource_tracker" not in cmdline:
            kids.append(int(pid))
    return kids
