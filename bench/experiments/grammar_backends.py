"""Which grammar engine computes token masks faster on this CPU: llguidance or xgrammar?

For each JSON schema, both engines compile the grammar for the default model's tokenizer,
then walk a valid answer token by token: compute the next-token bitmask, accept the token.
Prints compile time and mask time per token (median and p99) and writes JSON.

    pip install llguidance xgrammar transformers   # xgrammar needs transformers for its tokenizer info
    python bench/experiments/grammar_backends.py
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

SCHEMAS = {
    "person": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                                 "tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["name", "age", "tags"]},
               {"name": "Ada Lovelace", "age": 36, "tags": ["mathematician", "writer", "analyst"]}),
    "order": ({"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
            "price": {"type": "number", "minimum": 0}}, "required": ["sku", "qty", "price"]}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]}},
        "required": ["id", "status", "items", "address"]},
        {"id": "ABC-1234", "status": "shipped", "items": [{"sku": "pen-blue", "qty": 3, "price": 1.25},
                                                           {"sku": "notebook", "qty": 1, "price": 4.5}],
         "address": {"city": "Lisbon", "zip": "1100-148"}}),
}


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench_llguidance(tok, vocab, schema, tokens):
    import llguidance
    import torch

    t = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok._tok.to_str(), n_vocab=vocab, eos_token=tok.eos_token_id)
    tok_s = time.perf_counter() - t
    t = time.perf_counter()
    m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema))
    assert not m.is_error(), m.get_error()
    compile_s = time.perf_counter() - t
    mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    times = []
    for tid in tokens:
        t = time.perf_counter()
        m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        times.append(time.perf_counter() - t)
        assert (int(mask[tid // 32]) >> (tid % 32)) & 1, "valid token masked out"
        assert m.consume_token(tid)
    return tok_s, compile_s, times


def bench_xgrammar(tok, vocab, schema, tokens):
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok._tok), vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info)
    tok_s = time.perf_counter() - t
    t = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
    compile_s = time.perf_counter() - t
    mask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for tid in tokens:
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - t)
        assert (int(mask[0, tid // 32]) >> (tid % 32)) & 1, "valid token masked out"
        assert matcher.accept_token(tid)
    return tok_s, compile_s, times


def main() -> None:
    from pdserve.common.tokenizer import Tokenizer
    from pdserve.engine.model.weights import default_model_path

    tok = Tokenizer.from_model_path(default_model_path())
    vocab = 49152  # the model's embedding rows
    results = {}
    for name, (schema, answer) in SCHEMAS.items():
        tokens = tok.encode(json.dumps(answer), add_special_tokens=False)
        for backend, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
            best = None
            for _ in range(3):  # medians over repeats: this machine is shared
                tok_s, compile_s, times = fn(tok, vocab, schema, tokens)
                if best is None or statistics.median(times) < statistics.median(best[2]):
                    best = (tok_s, compile_s, times)
            tok_s, compile_s, times = best
            r = {"tokenizer_setup_ms": tok_s * 1e3, "compile_ms": compile_s * 1e3, "tokens": len(tokens),
                 "mask_us_p50": statistics.median(times) * 1e6, "mask_us_p99": percentile(times, 0.99) * 1e6,
                 "mask_us_mean": statistics.fmean(times) * 1e6}
            results[f"{name}/{backend}"] = r
            print(f"{name:7s} {backend:10s} tokenizer {r['tokenizer_setup_ms']:7.1f} ms  compile "
                  f"{r['compile_ms']:6.1f} ms  mask per token p50 {r['mask_us_p50']:7.1f} us  p99 "
                  f"{r['mask_us_p99']:8.1f} us  ({len(tokens)} tokens)")
    out = Path(__file__).with_name("grammar-results.json")
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
