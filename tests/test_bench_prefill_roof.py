"""`python -m pdserve.bench.prefill_roof` end to end at a small size: the peaks and the prefill
are measured and saved with the CPU, the prefill's multiply-adds are counted from the model's
shape, and the fraction of the peak is a real one (in (0, 1]: 96 tokens are far from it)."""
from __future__ import annotations

import json

import pytest

from pdserve.bench import prefill_roof
from pdserve.engine.config import ModelConfig
from pdserve.engine.kernels import native
from pdserve.engine.kernels.native import w4a8

pytestmark = pytest.mark.skipif(not native.available() or not w4a8.available(),
                                reason="the peak kernels need the native build with AVX2")


def test_the_prefill_roof_benchmark_runs_and_saves_its_figures(tmp_path):
    out = tmp_path / "roof.json"
    prefill_roof.main(["--prompt-len", "96", "--repeats", "1", "--output", str(out)])
    res = json.loads(out.read_text())
    assert res["cpu"]["family"] and res["numerics"] == "auto" and res["prompt_len"] == 96
    assert res["peak"]["int8_gmacs"] > 0 and res["peak"]["fp32_gfmas"] > 0
    assert 0 < res["fraction_of_int8_peak"] <= 1 and len(res["prefill_s"]) == 1
    assert 0 < res["attention_share_of_macs"] < 0.1  # 96 tokens: the matrices are nearly all of it


def test_the_multiply_adds_of_a_prefill_follow_the_model_shape():
    cfg = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    macs = prefill_roof.prefill_macs(cfg, 3)
    # per token and layer: qkv 8 x (2 + 2) x 4, o 8 x 8, gate, up, down 3 x 8 x 16
    assert macs["matmul"] == 2 * 3 * (8 * 16 + 64 + 384)
    assert macs["attention"] == 2 * 2 * 4 * 2 * (1 + 2 + 3) and macs["lm_head"] == 80

