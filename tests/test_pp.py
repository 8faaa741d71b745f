"""Pipeline parallelism (engine/parallel/pp.py): a degree above the layers is refused with the ones
that fit, and so is a split of the layers that does not fit; the default split gives stage 0
fewer layers by its LM head's work; each stage holds its layers; engines over 2 stages (5
layers, the default split: 2 and 3) and 3 (2, 2 and 1, given) give the single engine's greedy
tokens and logprobs exactly, batched and chunked, with every block back (a mixture-of-experts
model too); KV moves between pipelines and single engines token-exactly, and a step's layer
streams are the exported KV; rank 0 holds a bounded number of posted sends however long it
serves; through the workers each stage hands off its own layers; a stage
killed mid-stream makes the next step raise RankFailed, the other stages go down and the blocks
come back."""
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.config import PoolConfig
from pdserve.engine.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.kv.cache import bytes_per_block
from pdserve.engine.model.tiny import tiny_config, tiny_state_dict
from pdserve.engine.model.weights import LoadedModel, build_model
from pdserve.engine.parallel.group import SENT_KEPT
from pdserve.engine.parallel.pp import PPKVCache, check_stages, head_weight, layers_of, split_layers, stage_state
from pdserve.engine.parallel.tp import ModelSource
from tests.helpers.engine_runs import GREEDY, clean, handoff, kill_rank_mid_stream, run
from tests.helpers.prompts import prompts
from tests.test_pp_handoff import through_workers

LAYERS = (("num_hidden_layers", 5),)
CONFIG = EngineConfig(quantization="exact", num_threads=1, cache=CacheConfig(kv_cache_memory=4 << 20),
                      scheduler=SchedulerConfig(max_num_batched_tokens=64))


def single() -> LLMEngine:
    cfg = tiny_config(**dict(LAYERS))
    model = build_model(cfg, tiny_state_dict(cfg, 0), quantization="exact")
    return LLMEngine(LoadedModel(model, cfg, Path("<tiny>"), "tiny-0"), CONFIG)


@pytest.fixture(scope="module")
def pipelines():
    """PP=2 and PP=3 engines of the 5-layer tiny model, shared by the tests that leave them clean."""
    configs = {2: CONFIG, 3: replace(CONFIG, pipeline_layers=(2, 2, 1))}  # stage 0 the fewest layers, the most
    made = {pp: LLMEngine.tensor_parallel(ModelSource(tiny_seed=0, tiny_overrides=LAYERS), configs[pp], pp,
                                          pipeline=True) for pp in (2, 3)}
    yield made
    for e in made.values():
        e.shutdown()
        assert all(p.poll() is not None for p in e.tp.procs)


def test_a_degree_above_the_layers_is_refused_with_the_ones_that_fit():
    """And what this slice does not run: PP with expert parallelism, LoRA adapters (PP x TP:
    tests/test_pp_tp.py)."""
    check_stages(tiny_config(num_hidden_layers=3), 3)
    with pytest.raises(ValueError, match=r"pipeline-parallel degree 4: this model has 3 layers: use 1 to 3"):
        check_stages(tiny_config(num_hidden_layers=3), 4)
    with pytest.raises(ValueError, match=r"degree 4: this model has 3 layers"):  # before any rank starts
        LLMEngine.tensor_parallel(ModelSource(tiny_seed=0, tiny_overrides=(("num_hidden_layers", 3),)), CONFIG, 4,
                                  pipeline=True)
    assert EngineConfig(pipeline_parallel_size=2, expert_parallel_size=2).expert_parallel_size == 2  # PP x EP
    with pytest.raises(ValueError, match=r"LoRA adapters on a pipeline-parallel group are not supported yet"):
        LLMEngine.tensor_parallel(ModelSource(tiny_seed=0, tiny_overrides=LAYERS),
                                  EngineConfig(lora=LoRAConfig(max_loras=1)), 2, pipeline=True)


