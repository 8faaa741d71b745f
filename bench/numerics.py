"""What each numerics mode answers: quality beside the speed figures of the peer table.

`python -m pdserve.bench.numerics` loads the default model three ways: `none` (the fp32 model:
the checkpoint's Q4_1 weights dequantized, fp32 math, as transformers and vLLM run it), `exact`
(the same math, the C kernels reading the packed weights at small batches) and `auto` (the
default: Q4_1 weights x int8 activations, as llama.cpp computes), and `auto` with each other
KV-cache format (`--kv-cache-dtype` fp32, fp8, int8: what the cache keeps of each key and
value; `auto`'s default keeps bf16). For each it measures
- perplexity on the fixed text (bench/data/perplexity.txt, 512-token windows) through prefill
  batches, and on its first 1,024 tokens through the decode path too: a scheduler that takes
  one token per step runs every position as a decode row (the kernels a generated token sees);
- greedy agreement on 16 chat prompts x 48 tokens with the fp32 model, and with llama.cpp's
  own llama-server on the same GGUF and token ids where it is built (bench/llama_peer.py).
Writes bench/numerics-results.json with the CPU it ran on.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tokenizer import Tokenizer
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.model.weights import default_model_path, load_model
from pdserve.registry.embedded import free_port

from . import llama_peer
from .metrics import cpu_description
from .quality import PROMPTS, agreement, perplexity

HERE = Path(__file__).resolve().parent
# (row, --quantization, --kv-cache-dtype)
MODES = (("none", "none", "auto"), ("exact", "exact", "auto"), ("auto", "auto", "auto"),
         ("auto, KV fp32", "auto", "fp32"), ("auto, KV fp8", "auto", "fp8"), ("auto, KV int8", "auto", "int8"))
DECODE_PATH_TOKENS = 1024
GREEDY_TOKENS = 48


def engines(mode: str, kv_dtype: str, tok) -> tuple[LLMEngine, LLMEngine]:
    """The engine of numerics `mode` and KV-cache format `kv_dtype` as served, and one whose
    steps take one prompt token each."""
    loaded = load_model(quantization=mode)
    cache = CacheConfig(kv_cache_memory=128 << 20, kv_cache_dtype=kv_dtype)
    served = LLMEngine(loaded, EngineConfig(quantization=mode, cache=cache), tok)
    one_row = LLMEngine(loaded, EngineConfig(quantization=mode, cache=cache,
                                             scheduler=SchedulerConfig(long_prefill_token_threshold=1)), tok)
    return served, one_row


def llama_cpp_greedy(prompts: list[list[int]]) -> list[list[int]] | None:
    """llama-server's greedy continuations of the token ids, or None where it is not built."""
    import httpx

    port = free_port()
    cmd = llama_peer.command(port, default_model_path(), 2)
    if cmd is None:
        return None
    cmd[cmd.index("--parallel") + 1] = "1"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        out = []
        for ids in prompts:
            r = httpx.post(url + "/completion", timeout=900, json={  # llama.cpp spins: slow beside other work
                "prompt": ids, "n_predict": GREEDY_TOKENS, "temperature": 0, "top_k": 1, "cache_prompt": False,
                "return_tokens": True})
            r.raise_for_status()
            out.append(r.json()["tokens"])
        return out
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog="Rows: " + "; ".join(m[0] for m in MODES)).parse_args()
    tok = Tokenizer.from_model_path(default_model_path())
    text = tok.encode((HERE / "data" / "perplexity.txt").read_text())
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0)
    res: dict = {"cpu": cpu_description(), "text_tokens": len(text), "decode_path_tokens": DECODE_PATH_TOKENS,
                 "modes": {}}
    outs = {}
    peer = llama_cpp_greedy(prompts)
    for mode, quantization, kv_dtype in MODES:
        served, one_row = engines(quantization, kv_dtype, tok)
        head = text[:DECODE_PATH_TOKENS]
        r = {"perplexity_prefill": perplexity(served, text),
             "perplexity_prefill_head": perplexity(served, head),
             "perplexity_decode_head": perplexity(one_row, head)}
        outs[mode] = served.generate(prompts, greedy)
        r["greedy_vs_fp32"] = agreement(outs["none"], outs[mode])
        if peer is not None:
            r["greedy_vs_llama_cpp"] = agreement(peer, outs[mode])
        for e in (served, one_row):
            assert e.blocks.num_used_blocks == 0, "KV blocks leaked"
        res["modes"][mode] = r
        print(f"{mode:13s} perplexity {r['perplexity_prefill']:.3f} (prefill, {len(text)} tokens) | first "
              f"{DECODE_PATH_TOKENS}: prefill {r['perplexity_prefill_head']:.3f}, decode path "
              f"{r['perplexity_decode_head']:.3f} | greedy = fp32 {r['greedy_vs_fp32']['identical']:.0%}"
              + (f", = llama.cpp {r['greedy_vs_llama_cpp']['identical']:.0%}" if peer is not None else ""), flush=True)
    if peer is None:
        res["llama_cpp"] = "not built (make llama-cpp)"
    (HERE / "numerics-results.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
