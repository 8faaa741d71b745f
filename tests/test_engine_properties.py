"""Property test of the whole engine (tiny model, real kernels): under any interleaving of
add / abort / step, with a KV cache small enough to force preemption, every request that is
not aborted produces exactly the tokens it produces alone (greedy and seeded sampling), and
afterwards no block is leaked or double-freed and no request is left."""
from functools import lru_cache

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.errors import InvalidRequestError
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.model.tiny import tiny_llama

BLOCK = 4


@lru_cache(maxsize=1)
def model():
    return tiny_llama(0)


def engine(kv_bytes: int, max_seqs: int, budget: int) -> LLMEngine:
    return LLMEngine(model(), EngineConfig(cache=CacheConfig(block_size=BLOCK, kv_cache_memory=kv_bytes),
                                           scheduler=SchedulerConfig(max_num_seqs=max_seqs,
                                                                     max_num_batched_tokens=budget)))


def params(max_tokens: int, seed: int | None) -> SamplingParams:
    if seed is None:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=40, seed=seed, ignore_eos=True)


@lru_cache(maxsize=None)
def alone(prompt: tuple[int, ...], max_tokens: int, seed: int | None) -> list[int]:
    return reference().generate([list(prompt)], params(max_tokens, seed))[0]


@lru_cache(maxsize=1)
def reference() -> LLMEngine:
    return engine(8 << 20, 64, 512)


prompt_st = st.lists(st.integers(3, 511), min_size=1, max_size=24)
add = st.tuples(st.just("add"), st.integers(0, 2), prompt_st, st.integers(1, 16), st.none() | st.integers(0, 3))
ops = st.lists(st.one_of(add, add, add,  # adds outnumber steps: the cache fills and requests get preempted
                         st.tuples(st.just("abort"), st.integers(0, 40)),
                         st.tuples(st.just("step"), st.integers(1, 3))), min_size=8, max_size=40)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.integers(8, 20), st.integers(1, 6), st.integers(4, 32))
def test_outputs_identical_under_random_interleavings(seq, num_blocks, max_seqs, budget):
    probe = engine(1 << 20, 1, 8)
    eng = engine(num_blocks * (1 << 20) // probe.blocks.num_blocks, max_seqs, budget)  # about num_blocks blocks
    shared = [11, 12, 13, 14, 15, 16, 17, 18]  # a common prefix: prefix-cache hits mid-interleaving
    got: dict[str, list[int]] = {}
    spec: dict[str, tuple] = {}
    aborted: set[str] = set()

    def run(steps: int):
        for _ in range(steps):
            for out in eng.step():
                got[out.request_id] = got.get(out.request_id, []) + list(out.new_token_ids)

    for op in seq:
        if op[0] == "add":
            _, prefix, prompt, max_tokens, seed = op
            prompt = tuple(shared[:prefix * 4] + prompt)
            rid = f"r{len(spec)}"
            try:
                eng.add_request(rid, list(prompt), params(max_tokens, seed))
            except InvalidRequestError:
                continue  # can never fit this cache: refused up front, nothing held
            spec[rid] = (prompt, max_tokens, seed)
        elif op[0] == "abort" and spec:
            rid = f"r{op[1] % len(spec)}"
            if eng.abort(rid):
                aborted.add(rid)
        else:
            run(op[1])
        eng.blocks.check_invariants()
    for _ in range(10_000):
        if not eng.has_unfinished_requests():
            break
        run(1)
    assert not eng.has_unfinished_requests(), "requests never finished (livelock)"
    assert eng.blocks.num_used_blocks == 0, "KV blocks leaked"
    eng.blocks.check_invariants()
    for rid, (prompt, max_tokens, seed) in spec.items():
        if rid not in aborted:
            assert got.get(rid) == alone(prompt, max_tokens, seed), rid