def test_the_default_split_weighs_stage_0_s_extra_work_and_a_split_that_does_not_fit_is_refused():
    """SmolLM2's shapes (30 layers, a 49,152-token LM head): 15 and 15 layers over 2 stages (its
    head, sampling and scheduling weighed at ~0.8 layers' work beyond the last stage's own); a split given is taken as it is; a split
    whose counts are not one a stage, each >= 1, summing to the layers is refused naming one
    that fits, before any rank starts, and so are counts below 1 in the config and the flags."""
    smol = tiny_config(num_hidden_layers=30, vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    assert 0.7 < head_weight(smol) < 0.9
    assert [split_layers(smol, pp) for pp in (1, 2, 3)] == [(30,), (15, 15), (9, 11, 10)]
    cfg = tiny_config(**dict(LAYERS))
    assert split_layers(cfg, 2) == (2, 3) and split_layers(cfg, 3) == (2, 2, 1) and split_layers(cfg, 5) == (1,) * 5
    assert split_layers(cfg, 2, (4, 1)) == (4, 1) and layers_of(cfg, 2, 1, (4, 1)) == range(4, 5)
    check_stages(cfg, 2, (4, 1))
    for bad in ((3, 3), (5, 0), (1, 2, 2)):
        with pytest.raises(ValueError, match=r"this model's 5 layers over 2 stages need 2 counts of at least 1 "
                                             r"\(stage 0 first\) that sum to 5, e.g. 2,3"):
            check_stages(cfg, 2, bad)
    with pytest.raises(ValueError, match=r"pipeline layers 3,3: this model's 5 layers"):  # before any rank starts
        LLMEngine.tensor_parallel(ModelSource(tiny_seed=0, tiny_overrides=LAYERS),
                                  replace(CONFIG, pipeline_layers=(3, 3)), 2, pipeline=True)
    with pytest.raises(ValueError, match=r"each of pipeline_layers \(\[0, 5\]\) must be >= 1"):
        replace(CONFIG, pipeline_layers=(0, 5))
    assert EngineConfig(pipeline_layers=[2, 3]).pipeline_layers == (2, 3)  # as a rank reads it back from JSON
    assert PoolConfig(pp=2, pp_layers=[2, 3]).pp_layers == (2, 3)
    with pytest.raises(ValueError, match=r"pp_layers 2,3 gives 2 stages but its pp is 3: give one layer count a stage"):
        PoolConfig(pp=3, pp_layers=(2, 3))
    with pytest.raises(ValueError, match=r"each of pp_layers must be >= 1, got 0"):
        PoolConfig(pp_layers=(0, 5))


def test_every_stage_s_cache_holds_as_many_blocks_as_the_deepest_stage_s_memory_holds():
    """A block id names the same block on every stage: rank 0 with fewer layers than stage 1
    takes as many blocks as stage 1 does, not the more its memory would hold."""
    from types import SimpleNamespace
    cfg = tiny_config(**dict(LAYERS))
    caches = [PPKVCache(cfg, CONFIG, SimpleNamespace(rank=r, world=2)) for r in (0, 1)]
    assert [c.kv.shape[0] for c in caches] == [2, 3]
    per = bytes_per_block(replace(cfg, num_hidden_layers=3), 16, caches[0].format)
    assert caches[0].num_blocks == caches[1].num_blocks == CONFIG.cache.kv_cache_memory // per
    with pytest.raises(ValueError, match=r"kv_cache_memory=4096 bytes holds no block: one block of 16 tokens "
                                         r"needs \d+ bytes on this model's largest stage"):
        PPKVCache(cfg, replace(CONFIG, cache=CacheConfig(kv_cache_memory=4096)), SimpleNamespace(rank=0, world=2))


def test_the_flags_give_each_pool_its_split():
    from pdserve.cli import parser
    from pdserve.flags import up_config
    c = up_config(parser().parse_args(["up", "--decode-pp", "2", "--decode-pp-layers", "12,18"]))
    engine = c.worker("decode", "d").engine
    assert engine.pipeline_layers == (12, 18) and engine.pipeline_parallel_size == 2
    assert c.worker("prefill", "p").engine.pipeline_layers == ()
    with pytest.raises(SystemExit):  # argparse: invalid layer_counts value: '12,x'
        parser().parse_args(["up", "--decode-pp-layers", "12,x"])


def test_each_stage_holds_its_layers_renumbered():
    cfg = tiny_config(**dict(LAYERS))
    assert [layers_of(cfg, 3, r, (2, 2, 1)) for r in range(3)] == [range(0, 2), range(2, 4), range(4, 5)]
    state = tiny_state_dict(cfg, 0)
    part = stage_state(state, range(2, 4))
    assert torch.equal(part["model.layers.0.mlp.up_proj.weight"], state["model.layers.2.mlp.up_proj.weight"])
    assert torch.equal(part["model.layers.1.self_attn.q_proj.weight"], state["model.layers.3.self_attn.q_proj.weight"])
    assert not any(k.startswith(("model.layers.2.", "model.layers.4.")) for k in part)
    assert torch.equal(part["model.embed_tokens.weight"], state["model.embed_tokens.weight"])  # kept on every stage


@pytest.mark.parametrize("pp", [2, 3])
def test_greedy_tokens_and_logprobs_equal_one_engine_batched_and_chunked(pipelines, pp):
    ps = prompts(5, seed=11, lo=5, hi=100)  # 100 tokens over a 64-token budget: chunked prefill
    want, want_lp = run(single(), ps)
    e = pipelines[pp]
    sends = e.runner.model.pp.sends
    got, got_lp = run(e, ps)
    assert got == want and got_lp == want_lp  # the same sums in the same order: exactly
    assert len(e.runner.model.model.layers) == 2  # PP=2: 2 of 5 (fewer than stage 1), PP=3: 2, 2, 1
    assert e.kv_cache.kv.shape[0] == len(e.runner.model.model.layers) and e.kv_cache.layout[0] == 5
    # as many blocks on every stage: what kv_cache_memory holds on a stage of 3 layers (PP=2) or 2 (PP=3)
    most = replace(e.model_config, num_hidden_layers=3 if pp == 2 else 2)
    assert e.kv_cache.num_blocks == CONFIG.cache.kv_cache_memory // bytes_per_block(most, 16, e.kv_cache.format)
    assert e.runner.model.pp.sends > sends  # rank 0 sent its activations on
    clean(e)


def test_the_torch_layers_path_over_three_stages():
    """Without the C kernels (attention "torch"): the plain layers and final norm, staged."""
    config = EngineConfig(**{**CONFIG.__dict__, "attention": "torch"})
    cfg = tiny_config(**dict(LAYERS))
    ref = LLMEngine(LoadedModel(build_model(cfg, tiny_state_dict(cfg, 0), quantization="exact"), cfg, Path("<tiny>"),
                                "tiny-0"), config)
    ps = prompts(2, seed=3, lo=5, hi=80)
    want = run(ref, ps)
    e = LLMEngine.tensor_parallel(ModelSource(tiny_seed=0, tiny_overrides=LAYERS), config, 3, pipeline=True)
    try:
        assert not e.runner.model.native_ops and run(e, ps) == want
        clean(e)
    finally:
        e.shutdown()


def test_a_mixture_of_experts_model_over_three_stages(tmp_path):
    """Qwen2-MoE of 3 layers, the middle one dense (mlp_only_layers): each stage builds its
    layer as the whole model does (by its index in the whole model); tokens and logprobs exact."""
    pytest.importorskip("transformers")
    from pdserve.engine.model.weights import load_model
    from tests.test_moe import hf_model

    hf_model("qwen2_moe", num_hidden_layers=3, mlp_only_layers=[1]).save_pretrained(tmp_path)
    ps = [[t % 317 + 3 for t in p] for p in prompts(3, seed=21, lo=5, hi=90)]
    want = run(LLMEngine(load_model(str(tmp_path), quantization="exact"), CONFIG), ps)
    e = LLMEngine.tensor_parallel(ModelSource(str(tmp_path)), CONFIG, 3, pipeline=True)
    try:
        assert type(e.runner.model.model.layers[0].mlp).__name__ == "SparseMoeBlock"
        assert run(e, ps) == want
        clean(e)
    finally:
        e.shutdown()


def five_layers_streamed(streamed: list, kv) -> None:
    """A step's layer streams of the 5-layer model are layers [0, 2), [2, 4), [4, 5) of the
    prompt's blocks: together, the export."""
    assert [(a, b) for a, b, _ in streamed] == [(0, 2), (2, 4), (4, 5)]
    assert torch.equal(torch.cat([kv for _, _, kv in streamed]), kv)


def test_kv_moves_between_pipelines_and_single_engines(pipelines):
    ps = prompts(3, seed=12, lo=20, hi=70)
    one = single()
    want = one.generate(ps, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    two, three = pipelines[2], pipelines[3]
    assert two.kv_cache.layout == one.kv_cache.layout == three.kv_cache.layout  # the whole model's layers
    assert handoff(two, one, ps) == want  # prefill over 2 stages -> decode on 1
    assert handoff(one, three, ps) == want  # 1 -> 3
    assert handoff(three, two, ps, [], five_layers_streamed) == want  # 3 -> 2, its KV streamed as the step ends
    for e in (two, one, three):
        clean(e)


def test_kv_hands_off_by_parts_between_pipelines_and_one_engine(pipelines):
    """Through a prefill and a decode worker (gRPC): P(PP=2) -> D(PP=1), P(PP=1) -> D(PP=2),
    and pipelines of other splits (P(PP=3) -> D(PP=2) and back: each prefill stage sends each
    decode stage the layers both hold); a prompt whose prefix the decode side caches gets the
    KV of the rest alone. Each prefill rank pushes its own layers, no rank
    gathers, a decode pipeline's rank 0 receives its own alone; greedy tokens the single
    engine's, every block back (tests/test_pp_handoff.py's checks)."""
    ps = prompts(2, seed=15, lo=20, hi=70)
    ps.append(ps[0][:40] + ps[1][:9])  # its first 2 blocks cached on the decode side: the KV from the third on
    one = single()
    want = one.generate(ps, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    two, three = pipelines[2], pipelines[3]
    assert through_workers(two, one, ps) == want
    assert through_workers(one, two, ps) == want
    assert through_workers(one, two, ps, layer_group=2) == want  # each group of 2 layers cut by the stages
    assert through_workers(three, two, ps) == want
    assert through_workers(two, three, ps, layer_group=2) == want  # a pipeline ships by parts, streaming or not


def test_a_rank_s_failed_push_fails_the_hand_off_and_the_decode_worker_computes_the_prompt(pipelines,
                                                                                          monkeypatch):
    """P(PP=2) -> D(PP=3): rank 0's own push refused (its stage 1's goes through): the prefill
    answers UNAVAILABLE once every rank answered, the decode worker drops its ranks' leases and
    computes the prompt itself (the recompute policy); tokens the single engine's, every block back."""
    import asyncio

    from pdserve.common.errors import KVTransferError
    from pdserve.kv_transfer import stages
    from tests.helpers.workers import Cluster

    def refuse(*a, **k):
        raise KVTransferError("refused for the test")
    monkeypatch.setattr(stages, "ship_part", refuse)  # rank 0's: the other ranks import their own copy
    p = prompts(1, seed=17, lo=40, hi=40)[0]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = single().generate([p], params)[0]
    engines = iter((pipelines[2], pipelines[3]))

    async def go():
        async with Cluster(lambda **_: next(engines)) as c:
            return (await c.generate("failed-push", p, params))[0], c.decode.counters(), c.prefill.transfer_failures
    toks, counts, failures = asyncio.run(go())
    assert toks == want and failures == 1
    assert counts["transfer_failures"] == 1 and counts["local_prefills"] == 1 and counts["remote_prefills"] == 0
    for e in pipelines.values():
        clean(e)


def test_a_stage_killed_mid_stream_raises_rank_failed_and_frees_the_blocks():
    e = LLMEngine.tensor_parallel(ModelSource(tiny_seed=0, tiny_overrides=LAYERS), CONFIG, 3, pipeline=True)
    try:
        # stage 1: rank 0 sends to it, stage 2 waits on it (and is taken down at once)
        kill_rank_mid_stream(e, prompts(1, seed=13, lo=30, hi=30)[0], 0)
    finally:
        e.shutdown()


@pytest.mark.parametrize("pp", [2, 3])
def test_micro_batches_in_flight_keep_tokens_and_logprobs_exact(pipelines, pp):
    """Many streams, batched and chunked: the pipe holds `pp` micro-batches at once (each its
    own scheduler step), and every token and logprob is the single engine's; a request aborted
    while its micro-batch is in the pipe is dropped when it lands, a KV export lands the pipe
    first (its outputs come with the next step), and every block comes back."""
    ps = prompts(12, seed=31, lo=5, hi=90)
    want, want_lp = run(single(), ps)
    e = pipelines[pp]
    mb = e.micro_batches
    launched, sends = mb.launched, e.runner.model.pp.sends
    mb.most = 0
    got, got_lp = run(e, ps)
    assert got == want and got_lp == want_lp
    assert mb.most == pp and mb.launched - launched >= 16  # the pipe was full, many times over
    # rank 0's posted sends (3 a micro-batch a stage) are held to a bound, not one more a send
    # for as long as the pipeline serves (their buffers held and each send scanning them all)
    assert len(e.tp.group._sent) == SENT_KEPT
    clean(e)

    e.add_request("held", ps[0], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), hold_kv=True)
    for i, p in enumerate(ps[1:6]):
        e.add_request(f"m{i}", p, GREEDY)
    outs = []
    while not any(c.request.request_id == "m1" for chunks, *_ in mb.flight for c in chunks):
        outs += e.step()
    assert e.abort("m1") and "m1" in e.scheduler.in_flight  # aborted mid-pipe
    while e.scheduler.requests.get("held") is not None:
        outs += e.step()
    assert mb.flight
    _, kv = e.export_kv("held")  # lands the pipe first: nothing may be in flight while the stages send KV
    assert not mb.flight and kv.shape[0] == 5
    e.release_kv("held")
    while e.has_unfinished_requests():
        outs += e.step()
    toks = {}
    for o in outs:
        toks.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert "m1" not in toks or len(toks["m1"]) < 16
    assert [toks[f"m{i}"] for i in (0, 2, 3, 4)] == [want[i] for i in (1, 3, 4, 5)]
    assert e.runner.model.pp.sends > sends
    clean(e)


def test_a_long_prompt_s_chunks_follow_each_other_into_the_pipe(pipelines):
    """One stream: its prompt's chunks (4 of at most 64 tokens) go into the pipe one after
    another, as micro-batches (only the last samples); tokens and logprobs exact."""
    ps = prompts(1, seed=41, lo=230, hi=230)
    want = run(single(), ps)
    e = pipelines[2]
    e.micro_batches.most = 0
    assert run(e, ps) == want
    assert e.micro_batches.most == 2
    clean(e)
