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
    assert "not a local Hugging Face model folder" in err and "Traceback" not in err


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


def test_a_replica_command_line_gives_back_the_options_and_limits(monkeypatch):
    """What the data-parallel server passes its replicas (flags.engine_flags, ServerLimits.as_flags) parses
    back, by the CLI's own parser, to the same engine options and limits."""
    from nanoengine import cli
    from nanoengine.flags import engine_flags
    from nanoengine.serve.limits import ServerLimits

    got = {}
    monkeypatch.setattr(cli, "cmd_serve", lambda args: got.update(
        engine=cli.engine_options(args), limits=cli.server_limits(args)) or 0)
    options = {"max_num_seqs": 3, "enable_prefix_caching": False, "dtype": "float32",
               "gpu_memory_utilization": 0.5, "block_size": 32, "torch_compile": True}
    limits = ServerLimits(max_n=2, max_prompt_tokens=None, first_token_timeout_s=1.5)
    assert cli_main(["serve", "tiny-qwen3", *limits.as_flags(), *engine_flags(options)]) == 0
    assert got == {"engine": options, "limits": limits}


def test_router_flags_without_replicas_are_an_error(capsys):
    assert cli_main(["serve", "tiny-qwen3", "--router", "round_robin"]) == 2
    assert "--data-parallel-size 2 or more" in capsys.readouterr().err
