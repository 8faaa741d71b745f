"""Pipeline x tensor parallelism (engine/parallel/pp.py, PP x TP): a pipeline of 2 stages, each
a tensor-parallel group of 2 ranks (4 processes), over the 5-layer tiny model (and 3 stages
of 2: 6 processes). Its greedy tokens are the single engine's and its logprobs the TP=2
engine's exactly (the same partial sums in the same order; the single engine's within float
tolerance, as TP's are), batched, chunked and with micro-batches filling the pipe, a long
prompt's chunks one after another; every block is back in the pool afterwards (rank 0's
block manager is every rank's: a block id names the same block in each rank's cache). KV
crosses token-exactly between it, a TP=2 engine, a PP=2 pipeline and a single engine, in the
whole model's layout (a model of one KV head too, replicated on both ranks of a stage), and
through the workers by parts, each rank sending or receiving its own layers and heads.
Degrees that do not fit are refused before a rank starts, naming what fits; a killed rank of
a stage's group takes the worker down with every block back."""
from dataclasses import replace
from pathlib import Path

import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.config import ClusterConfig, PoolConfig
from pdserve.deploy.placement import RayResources, cluster_demands, placement_shortfall
from pdserve.engine.config import EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.model.tiny import tiny_config, tiny_state_dict
from pdserve.engine.model.weights import LoadedModel, build_model
from pdserve.engine.parallel.pp import stage_width
from pdserve.engine.parallel.tp import ModelSource
from tests.helpers.engine_runs import clean, handoff, kill_rank_mid_stream, run
from tests.helpers.prompts import prompts
from tests.test_pp import CONFIG, LAYERS, five_layers_streamed
from tests.test_pp_handoff import through_workers

PPTP = replace(CONFIG, tensor_parallel_size=2, pipeline_parallel_size=2)
SOURCE = ModelSource(tiny_seed=0, tiny_overrides=LAYERS)


def single(overrides=LAYERS) -> LLMEngine:
    cfg = tiny_config(**dict(overrides))
    return LLMEngine(LoadedModel(build_model(cfg, tiny_state_dict(cfg, 0), quantization="exact"), cfg,
                                 Path("<tiny>"), "tiny-0"), CONFIG)


@pytest.fixture(scope="module")
def engines():
    """The module's PP=2 x TP=2 engine ("pptp"), TP=2 engine ("tp") and PP=2 engine ("pp"),
    started once; each test leaves them clean, and the rank kill comes last. At the end every
    rank has exited."""
    made = {"pptp": LLMEngine.tensor_parallel(SOURCE, PPTP, 4, pipeline=True),
            "tp": LLMEngine.tensor_parallel(SOURCE, CONFIG, 2),
            "pp": LLMEngine.tensor_parallel(SOURCE, CONFIG, 2, pipeline=True)}
    yield made
    for e in made.values():
        e.shutdown()
        assert all(p.poll() is not None for p in e.tp.procs)


def test_degrees_that_do_not_fit_are_refused_before_a_rank_starts():
    """PP x TP (and PP x EP) is a config the engine and the pools take; a stage
    width that does not divide the group, or the heads, names what fits."""
    assert EngineConfig(pipeline_parallel_size=2, tensor_parallel_size=2).tensor_parallel_size == 2
    assert PoolConfig(pp=2, tp=2).ranks(EngineConfig()) == 4
    assert PoolConfig(pp=2, ep=2).ranks(EngineConfig()) == 4  # PP x EP: tests/test_pp_ep.py
    with pytest.raises(ValueError, match=r"pipeline group of 5 ranks cannot be split into stages of 2 tensor-parallel "
                                         r"ranks: use a multiple of 2"):
        stage_width(PPTP, 5)
    with pytest.raises(ValueError, match=r"tensor-parallel degree 3 does not divide this model's 4 attention heads "
                                         r"\(2 KV heads\): use one of 1, 2, 4"):
        LLMEngine.tensor_parallel(SOURCE, replace(PPTP, tensor_parallel_size=3), 6, pipeline=True)
    with pytest.raises(ValueError, match=r"pipeline-parallel degree 6: this model has 5 layers: use 1 to 5"):
        LLMEngine.tensor_parallel(SOURCE, PPTP, 12, pipeline=True)
    two_cpus = RayResources({"CPU": 2.0}, {"CPU": 2.0}, [{"CPU": 2.0}])
    config = ClusterConfig(engine=EngineConfig(), prefill=PoolConfig(replicas=0), decode=PoolConfig(pp=2, tp=2))
    short = placement_shortfall(cluster_demands(config), two_cpus)  # 4 ranks of 1 CPU on 2 CPUs
    assert "1 decode worker(s) of 4 CPU each (4 tensor-parallel ranks" in short and "--decode-cpus" in short, short
    fits = replace(config, decode=PoolConfig(pp=2, tp=2, num_cpus=0.5))
    assert placement_shortfall(cluster_demands(fits), two_cpus) is None
    assert fits.worker("decode", "d").engine.pipeline_parallel_size == 2


