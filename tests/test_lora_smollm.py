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


def test_the_c_decode_step_runs_adapter_rows_with_the_python_paths_bits(adapter, smollm, monkeypatch):
    """Decode steps with adapter rows run in the one C call (the LoRA updates by the C routine the
    Python path calls too): logprobs bitwise those of the Python path, tokens batched as alone."""
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
    monkeypatch.setattr(step, "run", lambda *a, **k: calls.append(k.get("lora", a[9] if len(a) > 9 else None))
                        or real_run(*a, **k))
    eng.runner._lora_batch = lambda ordered: steps.append(real_batch(ordered)) or steps[-1]
    prompt = tok.encode("The capital of France is")
    short, long = (SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0) for n in (4, 10))
    batched = generate(eng, [("a", prompt, "ad"), ("b", prompt, None)], short) | generate(
        eng, [("c", prompt, None)], long)
    assert any(c is not None for c in calls), "no decode step with an adapter row ran the C step"
    assert any(c is None for c in calls), "the base-only steps should run the C step too"
    del eng.runner._lora_batch
    alone = generate(eng, [("a", prompt, "ad")], short) | generate(eng, [("b", prompt, None)], short)
    assert {k: batched[k] for k in ("a", "b")} == alone  # tokens and logprobs, bitwise
    saved, eng.runner.model.native_decode = eng.runner.model.native_decode, None  # the Python path
    try:
        python_path = generate(eng, [("a", prompt, "ad"), ("b", prompt, None)], short)
    finally:
        eng.runner.model.native_decode = saved
    assert python_path == {k: batched[k] for k in ("a", "b")}
    assert_engine_clean(eng)


def test_both_c_step_schedules_give_adapter_rows_the_same_bits(adapter, smollm):
    """One OpenMP team (up to 4 rows), the rows split between the threads (from a balanced start,
    or from one thread's part, rows changing hands), or a region per op:
    the same tokens and logprobs for a batch of adapter and base rows (the LoRA routine splits
    columns or rows, never a sum)."""
    from pdserve.engine.kernels import native
    from pdserve.engine.kernels.native import w4a8

    if not native.available() or not w4a8.available():
        pytest.skip("the native step needs the native build with AVX2")
    loaded, tok = smollm
    eng = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=32 << 20),
                                         lora=LoRAConfig(max_loras=1, modules=(("ad", str(adapter[0])),))), tok)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0)
    jobs = [(f"r{i}", tok.encode(f"Question {i}: what is the capital of France?"), "ad" if i % 2 else None)
            for i in range(4)]  # 4 rows: one team at team_rows 4, split (2 a thread) without it
    w = eng.runner.model.native_decode
    team = generate(eng, jobs, params)
    w.team_rows = 0  # every step's rows split between the threads
    try:
        split = generate(eng, jobs, params)
        w.split_rows = 3  # split, every row starting on the first thread: the others take adapter rows over
        taken = generate(eng, jobs, params)
        w.split_rows = 0  # every step on a region per op
        per_op = generate(eng, jobs, params)
    finally:
        w.team_rows, w.split_rows = 4, 2
    assert team == split == taken == per_op
    assert_engine_clean(eng)
