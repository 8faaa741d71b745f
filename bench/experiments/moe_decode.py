"""MoE decode against a dense model of the same active parameters (issue "Models bigger than
one worker"): pure-decode tokens/s at 1 and 8 streams, one run, on this machine's CPU.

Both models have SmolLM2-135M's shape (hidden 576, 30 layers, 9 query and 3 KV heads, vocab
49,152) with random weights (no MoE checkpoint is reachable here; speed does not depend on
the values): a dense Qwen3 with an MLP of 1,536 units, and a Qwen3-MoE with 8 experts of 768
units, 2 chosen a token, so each token runs the same MLP width (the MoE holds 4x the MLP
weights). Each is loaded by pdserve from a Hugging Face directory, under `auto` (W4A8 on this
CPU: every expert matrix on the quantized kernels) and `exact`, and decodes 64 tokens after a
128-token prompt; repeats interleaved, medians. Writes bench/experiments/moe-decode-results.json.

    .venv/bin/python bench/experiments/moe_decode.py
"""
import json
import statistics
import tempfile
from pathlib import Path

import torch
import transformers

from pdserve.bench.engine import bench_pdserve_decode
from pdserve.bench.metrics import cpu_description
from pdserve.engine.config import EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.model.weights import load_model

HERE = Path(__file__).resolve().parent
SHAPE = dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
             head_dim=64, max_position_embeddings=2048, rope_theta=100000.0, tie_word_embeddings=True)
MODELS = {"dense": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=1536)),
          "moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=1536, moe_intermediate_size=768, num_experts=8, num_experts_per_tok=2,
                       norm_topk_prob=True, decoder_sparse_step=1))}


def write(kind: str, root: Path) -> Path:
    conf, cls, own = MODELS[kind]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(getattr(transformers, conf)(**SHAPE, **own))
    path = root / kind
    model.save_pretrained(path, safe_serialization=True)
    return path


def main() -> None:
    res: dict = {"cpu": cpu_description(), "results": {}}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {k: write(k, Path(tmp)) for k in MODELS}
        for quant in ("auto", "exact"):
            engines = {k: LLMEngine(load_model(p, quantization=quant), EngineConfig(quantization=quant))
                       for k, p in paths.items()}
            for streams in (1, 8):
                runs = {k: [] for k in engines}
                for rep in range(3):
                    for k, e in engines.items():
                        runs[k].append(bench_pdserve_decode(e, streams, 128, 64, seed=100 * rep + streams))
                row = {k: round(statistics.median(v), 1) for k, v in runs.items()}
                row["moe_vs_dense"] = round(row["moe"] / row["dense"], 2)
                res["results"][f"{quant}, {streams} stream(s), decode tok/s"] = row
                print(quant, streams, row, flush=True)
    (HERE / "moe-decode-results.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