def test_each_rank_holds_its_stage_s_layers_and_its_heads_of_them(engines):
    e = engines["pptp"]
    model, kv = e.runner.model, e.kv_cache
    assert e.tp.stages == 2 and len(e.tp.procs) == 3 and e.tp.stage_tp.world == 2
    assert len(model.model.layers) == 2 and model.config.num_attention_heads == 2  # of 5 layers (2, 3), of 4 heads
    assert model.model.embed_tokens.weight.shape[0] == model.config.vocab_size == e.model_config.vocab_size
    assert kv.kv.shape[0] == 2 and kv.layout == single().kv_cache.layout == (5, 2, *kv.layout[2:])
    assert kv.kv.shape[4] == 1 and kv.layout[3] == 2  # its KV head of the model's 2


def test_greedy_tokens_and_logprobs_batched_chunked_with_the_pipe_full(engines):
    """12 prompts of 5-90 tokens over a 64-token budget: tokens the single engine's, logprobs
    the TP=2 engine's exactly and the single engine's within 1e-5; 2 micro-batches in flight."""
    ps = prompts(12, seed=31, lo=5, hi=90)
    want, want_lp = run(single(), ps)
    tp_toks, tp_lp = run(engines["tp"], ps)
    e = engines["pptp"]
    mb, stage = e.micro_batches, e.runner.model.pp
    mb.most, launched, sends, reduces = 0, mb.launched, stage.sends, e.tp.stage_tp.allreduces
    got, got_lp = run(e, ps)
    assert got == want == tp_toks
    assert got_lp == tp_lp
    assert max(abs(a - b) for x, y in zip(got_lp, want_lp) for a, b in zip(x, y)) < 1e-5
    assert mb.most == 2 and mb.launched - launched >= 16  # the pipe was full, many times over
    assert stage.sends > sends and e.tp.stage_tp.allreduces > reduces  # activations on, partial sums reduced
    clean(e)


def test_a_long_prompt_s_chunks_follow_each_other_into_the_pipe(engines):
    """One 230-token prompt over a 64-token budget: its 4 chunks are micro-batches in a row."""
    ps = prompts(1, seed=41, lo=230, hi=230)
    want_toks, _ = run(single(), ps)
    want = run(engines["tp"], ps)
    e = engines["pptp"]
    e.micro_batches.most = 0
    assert run(e, ps) == want and want[0] == want_toks
    assert e.micro_batches.most == 2
    clean(e)


