"""LoRA adapters against transformers + peft on a small random Llama: greedy tokens and their
logprobs equal, for an adapter alone and for rows of two adapters and of the base in one step
(prefill and decode rows, on the torch path and on the C kernels; the C one-call decode step
is tested on SmolLM2 in test_lora_smollm.py); prefix-cache hits within an adapter and never
across adapters or with the base; speculation (prompt lookup checks its guesses under the
adapter; a draft model without it is not used for the request)."""
import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.model.weights import load_model
from tests.conftest import assert_engine_clean
from tests.helpers.lora import make_adapter, run_jobs, save_small_llama, two_adapters

pytest.importorskip("peft")

PROMPTS = [[5, 17, 99, 250, 3, 42, 42, 7], [300, 12, 8], list(range(20, 60))]
N = 10
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)  # no logprobs: speculation runs
LOGPROB_TOL = 2e-4  # fp32 throughout; the kernels sum in another order than torch's matmul


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The base directory, two adapters (all seven projections at rank 8; q, v and down at rank 4
    with rsLoRA) and transformers' greedy tokens and logprobs for each prompt: {name: [...]}"""
    root = tmp_path_factory.mktemp("lora")
    base = save_small_llama(root / "base")
    want, _, _ = two_adapters(base, root, PROMPTS, N)
    return root, want


def lora_engine(root, attention="torch", max_loras=2, **kw) -> LLMEngine:
    return LLMEngine(load_model(root / "base", quantization="none"), EngineConfig(
        quantization="none", attention=attention, cache=CacheConfig(kv_cache_memory=16 << 20),
        lora=LoRAConfig(max_loras=max_loras, modules=(("ad1", str(root / "ad1")), ("ad2", str(root / "ad2")))),
        **kw))


@pytest.fixture(scope="module", params=["torch", "native"])
def engine(request, ref):
    return lora_engine(ref[0], request.param)


@pytest.fixture
def eng(engine):
    """The module's engine, checked after each test: no request left, every block back."""
    yield engine
    assert_engine_clean(engine)
    assert engine.loras.in_use == 0


def run(eng, jobs: list[tuple[str, list[int], str | None]], params=None):
    """Add every (id, prompt, adapter) job, step to the end; {id: (tokens, logprobs)}, and the
    adapters (None: the base) that shared each step."""
    return run_jobs(eng, jobs, params or SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=0))


def assert_matches(got, want, what):
    tokens, logprobs = got
    assert tokens == want[0], f"{what}: tokens {tokens} != transformers+peft {want[0]}"
    diff = max(abs(a - b) for a, b in zip(logprobs, want[1]))
    assert diff < LOGPROB_TOL, f"{what}: logprobs differ by {diff:.2e}"


@pytest.mark.parametrize("lora", ["ad1", "ad2", None])
def test_alone_equal_to_peft(eng, ref, lora):
    for i, prompt in enumerate(PROMPTS):
        got, _ = run(eng, [("r", prompt, lora)])
        assert_matches(got["r"], ref[1][lora][i], f"{lora} prompt {i}")


def test_two_adapters_and_the_base_batched_in_one_step(eng, ref):
    jobs = [(f"{lora}-{i}", p, lora) for i, p in enumerate(PROMPTS) for lora in ("ad1", "ad2", None)]
    got, mixes = run(eng, jobs)
    for rid, _, lora in jobs:
        assert_matches(got[rid], ref[1][lora][int(rid[-1])], rid)
    assert {"ad1", "ad2", None} in mixes


