"""`python -m pdserve.bench.lora` end to end at a tiny size: the adapters it writes load (PEFT's
format without peft), every mix decodes, and the results name the CPU and the ratios."""
from __future__ import annotations

import json

import pytest

from pdserve.bench import lora


@pytest.mark.slow
def test_the_adapter_benchmark_runs_and_saves_its_figures(tmp_path):
    out = tmp_path / "lora.json"
    lora.main(["--batch", "3", "--prompt-len", "8", "--tokens", "3", "--mixes", "0,1,2", "--repeats", "1",
               "--rank", "8", "--output", str(out)])
    res = json.loads(out.read_text())
    assert res["cpu"]["model"] and res["quantization"] == "auto"
    assert set(res["decode_tok_s_p50"]) == {"0", "1", "2"} and all(v > 0 for v in res["decode_tok_s_p50"].values())
    assert res["vs_base"]["0"] == 1.0
    assert set(res["load_seconds"]) == {"8", "64"} and all(v["seconds_p50"] > 0 for v in res["load_seconds"].values())
