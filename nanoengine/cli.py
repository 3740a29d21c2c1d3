"""Command line: `nanoengine assets|demo|generate|chat|serve|bench`. Chapters 00, 05 (serve) and 08."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from nanoengine import assets  # standard library only: keeps `nanoengine --help` fast
from nanoengine.flags import engine_flag
from nanoengine.serve.limits import ServerLimits  # a dataclass: no server imports

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "Give me a short tip for staying healthy.",
    "Write a haiku about the sea.",
    "Why do we need sleep?",
]


def cmd_assets(args: argparse.Namespace) -> int:
    if args.list:
        print(json.dumps(assets.describe(), indent=2))
        return 0
    for name in args.names or assets.DEFAULT_ASSETS:
        path = assets.ensure(name, force=args.force)
        print(f"{name}: {path}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from nanoengine import LLM, SamplingParams

    llm = LLM(args.model)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    convs = [[{"role": "user", "content": q}] for q in DEMO_QUESTIONS]
    outs = llm.chat(convs, params, use_tqdm=False)
    for q, out in zip(DEMO_QUESTIONS, outs):
        print(f"\n>>> {q}\n{out.outputs[0].text.strip()}")
    m = llm.last_run_stats
    if m:
        print(f"\n[{m['num_requests']} requests, {m['output_tokens']} tokens in {m['seconds']:.1f} s: "
              f"{m['output_tokens_per_s']:.0f} tok/s on {llm.plan.device}]")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from nanoengine import LLM, SamplingParams

    llm = LLM(args.model)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    if args.chat:
        for delta in llm.stream_chat([{"role": "user", "content": args.prompt}], params):
            print(delta, end="", flush=True)
    else:
        for delta in llm.stream(args.prompt, params):
            print(delta, end="", flush=True)
    print()
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.url is not None:  # drive a running `nanoengine serve` over HTTP
        if not args.online:
            raise ValueError("--url drives a running server with the online workload; add --online")
        from nanoengine.bench import online

        return online.main(args)
    if args.backlog and not args.host_only:
        raise ValueError("--backlog measures the host's work with the model stubbed; add --host-only")
    if args.host_only:
        from nanoengine.bench import host

        return host.main(args)
    if args.engine is not None:  # an engine of one's own, beside ours
        import json

        from nanoengine.bench import beside

        result = beside.bench_beside(args.engine, args.model or assets.DEFAULT_MODEL, args.workload,
                                     args.num_requests, seed=args.seed, out_dir=args.out_dir,
                                     quiet=args.quiet, engine_options=json.loads(args.engine_options or "{}"))
        print(beside.report(result))
        return 0
    from nanoengine.bench import run  # torch and the benchmark load only when they are needed

    args.model = args.model or assets.DEFAULT_MODEL
    return run.main(args)


def add_engine_options(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("model", "trace")) -> None:
    """One flag per EngineConfig field (--max-num-seqs, --dtype, --enable-prefix-caching/--no-..., ...), typed
    from its annotation; only the flags given reach the engine, so EngineConfig keeps the defaults and
    checks."""
    import dataclasses

    from nanoengine.config import EngineConfig

    group = parser.add_argument_group("engine options (EngineConfig; see nanoengine/config.py)")
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip:
            continue
        kinds = {k.strip() for k in str(f.type).split("|")}
        flag = engine_flag(f.name)
        if "bool" in kinds:
            group.add_argument(flag, dest=f"engine.{f.name}", action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS)
        else:
            kind = int if "int" in kinds else float if "float" in kinds else str
            group.add_argument(flag, dest=f"engine.{f.name}", type=kind, default=argparse.SUPPRESS,
                               metavar=kind.__name__.upper())


def engine_options(args: argparse.Namespace) -> dict:
    return {k.removeprefix("engine."): v for k, v in vars(args).items() if k.startswith("engine.")}


def server_limits(args: argparse.Namespace) -> ServerLimits:
    """The --max-* and --first-token-timeout flags (0: no limit) as ServerLimits."""
    return ServerLimits(**{f.name: getattr(args, f.name) or None for f in dataclasses.fields(ServerLimits)})


def cmd_serve(args: argparse.Namespace) -> int:
    from nanoengine.parsers import ParserOptions  # (no torch)

    parsers = ParserOptions(args.reasoning_parser, args.enable_auto_tool_choice, args.tool_call_parser)
    if args.data_parallel_size > 1 and parsers != ParserOptions():
        raise ValueError("--reasoning-parser and --tool-call-parser are not passed to data-parallel replicas "
                         "yet; serve with --data-parallel-size 1, or leave them out")
    if args.data_parallel_size > 1 and args.engine is not None:
        raise ValueError("--engine serves one engine of your own; leave out --data-parallel-size")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.data_parallel_size == 1 and (args.router is not None or args.router_max_in_flight is not None):
        raise ValueError("--router and --router-max-in-flight choose between replicas; add "
                         "--data-parallel-size 2 or more")
    if args.data_parallel_size > 1:
        from nanoengine.serve.data_parallel import serve_data_parallel

        return serve_data_parallel(args.model, args.host, args.port, size=args.data_parallel_size,
                                   policy=args.router, max_in_flight=args.router_max_in_flight,
                                   threads=args.threads, served_model_name=args.served_model_name,
                                   trace=args.trace, shutdown_grace_s=args.shutdown_grace,
                                   log_level=args.log_level, engine_options=engine_options(args),
                                   api_key=args.api_key, protect_metrics=args.protect_metrics,
                                   limits=server_limits(args))
    if args.threads is not None:
        import torch

        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    import logging

    from nanoengine.serve.server import serve

    code = serve(args.model, args.host, args.port, served_model_name=args.served_model_name, trace=args.trace,
                 shutdown_grace_s=args.shutdown_grace, log_level=args.log_level,
                 engine_options=engine_options(args), api_key=args.api_key,
                 protect_metrics=args.protect_metrics, limits=server_limits(args), parsers=parsers,
                 engine=args.engine)
    # Everything the server owns is closed by now (engine thread, workers, socket). The interpreter's own
    # teardown of torch and transformers can take seconds on a busy CPU, which a SIGTERM'd server should not.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


LIMIT_HELP = {
    "max_body_bytes": "the largest request body, in bytes (413 beyond it)",
    "max_n": "the most completions (n) one request may ask for (400 beyond it)",
    "max_prompt_tokens": "the longest prompt, in tokens (400 beyond it; default: max_model_len alone)",
    "max_queued_seqs": "the most sequences waiting to start, a request of n counting n (503 with Retry-After "
                       "beyond it)",
    "first_token_timeout_s": "seconds a request may wait for its first token; then it is aborted and its "
                             "client gets 503 with Retry-After",
    "max_unread_chunks": "stream chunks a client may leave unread before its request is aborted",
}


def add_limit_flags(s: argparse.ArgumentParser) -> None:
    defaults = ServerLimits()
    for f in dataclasses.fields(ServerLimits):
        default = getattr(defaults, f.name)
        s.add_argument(ServerLimits.flag(f.name), dest=f.name, type=float if f.name.endswith("_s") else int,
                       default=default, help=f"{LIMIT_HELP[f.name]} (default: {default}; 0: no limit)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nanoengine", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("assets", help="build the offline model assets (idempotent)")
    a.add_argument("names", nargs="*", help="asset names (default: all but the on-demand ones)")
    a.add_argument("--force", action="store_true", help="rebuild even if present")
    a.add_argument("--list", action="store_true", help="list assets and whether they are built")
    a.set_defaults(fn=cmd_assets)
    d = sub.add_parser("demo", help="answer a few questions with the default model")
    d.add_argument("--model", default=assets.DEFAULT_MODEL, help=assets.MODEL_HELP)
    d.add_argument("--max-tokens", type=int, default=64)
    d.set_defaults(fn=cmd_demo)
    for name, chat in (("generate", False), ("chat", True)):
        g = sub.add_parser(name, help=f"stream a {'chat answer' if chat else 'completion'} for one prompt")
        g.add_argument("prompt")
        g.add_argument("--model", default=assets.DEFAULT_MODEL, help=assets.MODEL_HELP)
        g.add_argument("--max-tokens", type=int, default=128)
        g.add_argument("--temperature", type=float, default=0.0)
        g.add_argument("--seed", type=int, default=None)
        g.set_defaults(fn=cmd_generate, chat=chat)
    s = sub.add_parser("serve",
                       help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
                       description="Serve a model over HTTP in OpenAI's API (FastAPI + uvicorn), on one "
                                   "continuously batched engine; point the openai client at "
                                   "http://HOST:PORT/v1.")
    s.add_argument("model", nargs="?", default=assets.DEFAULT_MODEL, help=assets.MODEL_HELP)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="0: a free port the OS picks (printed at start)")
    s.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: MODEL)")
    s.add_argument("--trace", action="store_true", help="record the step trace, served at GET /v1/trace")
    s.add_argument("--engine", default=None, metavar="MODULE:FACTORY",
                   help="serve an engine of your own: FACTORY(model) returns one that speaks the engine "
                        "protocol (nanoengine/engine/protocol.py); the module importable from here")
    s.add_argument("--api-key", default=os.environ.get("NANOENGINE_API_KEY") or None,
                   help="every /v1 request must send 'Authorization: Bearer KEY' (default: "
                        "$NANOENGINE_API_KEY; none: open to whoever reaches the port)")
    s.add_argument("--protect-metrics", action="store_true", help="/metrics needs the API key too")
    s.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split a chat's thinking into reasoning_content (qwen3, deepseek_r1: "
                        "<think>...</think>)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='read the tool calls of tool_choice "auto" chats (with --tool-call-parser)')
    s.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="how the model writes tool calls (hermes: <tool_call>{...}</tool_call>, Qwen3's)")
    add_limit_flags(s)
    s.add_argument("--shutdown-grace", type=float, default=2.0,
                   help="seconds in-flight requests may run on after SIGINT/SIGTERM before they are aborted")
    s.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's choice; with --data-parallel-size N: per replica, "
                        "default the CPU cores // N)")
    s.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="N engine replicas, one process each, behind this one address; a router picks the "
                        "replica of each request (serve/data_parallel.py)")
    s.add_argument("--router", choices=["cache_aware", "round_robin"], default=None,
                   help="with --data-parallel-size: cache_aware (default) sends a prompt to the replica that "
                        "last served its longest cached prefix; round_robin to each in turn")
    s.add_argument("--router-max-in-flight", type=int, default=None, metavar="N",
                   help="with --router cache_aware: requests in flight on a prefix's replica beyond which a "
                        "request goes to the least loaded replica instead (default: --max-num-seqs)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_options(s)
    s.set_defaults(fn=cmd_serve)
    b = sub.add_parser("bench", help="nanoengine vs its peers on one seeded workload (table, JSON, plot)",
                       description="Benchmark nanoengine against transformers generate (and vLLM / nano-vllm "
                                   "when installed, on a GPU) on one seeded workload; prints a table and "
                                   "writes a JSON result and a plot.")
    b.add_argument("--model", default=None, help=f"{assets.MODEL_HELP} (default: "
                   f"{assets.DEFAULT_MODEL}; with --host-only qwen3-0.6b-shape)")
    b.add_argument("--host-only", action="store_true",
                   help="the host's ms per decode step at batch 1/32/256 with the model stubbed, overlap "
                        "scheduling off and on, split by phase (nanoengine/bench/host.py)")
    b.add_argument("--steps", type=int, default=200, help="decode steps measured per batch (--host-only)")
    b.add_argument("--backlog", action="store_true",
                   help="with --host-only: ms per step of 64 decodes on a full KV pool with 0, 1,000 and "
                        "10,000 requests waiting, under each scheduling policy (at most 100 steps)")
    b.add_argument("--workload", default="cpu-small",
                   help="nano-vllm (nano-vllm's bench.py: 256 requests, lengths 100..1024) | cpu-small "
                        "(32 requests, 64..512) | shared-prefix (64 requests on one 1024-token prefix) | "
                        "single-stream (1 request, 256 + 256) | uniform-32 (32 requests, 256 + 256) | smoke")
    b.add_argument("--num-requests", type=int, default=None, help="take the first N requests of the workload")
    b.add_argument("--online", action="store_true",
                   help="Poisson arrivals at --request-rate (latency under load)")
    b.add_argument("--request-rate", type=float, default=None,
                   help="requests/s for --online (with --url, default inf: every request at once)")
    b.add_argument("--url", default=None,
                   help="with --online: drive a running `nanoengine serve` at this URL over HTTP (e.g. "
                        "http://127.0.0.1:8000) instead of an in-process engine")
    b.add_argument("--peers", default="hf,vllm,nano-vllm",
                   help="comma-separated peers to run after the engine (vllm and nano-vllm need a GPU)")
    b.add_argument("--no-peers", action="store_true", help="run nanoengine only")
    b.add_argument("--no-step-profile", action="store_true",
                   help="skip the single-stream decode profile (tok/s and where a step's time goes) on CPU")
    b.add_argument("--peer-batches", type=int, nargs="*", default=None,
                   help="transformers static batch sizes (default 8 32 on CPU, 64 256 on CUDA)")
    b.add_argument("--compare-prefix-caching", action="store_true",
                   help="run the engine again with enable_prefix_caching=False and report the ratio")
    b.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    b.add_argument("--engine-options", default=None, help='JSON, e.g. \'{"block_size": 32}\'')
    b.add_argument("--engine", default=None, metavar="MODULE:FACTORY",
                   help="measure an engine of your own (the engine protocol: nanoengine/engine/protocol.py; "
                        "FACTORY(model) returns it) beside nanoengine on --workload (default smoke here)")
    b.add_argument("--seed", type=int, default=0, help="workload and arrival seed (nano-vllm's is 0)")
    b.add_argument("--out-dir", default="bench_results", help="where the JSON result goes")
    b.add_argument("--figures-dir", default="figures", help="where the plot goes")
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    b.set_defaults(fn=cmd_bench)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except (FileNotFoundError, ValueError, TypeError, KeyError) as e:
        if os.environ.get("NANOENGINE_DEBUG"):
            raise
        print(f"nanoengine {args.cmd}: error: {e}", file=sys.stderr)
        print("(set NANOENGINE_DEBUG=1 for the full traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
