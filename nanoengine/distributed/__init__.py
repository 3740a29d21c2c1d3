"""Tensor parallelism's processes (chapter 07): `group.py` forms the process group, `ranks.py` holds the
other ranks as rank 0 sees them (its own local workers in `workers.py`, or a launcher's in
`launched_ranks.py`; Ctrl-C held for a call in `ctrl_c.py`), `channel.py` carries each call to
them (the messages, and tensors by value), `worker.py` is the loop they run, `launcher.py` reads what torchrun
told this process, `spawn.py` runs a function on fresh ranks (the exercises' tests), `executor.py` steps them
all in lockstep, `exits.py` says how a process ended."""
