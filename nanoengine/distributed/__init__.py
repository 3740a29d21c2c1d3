"""Tensor parallelism (chapter 07): `group.py` is the process group as the layers see it (rank, size, the
collectives), `workers.py` the worker processes rank 0 starts, steps and watches."""
