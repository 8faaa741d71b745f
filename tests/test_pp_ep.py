"""Pipeline x expert parallelism (engine/parallel/pp.py, PP x EP): a pipeline of 2 stages, each an
expert-parallel group of 2 ranks (4 processes; and 3 stages of 2), over small random
transformers MoE models of 3 layers (stages of 1 layer and 2: the default split): each rank
holds its stage's attention whole and its share of their experts (Qwen2-MoE's shared expert on
each stage's first rank). Greedy tokens equal the single engine's under `exact`, batched with
chunked prefill and under preemption; every block is back after (rank 0's block manager is every
rank's). KV crosses token-exactly between it, a single engine and an EP=2 group, in the whole
model's layout and by parts through the workers (each stage's first rank pushes its layers' KV,
every rank of a decode stage takes it). Degrees that do not fit are refused before a rank
starts, naming what fits; a killed rank takes the pipeline down with every block back."""
from dataclasses import replace

import pytest

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.model.tiny import tiny_config
from pdserve.engine.parallel.ep import expert_load, experts_of
from pdserve.engine.parallel.pp import stage_width
from pdserve.engine.parallel.tp import ModelSource
from tests.helpers.engine_runs import clean, handoff, kill_rank_mid_stream
from tests.test_moe import hf_model
from tests.test_moe_ep import CONFIG, GREEDY, PROMPTS, single
from tests.test_pp_handoff import through_workers

pytest.importorskip("transformers")

EP = replace(CONFIG, expert_parallel_size=2)  # with pipeline=True over 4 ranks: 2 stages of 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """model_dir(arch): a saved random transformers model of `arch` with 3 layers (made once)."""
    made = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = tmp_path_factory.mktemp(arch)
            hf_model(arch, num_hidden_layers=3).save_pretrained(made[arch])
        return made[arch]
    return get


@pytest.fixture(scope="module")
def ppep(model_dir):
    """ppep(arch) -> the module's PP=2 x EP=2 engine over model_dir(arch), started once; each
    test leaves it clean, and the rank kill comes last. At the end every rank has exited."""
    made = {}

    def get(arch: str) -> LLMEngine:
        if arch not in made:
            # as a worker starts it (deploy/worker_host.py: expert and pipeline both said)
            made[arch] = LLMEngine.tensor_parallel(ModelSource(str(model_dir(arch))), EP, 4, expert=True,
                                                   pipeline=True)
        return made[arch]
    yield get
    for e in made.values():
        e.shutdown()
        assert all(p.poll() is not None for p in e.tp.procs)


