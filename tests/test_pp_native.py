"""The one-call C decode step on a pipeline's stages (engine/model/llama.py, native_step.py):
SmolLM2 in the product's numerics (`auto`, W4A8) over 2 stages gives the single engine's greedy
tokens and logprobs bitwise, batched, with decode steps that ran as one C call over the stage's
layers (rank 0's counted here), and every block back."""
import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.model import native_step
from pdserve.engine.model.weights import load_model
from pdserve.engine.parallel.tp import ModelSource
from tests.helpers.engine_runs import run
from tests.helpers.prompts import prompts

CONFIG = EngineConfig(cache=CacheConfig(kv_cache_memory=128 << 20), num_threads=1)


def test_a_two_stage_pipeline_decodes_in_one_c_call_a_stage_and_answers_as_one_engine(monkeypatch):
    ps = prompts(12, seed=5, lo=20, hi=90)
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=1)
    single = LLMEngine(load_model(), CONFIG)
    if single.runner.model.native_decode is None:
        pytest.skip(f"the native step cannot run here: {native_step.why_not(single.runner.model)}")
    want = run(single, ps, params)
    calls = []
    one_call = native_step.forward
    monkeypatch.setattr(native_step, "forward", lambda *a, **k: calls.append(k.get("h") is not None) or one_call(*a, **k))
    pipe = LLMEngine.tensor_parallel(ModelSource(), CONFIG, 2, pipeline=True)
    try:
        assert run(pipe, ps, params) == want
        # 24 tokens of 12 requests: at least the decode steps after the last prompt ran as one call
        assert len(calls) >= 20 and all(calls), calls
        assert pipe.blocks.num_free_blocks == pipe.blocks.num_blocks
        assert single.blocks.num_free_blocks == single.blocks.num_blocks
    finally:
        pipe.shutdown()
    assert all(p.poll() is not None for p in pipe.tp.procs)