def test_kv_crosses_between_pp_x_tp_tp_pp_and_one_engine(engines):
    """P(PP=2 x TP=2) -> D(TP=2), P(TP=2) -> D(PP=2 x TP=2), P(PP=2 x TP=2) -> D(PP=1), one
    engine -> PP x TP, and PP x TP -> a PP=2 pipeline (its layer streams, exported once the
    pass is through, are the export), all the single engine's tokens."""
    ps = prompts(3, seed=12, lo=20, hi=70)
    one = single()
    want = one.generate(ps, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    pptp, tp, pp = engines["pptp"], engines["tp"], engines["pp"]
    assert handoff(pptp, tp, ps) == want
    assert handoff(tp, pptp, ps) == want
    assert handoff(pptp, one, ps) == want
    assert handoff(one, pptp, ps) == want
    assert handoff(pptp, pp, ps, [], five_layers_streamed) == want
    assert handoff(pp, pptp, ps) == want
    for e in (pptp, tp, one, pp):
        clean(e)


def test_kv_hands_off_by_parts_between_shapes(engines):
    """Through a prefill and a decode worker (gRPC): P(TP=2) -> D(PP=2) (rank 0 of the TP
    group sends each stage its layers), P(PP=2 x TP=2) -> D(TP=2) (each of its 4 ranks sends
    its layers' KV head, no rank gathers), P(PP=2) -> D(PP=2 x TP=2) (each stage sends each
    decode rank its layers' head) and back, and one engine -> D(PP=2 x TP=2); greedy tokens the single engine's, every block back (the checks of
    tests/test_pp_handoff.py)."""
    ps = prompts(2, seed=16, lo=20, hi=70)
    one = single()
    want = one.generate(ps, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    pptp, tp, pp = engines["pptp"], engines["tp"], engines["pp"]
    assert through_workers(tp, pp, ps) == want
    assert through_workers(pptp, tp, ps) == want
    assert through_workers(pp, pptp, ps) == want
    assert through_workers(pptp, pp, ps) == want
    assert through_workers(one, pptp, ps) == want


def test_kv_hands_off_between_two_pp_x_tp_pipelines(engines):
    """P(PP=2 x TP=2) -> D(PP=2 x TP=2), a second pipeline of 4 ranks, and back: in the whole
    model's layout (rank 0 gathers and sends each rank its part) and by parts through the
    workers, where each of the 4 prefill ranks pushes its own stage's layers' KV head (a
    quarter of the bytes each), no rank gathers, and each decode rank takes its own part;
    greedy tokens the single engine's, every block back in both."""
    ps = prompts(2, seed=17, lo=20, hi=70)
    want = single().generate(ps, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    pptp = engines["pptp"]
    other = LLMEngine.tensor_parallel(SOURCE, PPTP, 4, pipeline=True)
    try:
        assert handoff(pptp, other, ps) == want and handoff(other, pptp, ps) == want
        assert through_workers(pptp, other, ps) == want
        shipped = pptp.kv_cache.last_ship
        assert len(shipped) == 4 and min(shipped) > 0 and len(set(shipped)) == 2, shipped  # 2 layers and 3: 2:2:3:3
        assert shipped[0] * 3 == shipped[2] * 2
        assert through_workers(other, pptp, ps) == want
        for e in (pptp, other):
            clean(e)
    finally:
        other.shutdown()
    assert all(p.poll() is not None for p in other.tp.procs)

def test_three_stages_of_two_ranks():
    """PP=3 x TP=2 (6 processes): the middle stage's ranks each receive from and send to their
    place in the stages around them; 3 micro-batches in flight, tokens the single engine's,
    KV to and from one engine token-exactly."""
    ps = prompts(12, seed=31, lo=5, hi=90)
    one = single()
    want, want_lp = run(one, ps)
    e = LLMEngine.tensor_parallel(SOURCE, replace(PPTP, pipeline_parallel_size=3), 6, pipeline=True)
    try:
        assert e.tp.stages == 3 and len(e.runner.model.model.layers) == 2  # 5 layers: 2, 2, 1
        got, got_lp = run(e, ps)
        assert got == want and e.micro_batches.most == 3
        assert max(abs(a - b) for x, y in zip(got_lp, want_lp) for a, b in zip(x, y)) < 1e-5
        short = ps[:2]
        kv_want = one.generate(short, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        assert handoff(e, one, short) == kv_want and handoff(one, e, short) == kv_want
        for x in (e, one):
            clean(x)
    finally:
        e.shutdown()


def test_kv_heads_replicated_over_a_stage_s_ranks():
    """One KV head over a stage of 2 ranks: each holds it (the export takes rank 0's of each
    stage, the import sends it to both; by parts, one rank of each stage pushes it and both
    receive it); KV crosses to and from one engine token-exactly."""
    over = LAYERS + (("num_key_value_heads", 1),)
    ps = prompts(2, seed=14, lo=20, hi=70)
    one = single(over)
    want = one.generate(ps, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    e = LLMEngine.tensor_parallel(ModelSource(tiny_seed=0, tiny_overrides=over), PPTP, 4, pipeline=True)
    try:
        assert e.kv_cache.owners == [0] and e.kv_cache.layout[3] == e.kv_cache.kv.shape[4] == 1
        assert handoff(e, one, ps) == want and handoff(one, e, ps) == want
        assert through_workers(e, one, ps) == want and through_workers(one, e, ps) == want  # by parts
        for x in (e, one):
            clean(x)
    finally:
        e.shutdown()


def test_a_killed_rank_of_a_stage_s_group_raises_rank_failed_and_frees_the_blocks(engines):
    """Stage 0's second rank (rank 0's partner in every all-reduce) killed mid-stream: rank 0's
    next step raises RankFailed, every other rank is taken down, every block comes back."""
    e = engines["pptp"]
    kill_rank_mid_stream(e, prompts(1, seed=13, lo=30, hi=30)[0], 0)

