"""EngineConfig options as command-line flags and back: one field's flag name (`--max-num-seqs`, a bool's
`--enable-prefix-caching` / `--no-enable-prefix-caching`), and the command line that gives a set of options
(the data-parallel server passes the user's options on to its replicas). Standard library only, for
`nanoengine --help`'s speed. Chapter 00."""

from __future__ import annotations

from typing import Any


def engine_flag(name: str, value: bool = True) -> str:
    """An EngineConfig field's flag (--max-num-seqs; a bool's False: --no-enable-prefix-caching)."""
    return ("--" if value else "--no-") + name.replace("_", "-")


def engine_flags(options: dict[str, Any]) -> list[str]:
    """The command line that gives these engine options (cli.add_engine_options' flags, the other way)."""
    argv: list[str] = []
    for name, value in options.items():
        argv += [engine_flag(name, value)] if isinstance(value, bool) else [engine_flag(name), str(value)]
    return argv
