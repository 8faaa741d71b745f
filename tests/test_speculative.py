"""Prompt-lookup speculative decoding: greedy output is identical with and without it (tiny
model under batching, preemption and prefix caching; the real model on a copying task, where
most guesses are accepted), other requests are untouched, every block comes back."""
import pytest

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.sampling.speculative import accepted, propose
from pdserve.engine.model.tiny import tiny_llama


def test_propose_takes_the_latest_longest_match():
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], k=2) == [7, 5]  # latest "1 2 3" wins
    assert propose([4, 5, 6, 4, 5], k=3) == [6, 4, 5]                    # "4 5" -> what followed it
    assert propose([1, 2, 3], k=4) == []                                 # nothing recurs
    assert propose([8, 8], k=4, max_ngram=3) == [8]                      # down to a 1-gram
    assert accepted([5, 6, 7], [5, 6, 9, 1]) == 2 and accepted([1], [2, 2]) == 0


def engine(loaded, spec: int, kv_bytes: int = 4 << 20, max_seqs: int = 64, tokenizer=None,
           kv: str = "auto", max_batch: int = 0) -> LLMEngine:
    cache = CacheConfig(kv_cache_memory=kv_bytes, kv_cache_dtype=kv)
    return LLMEngine(loaded, EngineConfig(speculative_tokens=spec, cache=cache, speculative_max_batch=max_batch,
                                          scheduler=SchedulerConfig(max_num_seqs=max_seqs)), tokenizer)


def clean(e: LLMEngine) -> bool:
    return e.blocks.num_used_blocks == 0 and not e.has_unfinished_requests()


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("kv_bytes", [4 << 20, 40 * 8192], ids=["roomy", "preempting"])
def test_tiny_model_greedy_identical(kv_bytes, kv):
    loaded = tiny_llama(0)
    pattern = [17, 42, 99, 7, 300, 12]
    prompts = [pattern * 4 + [i + 3] for i in range(4)] + [[5, 6, 7, 8, 9] * 3]
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True) for _ in prompts]
    params.append(SamplingParams(max_tokens=20, temperature=0.9, seed=3, ignore_eos=True))  # not speculated
    prompts.append(pattern * 2)
    want = engine(loaded, 0, kv=kv).generate(prompts, params)
    # the same number of blocks in every format: the preempting case must preempt
    blocks = engine(loaded, 0, kv_bytes).kv_cache.num_blocks
    spec = engine(loaded, 4, blocks * engine(loaded, 0, kv=kv).kv_cache.bytes_per_block, kv=kv)
    assert spec.kv_cache.num_blocks == blocks
    got = spec.generate(prompts, params)
    assert got == want
    assert spec.speculator.proposed > 0 and spec.speculator.accepted > 0
    again = spec.generate(prompts[:2], params[:2])  # prefix cache hits with speculation
    assert again == want[:2] and clean(spec)
    spec.blocks.check_invariants()


def test_speculation_stays_off_in_steps_decoding_more_than_its_batch():
    """Beyond --speculative-max-batch decoding requests a step checks no guesses (same output);
    a lone request is speculated."""
    loaded = tiny_llama(0)
    pattern = [17, 42, 99, 7, 300, 12]
    prompts = [pattern * 4 + [i + 3] for i in range(3)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = engine(loaded, 0).generate(prompts, params)
    spec = engine(loaded, 4, max_batch=2)
    assert spec.generate(prompts, params) == want and spec.speculator.proposed == 0
    assert spec.generate(prompts[:1], params) == want[:1] and spec.speculator.proposed > 0
    assert clean(spec)
    with pytest.raises(ValueError, match="speculative_max_batch"):
        EngineConfig(speculative_max_batch=-1)


@pytest.mark.slow
def test_real_model_copying_task(smollm):
    loaded, tok = smollm
    code = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content":
                        f"Repeat this code exactly, then stop:\n{code}"}]))
    params = SamplingParams(max_tokens=40, temperature=0)
    want = engine(loaded, 0, 64 << 20, tokenizer=tok).generate([prompt], params)
    spec = engine(loaded, 5, 64 << 20, tokenizer=tok)
    assert spec.generate([prompt], params) == want
    assert spec.speculator.accepted >= 10  # copying: steps that emit several tokens
    assert clean(spec)
