"""The command line: bad input is a one-line error on stderr and exit status 2, never a traceback.
(`nanoengine bench` end to end is in test_bench.py.)"""

from __future__ import annotations

import pytest

from nanoengine.cli import main as cli_main


def run_cli(*args: str) -> int:
    return cli_main(["bench", "--model", "tiny-qwen3", "--quiet", "--threads", "1", *args])


def test_cli_reports_bad_input_without_a_traceback(capsys):
    from nanoengine.cli import main

    assert main(["generate", "hi", "--model", "/no/such/model"]) == 2
    err = capsys.readouterr().err
    assert "neither an asset name" in err and "Traceback" not in err


@pytest.mark.parametrize("args, match", [
    (["--workload", "gpu-512"], "unknown workload"),
    (["--num-requests", "0"], "num-requests"),
    (["--online", "--request-rate", "0"], "request-rate"),
    (["--peers", "hf,tgi"], "unknown peer"),
])
def test_cli_bad_input_is_one_line(args, match, capsys):
    assert run_cli(*args) == 2
    err = capsys.readouterr().err
    assert match in err.splitlines()[0]
