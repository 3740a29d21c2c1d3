"""A tensor-parallel worker as its own program: `python -m nanoengine.distributed.worker FD`. Chapter 07.

Rank 0 (`workers.py`) starts ranks 1..N-1 with this command, not with multiprocessing's spawn, so the
user's script is never imported again in a worker: a script that builds a tensor-parallel `LLM` at top level,
without `if __name__ == "__main__":`, works as vLLM users write it. FD is this process's end of a socket pair
with rank 0; the first message on it is (rank 0's sys.path, plan, rank, port, threads), then the calls of
`worker_main`. With rank 0's sys.path, a function `collective_rpc` sends by name is importable here as it is
there (its module, not the script: a function defined in the script itself is refused by rank 0).
"""

from __future__ import annotations

import pickle
import sys
from multiprocessing.connection import Connection


def main(argv: list[str]) -> None:
    conn = Connection(int(argv[1]))
    try:
        path, data = pickle.loads(conn.recv_bytes())
    except EOFError:
        return  # rank 0 went away before sending anything
    sys.path[:0] = [p for p in path if p not in sys.path]
    plan, rank, port, threads = pickle.loads(data)  # (after the path: the plan may name the learner's files)
    from nanoengine.distributed.workers import worker_main

    worker_main(plan, rank, port, conn, threads)


if __name__ == "__main__":
    main(sys.argv)