def test_degrees_that_do_not_fit_are_refused_before_a_rank_starts(model_dir):
    """A group that is not whole stages of the expert-parallel degree, more stages than layers,
    more ranks a stage than experts, or experts split on a dense model: each names what fits."""
    path = ModelSource(str(model_dir("qwen2_moe")))  # 3 layers, 4 experts
    with pytest.raises(ValueError, match=r"pipeline group of 5 ranks cannot be split into stages of 2 expert-parallel "
                                         r"ranks: use a multiple of 2"):
        stage_width(EP, 5)
    with pytest.raises(ValueError, match=r"expert-parallel degree 5: this model has 4 experts per layer: use 1 to 4"):
        LLMEngine.tensor_parallel(path, replace(CONFIG, expert_parallel_size=5), 10, pipeline=True)
    with pytest.raises(ValueError, match=r"pipeline-parallel degree 4: this model has 3 layers: use 1 to 3"):
        LLMEngine.tensor_parallel(path, EP, 8, pipeline=True)
    with pytest.raises(ValueError, match=r"expert-parallel degree 2: this llama model is dense"):
        LLMEngine.tensor_parallel(ModelSource(tiny_seed=0), EP, 4, pipeline=True)
    with pytest.raises(ValueError, match=r"a mixture-of-experts model \(qwen2_moe\) is not split by tensor"):
        LLMEngine.tensor_parallel(path, replace(CONFIG, tensor_parallel_size=2), 4, pipeline=True)
    assert EngineConfig(pipeline_parallel_size=2, expert_parallel_size=2).expert_parallel_size == 2
    assert tiny_config().num_experts == 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_greedy_tokens_equal_the_single_engine_batched_and_chunked(model_dir, ppep, arch):
    """qwen3_moe: 8 experts, 4 a rank; qwen2_moe: 4, 2 a rank, and the shared expert on each
    stage's first rank. Rank 0 holds stage 0's layer (the default split: 1 and 2), its first 4
    (2) experts, every KV head; each step all-reduces its MoE layer over the stage's group."""
    ref = single(model_dir(arch))
    ref_before = ref.runner.model.expert_tokens()
    want = ref.generate(PROMPTS, GREEDY)
    ref_routed = [b - a for a, b in zip(ref_before, ref.runner.model.expert_tokens())]
    e = ppep(arch)
    model, n = e.runner.model, e.model_config.num_experts
    assert e.tp.stages == 2 and e.micro_batches is None  # a mixture of experts: one pass at a time
    assert len(model.model.layers) == 1 and e.kv_cache.kv.shape[0] == 1
    assert e.kv_cache.layout == ref.kv_cache.layout and e.kv_cache.owners == [0]
    for block in model.moe_blocks():
        assert block.owned == experts_of(e.model_config, 2, 0) == range(n // 2)
        assert (block.shared_expert is not None) == (arch == "qwen2_moe")
    reduces, sends = e.tp.stage_tp.allreduces, model.pp.sends
    own_before, all_before = model.expert_tokens(), [n for _, _, n in expert_load(model, 4, e.kv_cache)]
    assert e.generate(PROMPTS, GREEDY) == want
    # /metrics' expert load asks the later stage for its layer's counts: the single engine's routing
    routed = [b - a for a, b in zip(all_before, [n for _, _, n in expert_load(model, 4, e.kv_cache)])]
    own = [b - a for a, b in zip(own_before, model.expert_tokens())]
    assert routed == ref_routed and sum(own) < sum(routed), (routed, ref_routed, own)
    ours = e.tp.stage_tp.allreduces - reduces
    assert ours > 0 and ours % 2 == 0 and model.pp.sends > sends  # combined in the stage; activations on
    # the load (/metrics) of rank 0's stage: its experts over the stage's 2 ranks, whatever the group's size
    assert [(x, r) for x, r, _ in expert_load(model, 4)] == [(x, x // (n // 2)) for x in range(n)]
    clean(e)


def test_batched_under_preemption_equals_alone(model_dir):
    path = model_dir("qwen3_moe")
    ps = [[(7 * i + j) % 300 + 3 for j in range(20 + 3 * i)] for i in range(6)]
    ref = single(path)
    want = ref.generate(ps, GREEDY)
    tight = replace(EP, cache=CacheConfig(kv_cache_memory=8 * ref.kv_cache.bytes_per_block * 2 // 3,
                                          kv_host_memory=0))  # stage 1: 2 of the 3 layers
    e = LLMEngine.tensor_parallel(ModelSource(str(path)), tight, 4, pipeline=True)
    try:
        assert e.blocks.num_blocks == 8  # 6 sequences of 30-45 tokens in 8 blocks of 16
        preempted = []
        orig = e.scheduler._preempt
        e.scheduler._preempt = lambda r, cause: (preempted.append(r.request_id), orig(r, cause))
        assert e.generate(ps, GREEDY) == want and preempted
        clean(e)
    finally:
        e.shutdown()


def test_kv_crosses_between_pp_x_ep_one_engine_and_an_ep_group(model_dir, ppep):
    """PP x EP -> one engine, one engine -> PP x EP, PP x EP -> EP=2 and back in the whole
    model's layout; one engine -> PP x EP and back by parts through the workers (each stage's
    first rank pushes its layers' every KV head; rank 0 takes its own part alone)."""
    path = model_dir("qwen3_moe")
    ps = PROMPTS[:2]
    one = single(path)
    want = one.generate(ps, GREEDY)
    e = ppep("qwen3_moe")
    two = LLMEngine.tensor_parallel(ModelSource(str(path)), EP, 2, expert=True)
    try:
        assert handoff(e, one, ps) == want and handoff(one, e, ps) == want
        assert handoff(e, two, ps) == want and handoff(two, e, ps) == want
        assert through_workers(one, e, ps) == want
        assert through_workers(e, one, ps) == want
        shipped = e.kv_cache.last_ship
        assert shipped[1] == shipped[3] == 0 and 2 * shipped[0] == shipped[2] > 0, shipped  # layers 1:2
        for x in (e, one, two):
            clean(x)
    finally:
        two.shutdown()


def test_three_stages_of_two_ranks(model_dir):
    """PP=3 x EP=2 (6 processes) over Mixtral's 6 experts, a layer a stage, 3 experts a rank:
    the middle stage's ranks receive from and send to their places in the stages around them;
    tokens the single engine's, KV to and from one engine token-exactly."""
    path = model_dir("mixtral")
    one = single(path)
    want = one.generate(PROMPTS, GREEDY)
    e = LLMEngine.tensor_parallel(ModelSource(str(path)), EP, 6, pipeline=True)
    try:
        assert e.tp.stages == 3 and len(e.runner.model.model.layers) == 1
        assert [b.owned for b in e.runner.model.moe_blocks()] == [range(3)]
        assert e.generate(PROMPTS, GREEDY) == want
        assert handoff(e, one, PROMPTS[:2]) == want[:2] and handoff(one, e, PROMPTS[:2]) == want[:2]
        for x in (e, one):
            clean(x)
    finally:
        e.shutdown()


def test_a_killed_rank_of_a_stage_s_group_raises_rank_failed_and_frees_the_blocks(ppep):
    """The last stage's second rank (its first rank's partner in every combine) killed
    mid-stream: rank 0's next step raises RankFailed, the other ranks go, every block is back."""
    kill_rank_mid_stream(ppep("qwen3_moe"), PROMPTS[0], 2)