def test_prefill_rows_beside_decode_rows_of_other_adapters(ref):
    """A long prompt of one adapter arrives, in chunks, while the others decode."""
    eng = lora_engine(ref[0], scheduler=SchedulerConfig(max_num_batched_tokens=16))
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=0)
    eng.add_request("a", PROMPTS[0], params, lora="ad1")
    eng.add_request("b", PROMPTS[1], params)
    out = {"a": ([], []), "b": ([], []), "c": ([], [])}
    steps = 0
    while eng.has_unfinished_requests():
        if steps == 2:
            eng.add_request("c", PROMPTS[2], params, lora="ad2")  # 40 tokens: three chunks
        steps += 1
        for o in eng.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(lp.logprob for lp in o.logprobs)
    for rid, lora, i in (("a", "ad1", 0), ("b", None, 1), ("c", "ad2", 2)):
        assert_matches(out[rid], ref[1][lora][i], rid)
    assert_engine_clean(eng)


def test_prefix_cache_hits_within_an_adapter_never_across(eng, ref):
    prompt = list(range(100, 150))  # three full blocks of 16
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def cached(rid, lora):
        eng.add_request(rid, prompt, params, lora=lora)
        n = None
        while eng.has_unfinished_requests():
            for o in eng.step():
                n = o.num_cached_tokens if n is None else n
        return n

    first = {lora: cached(f"first-{lora}", lora) for lora in ("ad1", "ad2", None)}
    assert first == {"ad1": 0, "ad2": 0, None: 0}, "a prompt computed under one adapter hit another's blocks"
    assert {lora: cached(f"again-{lora}", lora) for lora in ("ad1", "ad2", None)} == {"ad1": 48, "ad2": 48, None: 48}


def test_a_reloaded_adapter_hits_only_its_own_weights(ref, tmp_path):
    """Reloading the same files keeps the identity (its cached blocks match); other weights
    under the same name never match the old blocks."""
    root = ref[0]
    eng = lora_engine(root)
    prompt, params = list(range(100, 150)), SamplingParams(max_tokens=1, temperature=0.0)

    def cached(rid):
        eng.add_request(rid, prompt, params, lora="ad1")
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step()
        return outs[0].num_cached_tokens

    assert cached("a") == 0
    identity = eng.loras.get("ad1").identity
    eng.load_lora("ad1", str(root / "ad1"))
    assert eng.loras.get("ad1").identity == identity and cached("b") == 48
    make_adapter(root / "base", tmp_path / "other", seed=7)
    eng.load_lora("ad1", str(tmp_path / "other"))
    assert eng.loras.get("ad1").identity != identity and cached("c") == 0
    assert_engine_clean(eng)


@pytest.mark.parametrize("spec", [dict(speculative_tokens=3, speculative_max_batch=0),  # 3 requests: guesses at any batch
                                  dict(speculative_tokens=3, speculative_max_batch=0, speculative_model="self",
                                       speculative_quantization="none")])
def test_speculation_keeps_adapter_output(ref, spec):
    """Prompt lookup guesses for an adapter's request and checks them under the adapter; a
    draft model (here the base's own copy) is not used for it: no draft sequence is made."""
    eng = lora_engine(ref[0], **spec)
    repeat = [7, 8, 9, 10] * 6  # prompt lookup finds guesses in a repeating prompt
    want = reference_for(ref, eng, repeat)
    got, _ = run(eng, [("a", repeat, "ad1"), ("b", repeat, None), ("c", PROMPTS[0], "ad2")], GREEDY)
    assert got["a"][0] == want["ad1"] and got["b"][0] == want[None]
    assert got["c"][0] == ref[1]["ad2"][0][0]
    if spec.get("speculative_model"):
        assert "a" not in eng.speculator._seqs and "c" not in eng.speculator._seqs
    assert eng.speculator.proposed > 0
    assert_engine_clean(eng)


def reference_for(ref, eng, prompt) -> dict:
    """Greedy tokens for `prompt` under ad1 and the base, from an engine without speculation."""
    plain = lora_engine(ref[0])
    got, _ = run(plain, [("a", prompt, "ad1"), ("b", prompt, None)], GREEDY)
    assert_engine_clean(plain)
    return {"ad1": got["a"][0], None: got["b"][0]}
