"""Speculative decoding with a draft model, measured against plain decoding and prompt lookup in
one run: SmolLM2 as the target in fp32 (`--quantization none`) and in the default weights
(`auto`: Q4_1 with int8 activations), its own int8 copy as the draft (`--speculative-model self`),
on code rewriting and free text, 1 and 8 streams, greedy (outputs must equal plain decoding's)
and sampled (temperature 0.8, seeded). Decode tokens/s after the prompts' prefill (which
speculation does not change). Each run is a fresh engine (no prefix cache across runs);
3 interleaved repeats, medians. Also: what the draft's KV of an imported 1k-token prompt costs,
copied from the target's (the default for a "self" draft) or computed by the draft, and the
acceptance each gives. Writes bench/experiments/draft-speculation-results.json.

    . .venv/bin/activate && python bench/experiments/draft_speculation.py
"""
import json
import statistics
import subprocess
import time
from pathlib import Path

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tokenizer import Tokenizer
from pdserve.engine.model.weights import load_model

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS, REPEATS, K_DRAFT, K_LOOKUP = 64, 3, 4, 5
CACHE = CacheConfig(kv_cache_memory=256 << 20)


def code_prompts() -> list[str]:
    files = ["engine/sampling/speculative.py", "common/block_hash.py", "engine/model/tiny.py", "engine/core/request.py",
             "common/aio.py", "common/threads.py", "engine/model/export.py", "common/detokenizer.py"]
    return [f"Here is a Python file:\n{(ROOT / f).read_text()[:1200]}\nRewrite it exactly as it is, without changes."
            for f in files]


FREE = ["Write a short poem about autumn leaves.", "Explain why the sky is blue to a child.",
        "Give three tips for a job interview.", "Describe a busy market in the morning.",
        "What makes a good cup of coffee?", "Tell a short story about a lost cat.",
        "Why do people keep diaries?", "Describe the sound of rain on a roof."]


def run(loaded, tok, draft, mode: str, prompts: list[list[int]], params: SamplingParams) -> dict:
    k = {"plain": 0, "lookup": K_LOOKUP, "draft": K_DRAFT}[mode]
    cfg = EngineConfig(quantization=QUANT, cache=CACHE, speculative_tokens=k,
                       speculative_model="self" if mode == "draft" else "")
    return timed_decode(LLMEngine(loaded, cfg, tok, draft=draft if mode == "draft" else None), prompts, params)


def timed_decode(e: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Decode tokens/s of `prompts` on a fresh engine `e` after their prefill, their outputs,
    and the speculator's accepted / proposed guesses."""
    e.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))  # warm
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        e.add_request(f"r{i}", p, params)
        outs[f"r{i}"] = []
    while not all(outs.values()):  # the prompts' prefill (and first tokens): not what speculation changes
        for o in e.step():
            outs[o.request_id].extend(o.new_token_ids)
    first, t = sum(map(len, outs.values())), time.perf_counter()
    while e.has_unfinished_requests():
        for o in e.step():
            outs[o.request_id].extend(o.new_token_ids)
    dt = time.perf_counter() - t
    spec = e.speculator
    return {"tok_s": (sum(map(len, outs.values())) - first) / dt, "outs": [outs[f"r{i}"] for i in range(len(prompts))],
            "accepted": spec.accepted if spec else 0, "proposed": spec.proposed if spec else 0}


def draft_kv_cost(loaded, tok, draft) -> dict:
    """An imported ~1k-token prompt on a decode engine: the draft's KV copied from the target's
    or computed by the draft, time of the first speculative step and acceptance over 64 tokens."""
    text = "\n".join(code_prompts())[:4000]
    prompt = tok.encode(text)[:1000]
    res = {}
    for seeded in (True, False):
        plain = LLMEngine(loaded, EngineConfig(quantization=QUANT, cache=CACHE), tok)
        plain.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0), hold_kv=True)
        first = None
        while plain.has_unfinished_requests():
            for o in plain.step():
                first = o.new_token_ids[0]
        _, kv = plain.export_kv("p")
        plain.release_kv("p")
        cfg = EngineConfig(quantization=QUANT, cache=CACHE, speculative_tokens=K_DRAFT, speculative_model="self",
                           scheduler=plain.config.scheduler)
        e = LLMEngine(loaded, cfg, tok, draft=draft)
        e.speculator.seed_from_target = seeded
        e.add_remote_request("p", prompt, SamplingParams(max_tokens=64, temperature=0))
        e.import_kv("p", kv, first)
        steps = []
        while e.has_unfinished_requests():
            t = time.perf_counter()
            e.step()
            steps.append(time.perf_counter() - t)
        res["seeded" if seeded else "draft_prefill"] = {
            "prompt_tokens": len(prompt), "until_first_proposal_s": sum(steps[:-(-len(prompt) // 512) or 1]),
            "median_step_s": statistics.median(steps), "accepted": e.speculator.accepted,
            "proposed": e.speculator.proposed, "kv_bytes_per_token": e.kv_cache.bytes_per_block // 16}
    return res


def main() -> None:
    global QUANT
    results = {"cpu": subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("\n")[:20], "rows": {}}
    for QUANT in ("none", "auto"):
        loaded = load_model(quantization=QUANT)
        tok = Tokenizer.from_model_path(loaded.path)
        draft = load_model(quantization="int8")
        tasks = {name: [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}])) for c in contents]
                 for name, contents in (("code rewriting", code_prompts()), ("free text", FREE))}
        cases = [(task, n, temp) for task in tasks for n in (1, 8) for temp in (0.0, 0.8)]
        table: dict = {}
        for rep in range(REPEATS):
            for task, n, temp in cases:
                params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temp, seed=7 if temp else None,
                                        ignore_eos=False)
                modes = ("plain", "lookup", "draft") if temp == 0 else ("plain", "draft")
                for mode in modes:
                    r = run(loaded, tok, draft, mode, tasks[task][:n], params)
                    table.setdefault((task, n, temp, mode), []).append(r)
                    print(f"[{QUANT}] rep {rep} {task} x{n} T={temp} {mode}: {r['tok_s']:.1f} tok/s "
                          f"({r['accepted']}/{r['proposed']})", flush=True)
        for (task, n, temp, mode), rs in table.items():
            base = statistics.median(x["tok_s"] for x in table[(task, n, temp, "plain")])
            tps = statistics.median(x["tok_s"] for x in rs)
            results["rows"][f"{QUANT} | {task} | {n} | {temp} | {mode}"] = {
                "tok_s": tps, "vs_plain": tps / base, "accepted": rs[-1]["accepted"], "proposed": rs[-1]["proposed"],
                "identical_to_plain": (rs[0]["outs"] == table[(task, n, temp, "plain")][0]["outs"]) if temp == 0
                else None,
                "reproducible": all(x["outs"] == rs[0]["outs"] for x in rs)}
        results[f"draft_kv_{QUANT}"] = draft_kv_cost(loaded, tok, draft)
        print(json.dumps(results[f"draft_kv_{QUANT}"], indent=1), flush=True)
    out = Path(__file__).with_name("draft-speculation-results.json")
    out.write_text(json.dumps(results, indent=1))
    for key, r in results["rows"].items():
        acc = f"{r['accepted']}/{r['proposed']}" if r["proposed"] else "-"
        print(f"| {key} | {r['tok_s']:.1f} | {r['vs_plain']:.2f}x | {acc} | {r['identical_to_plain']} | "
              f"{r['reproducible']} |")


if __name__ == "__main__":
    main()
