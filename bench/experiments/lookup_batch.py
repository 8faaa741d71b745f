"""Where prompt lookup pays: decode tokens/s of greedy requests with and without prompt-lookup
speculation (N=5, `--speculative-max-batch 0`: guesses checked at every batch size) at 1, 2, 4
and 8 streams, on code rewriting (long verbatim runs) and free text, the default weights
(`auto`). Decode tokens/s after the prompts' prefill; a fresh engine per run; 3 interleaved
repeats, medians; every lookup output must equal plain decoding's. The batch size where the
ratio falls under 1 is the break-even that `--speculative-max-batch` (default 4) encodes.
Writes bench/experiments/lookup-batch-results.json.

    . .venv/bin/activate && python bench/experiments/lookup_batch.py
"""
import json
import statistics
import subprocess
import sys
from pathlib import Path

from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tokenizer import Tokenizer
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.model.weights import load_model

sys.path.insert(0, str(Path(__file__).parent))
from draft_speculation import FREE, code_prompts, timed_decode  # noqa: E402  (the same tasks as the draft-model run)

STREAMS, REPEATS, K_LOOKUP, MAX_TOKENS = (1, 2, 4, 8), 3, 5, 64


def run(loaded, tok, k: int, prompts: list[list[int]]) -> dict:
    cfg = EngineConfig(cache=CacheConfig(kv_cache_memory=256 << 20), speculative_tokens=k, speculative_max_batch=0)
    return timed_decode(LLMEngine(loaded, cfg, tok), prompts,
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))


def main() -> None:
    loaded = load_model()
    tok = Tokenizer.from_model_path(loaded.path)
    tasks = {name: [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}])) for c in contents]
             for name, contents in (("code rewriting", code_prompts()), ("free text", FREE))}
    table: dict = {}
    for rep in range(REPEATS):
        for task, prompts in tasks.items():
            for n in STREAMS:
                for k in (0, K_LOOKUP):
                    r = run(loaded, tok, k, prompts[:n])
                    table.setdefault((task, n, k), []).append(r)
                    print(f"rep {rep} {task} x{n} N={k}: {r['tok_s']:.1f} tok/s ({r['accepted']}/{r['proposed']})",
                          flush=True)
    rows = {}
    for (task, n, k), rs in table.items():
        if not k:
            continue
        plain = table[(task, n, 0)]
        base = statistics.median(x["tok_s"] for x in plain)
        tps = statistics.median(x["tok_s"] for x in rs)
        rows[f"{task} | {n}"] = {"plain_tok_s": base, "lookup_tok_s": tps, "ratio": tps / base,
                                 "accepted": rs[-1]["accepted"], "proposed": rs[-1]["proposed"],
                                 "identical_to_plain": rs[0]["outs"] == plain[0]["outs"]}
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("\n")[:20]
    out = Path(__file__).with_name("lookup-batch-results.json")
    out.write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=1))
    print("| task | streams | plain tok/s | lookup tok/s | ratio | accepted / proposed | identical |")
    for key, r in rows.items():
        print(f"| {key} | {r['plain_tok_s']:.1f} | {r['lookup_tok_s']:.1f} | {r['ratio']:.2f}x | "
              f"{r['accepted']}/{r['proposed']} | {r['identical_to_plain']} |")


if __name__ == "__main__":
    main()
