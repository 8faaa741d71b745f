"""A LoRA adapter on the real default model (SmolLM2-135M), made with peft on its Hugging Face
export: greedy tokens and logprobs equal to transformers + peft, alone and batched with the
base; on the default kernels ("auto": W4A8, the C decode step) steps with an adapter row run
the Python path and base-only steps still run the C decode step, with the same tokens
batched as alone."""
import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig, LoRAConfig
from pdserve.engine.core.engine import LLMEngine
from tests.conftest import assert_engine_clean
from tests.helpers.lora import make_adapter, reference

pytestmark = pytest.mark.slow
pytest.importorskip("peft")

N = 12
LOGPROB_TOL = 2e-3  # test_reference.py's logits agree within 5e-4 on these kernels; a logprob sums two such errors


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """(adapter directory, the peft model) on the exported default model: rank 8 on every
    projection, small random weights (the model stays fluent, its output changes)."""
    from pdserve.engine.model.export import export_hf

    root = tmp_path_factory.mktemp("smollm-lora")
    export_hf("", root / "hf")
    pm = make_adapter(root / "hf", root / "ad", seed=3, scale=0.5)
    return root / "ad", pm


def generate(eng, jobs, params):
    for rid, prompt, lora in jobs:
        eng.add_request(rid, prompt, params, lora=lora)
    out = {rid: ([], []) for rid, _, _ in jobs}
    while eng.has_unfinished_requests():
        for o in eng.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(lp.logprob for lp in o.logprobs)
    return out


def test_equal_to_transformers_and_peft_alone_and_batched(adapter, smollm):
    from pdserve.engine.model.weights import load_model

    path, pm = adapter
    tok = smollm[1]
    eng = LLMEngine(load_model(quantization="exact"), EngineConfig(
        quantization="exact", cache=CacheConfig(kv_cache_memory=32 << 20),
        lora=LoRAConfig(max_loras=1, modules=(("ad", str(path)),))), tok)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a haiku about the ocean."}]))
    want = reference(pm, prompt, N)
    with pm.disable_adapter():
        base = reference(pm, prompt, N)
    assert want[0] != base[0], "the adapter must change the output to be tested"
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=0)
    got = generate(eng, [("alone", prompt, "ad")], params) | generate(eng, [("ad", prompt, "ad"),
                                                                            ("base", prompt, None)], params)
    for rid, expect in (("alone", want), ("ad", want), ("base", base)):
        assert got[rid][0] == expect[0], rid
        diff = max(abs(a - b) for a, b in zip(got[rid][1], expect[1]))
        assert diff < LOGPROB_TOL, f"{rid}: logprobs differ by {diff:.2e}"
    assert_engine_clean(eng)


def test_the_c_decode_step_only_without_adapter_rows(adapter, smollm, monkeypatch):
    from pdserve.engine.kernels import native
    from pdserve.engine.kernels.native import step, w4a8

    if not native.available() or not w4a8.available():
        pytest.skip("the native step needs the native build with AVX2")
    loaded, tok = smollm
    eng = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=32 << 20),
                                         lora=LoRAConfig(max_loras=1, modules=(("ad", str(adapter[0])),))), tok)
    assert eng.runner.model.native_decode is not None
    calls, steps = [], []
    real_run, real_batch = step.run, eng.runner._lora_batch
    monkeypatch.setattr(step, "run", lambda *a, **k: calls.append(1) or real_run(*a, **k))
    eng.runner._lora_batch = lambda ordered: steps.append((len(calls), real_batch(ordered))) or steps[-1][1]
    prompt = tok.encode("The capital of France is")
    short, long = (SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (4, 10))
    eng.add_request("a", prompt, short, lora="ad")
    eng.add_request("b", prompt, long)
    batched = {"a": [], "b": []}
    while eng.has_unfinished_requests():
        for o in eng.step():
            batched[o.request_id] += o.new_token_ids
    steps.append((len(calls), None))
    ran_c = [after > before for (before, _), (after, _) in zip(steps, steps[1:])]
    had_lora = [lora is not None for _, lora in steps[:-1]]
    assert not any(c and lo for c, lo in zip(ran_c, had_lora)), "a step with an adapter row ran the C decode step"
    assert any(ran_c), "the base's decode steps after the adapter's request finished should run the C step"
    del eng.runner._lora_batch
    alone = generate(eng, [("a", prompt, "ad")], short) | generate(eng, [("b", prompt, None)], long)
    assert batched == {rid: tokens for rid, (tokens, _) in alone.items()}
    assert_engine_clean(eng)
