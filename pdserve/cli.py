"""The `pdserve` command: parses the command line, builds the config it describes, and hands
it to the code that runs it (the engine at a terminal, the cluster's processes in
`pdserve.deploy`, the benchmark lab in `pdserve.bench`). Generated text goes to stdout,
everything else to stderr."""
from __future__ import annotations

import argparse
import faulthandler
import io
import os
import signal
import sys

from pdserve import flags
from pdserve.engine.core.arg_utils import add_engine_args, add_sampling_args, engine_config, sampling_params
from pdserve.common.errors import PdserveError


def _generate(args) -> int:
    from pdserve.engine.core.engine import LLMEngine
    from pdserve.engine.core.interactive import generate

    generate(LLMEngine.from_config(engine_config(args)), args.prompt, sampling_params(args), chat=args.chat)
    return 0


def _chat(args) -> int:
    from pdserve.engine.core.engine import LLMEngine
    from pdserve.engine.core.interactive import chat

    chat(LLMEngine.from_config(engine_config(args)), sampling_params(args))
    return 0


def _up(args) -> int:
    from pdserve.deploy.up import run_up

    return run_up(flags.up_config(args), api=not args.no_router)


def _router(args) -> int:
    from pdserve.deploy.router_server import run_router

    return run_router(flags.router_config(args))


def _worker(args) -> int:
    from pdserve.deploy.worker_cmd import run_worker

    return run_worker(flags.worker_config(args))


def _scale(args) -> int:
    from pdserve.deploy.scale import ScaleError, request_scale

    sizes = {k: v for k, v in (("prefill", args.prefill), ("decode", args.decode)) if v is not None}
    if not sizes:
        raise ValueError("say what to scale: --prefill N and/or --decode M")
    try:
        print(request_scale(args.url, sizes, api_key=args.api_key, timeout_s=args.timeout))
    except ScaleError as e:
        print(f"pdserve scale: {e}", file=sys.stderr)
        return 1
    return 0


def _export_hf(args) -> int:
    from pdserve.engine.model.export import export_hf

    print(export_hf(args.model, args.out, args.dtype))
    return 0


# the benchmark lab's commands: (command, module of pdserve.bench, its function adding the flags, help)
BENCH_COMMANDS = (
    ("bench-transfer", "transfer", "add_bench_transfer_args", "KV hand-off GB/s: gRPC vs UCX vs a memory copy"),
    ("bench-cluster", "cluster", "add_bench_cluster_args",
     "disaggregated vs aggregated under a mixed workload; KV transfer GB/s"),
    ("bench", "serving", "add_bench_serving_args",
     "serving benchmark of any OpenAI endpoint: TTFT/ITL/TPOT, goodput, rate sweeps"),
    ("bench-peers", "peers", "add_bench_peers_args", "pdserve vs transformers (and llama.cpp/vLLM when installed), one run"),
    ("baseline-server", "baseline_server", "add_baseline_args",
     "the transformers baseline behind an OpenAI API (static batching)"),
    ("bench-engine", "engine", "add_bench_args", "engine throughput vs a transformers baseline; writes JSON"))


def _bench_commands(sub, chosen: str | None) -> None:
    """The benchmark lab's commands, each parsing its own flags (pdserve.bench). Only the
    `chosen` one imports its module (some import torch, ~2 s): the others are listed by name."""
    import importlib

    for name, module_name, add, help_ in BENCH_COMMANDS:
        p = sub.add_parser(name, help=help_)
        if name != chosen:
            continue
        module = importlib.import_module(f"pdserve.bench.{module_name}")
        getattr(module, add)(p)
        if module_name == "engine":
            add_engine_args(p)


def parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; `argv` (default sys.argv[1:]) names the command whose flags a
    benchmark command loads (`_bench_commands`)."""
    ap = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt (text only on stdout)")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap PROMPT as one user message in the chat template")
    c = sub.add_parser("chat", help="interactive chat with the model")
    u = sub.add_parser("up", help="start the cluster (Redis, Ray pools, router) behind an OpenAI endpoint")
    flags.add_up_args(u)
    r = sub.add_parser("router", help="run a router alone against a running cluster's registry")
    flags.add_router_cmd_args(r)
    w = sub.add_parser("worker", help="run one prefill or decode worker as a plain process (no Ray)")
    flags.add_worker_args(w)
    s = sub.add_parser("scale", help="resize the prefill/decode pools of a running `pdserve up`")
    flags.add_scale_args(s)
    for p, func in ((g, _generate), (c, _chat), (u, _up), (w, _worker)):
        add_engine_args(p)
        p.set_defaults(func=func)
    for p in (g, c):
        add_sampling_args(p)
    x = sub.add_parser("export-hf", help="write the model as a Hugging Face directory (safetensors, tokenizer, "
                       "chat template) for other servers")
    x.add_argument("--model", default="", help="GGUF file (default: the default model)")
    x.add_argument("--out", required=True, help="directory to write")
    x.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    x.set_defaults(func=_export_hf)
    r.set_defaults(func=_router)
    s.set_defaults(func=_scale)
    words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
    _bench_commands(sub, words[0] if words else None)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser(argv).parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:  # `kill -USR1 PID`: every thread's stack to stderr (what a stuck process waits on)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (AttributeError, ValueError, io.UnsupportedOperation):
        pass  # stderr is not a file: an in-process caller captures it
    try:
        return args.func(args)
    except (PdserveError, ValueError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM before serving; what was started is stopped
        print("pdserve: interrupted", file=sys.stderr)
        return 130
