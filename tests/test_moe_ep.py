"""Expert parallelism (engine/parallel/ep.py): the experts of small random transformers MoE
models split over 2 and 4 ranks (evenly, and 6 experts over 4 unevenly), the rest whole on
each. Greedy tokens equal the single engine's, batched with chunked prefill and under
preemption, with a shared expert added once; a router that sends every token to rank 0's
experts leaves the other ranks idle without a hang or a lost token; every KV block comes back;
KV moves between an expert-parallel group and a single engine (and another group) with the
same tokens after; a killed rank takes the group down; the expert load reaches the worker's
/metrics; degrees and combinations it cannot run are refused by name (by `pdserve up` before
Ray starts)."""

import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.model.moe import AbsentExpert
from pdserve.engine.model.weights import load_model, load_state_dict
from pdserve.engine.parallel.ep import check_experts, experts_of, shard_experts
from pdserve.engine.parallel.tp import ModelSource
from tests.helpers.engine_runs import clean, handoff, kill_rank_mid_stream
from tests.helpers.prompts import prompts
from tests.test_moe import hf_model

pytest.importorskip("transformers")

CONFIG = EngineConfig(quantization="exact", cache=CacheConfig(kv_cache_memory=4 << 20),
                      scheduler=SchedulerConfig(max_num_batched_tokens=64))
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[t % 317 + 3 for t in p] for p in prompts(5, seed=21, lo=5, hi=100)]  # 100 > 64: chunked


def skew(hf) -> None:
    """Every token routed to experts 0 and 1 at every layer: the residual stream's dimension 0
    held at 10 (the embedding's column; no attention or expert output writes it), and each
    router reading only that dimension: expert 0 first, expert 1 second (close enough that its
    softmax probability does not underflow to the others' 0), the rest 0."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p[:, 0] = 10.0
            elif name.endswith("o_proj.weight") or ("experts" in name and "down" in name and p.dim() == 2):
                p[0] = 0.0
            elif "experts" in name and "down" in name:  # transformers' fused (E, H, I)
                p[:, 0] = 0.0
            elif name.endswith("post_attention_layernorm.weight"):
                p[0] = 1.0
            elif name.endswith("mlp.gate.weight"):
                p.zero_()
                p[0, 0], p[1, 0] = 50.0, 45.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """model_dir(arch, skewed=False): a saved random transformers model of `arch` (made once)."""
    made = {}

    def get(arch: str, skewed: bool = False):
        if (arch, skewed) not in made:
            hf = hf_model(arch)
            if skewed:
                skew(hf)
            path = tmp_path_factory.mktemp(f"{arch}{'-skewed' if skewed else ''}")
            hf.save_pretrained(path)
            made[arch, skewed] = path
        return made[arch, skewed]
    return get


@pytest.fixture
def ep_engine():
    started = []

    def start(path, ep: int, config: EngineConfig = CONFIG) -> LLMEngine:
        e = LLMEngine.tensor_parallel(ModelSource(str(path)), config, ep, expert=True)
        started.append(e)
        return e
    yield start
    for e in started:
        e.shutdown()
        assert all(p.poll() is not None for p in e.tp.procs)


@pytest.fixture(scope="module")
def ep_group():
    """ep_group(path, ep) -> the module's group of `ep` ranks over the model at `path` (CONFIG),
    started once and shared by the tests: each leaves it as it found it (no request, every
    block back; its counters only grow, so a test counts its own steps from a `before`) and
    finds its prefix cache emptied (every prompt computed afresh, as on a new group); one
    that killed a rank leaves it dead, and the next call starts a fresh group (one left with
    requests is replaced too). At the end every group is shut down and each rank has exited."""
    made, live = [], {}

    def get(path, ep: int) -> LLMEngine:
        e = live.get((path, ep))
        if e is None or e.tp.dead_ranks() or e.has_unfinished_requests():
            e = live[path, ep] = LLMEngine.tensor_parallel(ModelSource(str(path)), CONFIG, ep, expert=True)
            made.append(e)
        assert e.blocks.reset_prefix_cache()
        return e
    yield get
    for e in made:
        e.shutdown()
        assert all(p.poll() is not None for p in e.tp.procs)


def single(path, config: EngineConfig = CONFIG) -> LLMEngine:
    return LLMEngine(load_model(path, quantization=config.quantization), config)


@pytest.mark.parametrize("arch, ep", [("qwen3_moe", 2), ("qwen3_moe", 4), ("mixtral", 4), ("qwen2_moe", 2)])
def test_greedy_tokens_equal_the_single_engine_batched_and_chunked(model_dir, ep_group, arch, ep):
    """qwen3_moe: 8 experts (4 or 2 a rank); mixtral: 6 over 4 ranks (2, 2, 1, 1); qwen2_moe: 4
    experts and the shared expert, on rank 0 only."""
    path = model_dir(arch)
    ref = single(path)
    want = ref.generate(PROMPTS, GREEDY)
    e = ep_group(path, ep)
    before = e.tp.group.allreduces, e.runner.model.expert_tokens()  # the group is the module's: this test's alone
    assert e.generate(PROMPTS, GREEDY) == want
    n = e.model_config.num_experts
    for block in e.runner.model.moe_blocks():  # rank 0 holds only its experts
        assert block.owned == experts_of(e.model_config, ep, 0) == range(-(-n // ep))
        assert isinstance(block.experts[n - 1], AbsentExpert) and block.gate_up_weight.shape[0] == len(block.owned)
        assert (block.shared_expert is not None) == (arch == "qwen2_moe")
    assert e.kv_cache.layout == ref.kv_cache.layout  # every KV head on each rank
    ours = e.tp.group.allreduces - before[0]
    assert ours > 0 and ours % 2 == 0  # one per MoE layer (2) per step
    ours = [a - b for a, b in zip(e.runner.model.expert_tokens(), before[1], strict=True)]
    assert ours == ref.runner.model.expert_tokens()  # the same routing
    clean(e)


def test_batched_under_preemption_equals_alone(model_dir, ep_engine):
    path = model_dir("qwen3_moe")
    ps = [[(7 * i + j) % 300 + 3 for j in range(20 + 3 * i)] for i in range(6)]
    ref = single(path)
    want = ref.generate(ps, GREEDY)
    tight = EngineConfig(quantization="exact", cache=CacheConfig(kv_cache_memory=8 * ref.kv_cache.bytes_per_block,
                                                                 kv_host_memory=0))
    e = ep_engine(path, 2, tight)
    assert e.blocks.num_blocks == 8  # 6 sequences of 30-45 tokens in 8 blocks of 16: some must wait their turn
    preempted = []
    orig = e.scheduler._preempt
    e.scheduler._preempt = lambda r, cause: (preempted.append(r.request_id), orig(r, cause))
    assert e.generate(ps, GREEDY) == want and preempted
    clean(e)


def test_a_router_sending_every_token_to_rank_0_leaves_the_others_idle_without_a_hang(model_dir, ep_engine):
    path = model_dir("qwen3_moe", skewed=True)
    ref = single(path)
    want = ref.generate(PROMPTS, GREEDY)
    e = ep_engine(path, 4)
    assert e.generate(PROMPTS, GREEDY) == want
    tokens = e.runner.model.expert_tokens()
    pairs = sum(len(p) + GREEDY.max_tokens - 1 for p in PROMPTS) * 2 * 2  # rows x top-2 x 2 MoE layers
    assert tokens[:2] == [pairs // 2] * 2 and sum(tokens[2:]) == 0  # ranks 1-3 computed nothing
    assert tokens == ref.runner.model.expert_tokens()
    clean(e)


def test_kv_moves_between_an_expert_parallel_group_and_a_single_engine(model_dir, ep_group):
    """EP=2 -> single (rank 0's cache exported alone), single -> EP=4 (the import broadcast to
    every rank: each one's attention reads it), EP=4 -> EP=2."""
    path = model_dir("qwen3_moe")
    ps = PROMPTS[:3]
    want = single(path).generate(ps, GREEDY)
    two, one, four = ep_group(path, 2), single(path), ep_group(path, 4)
    assert handoff(two, one, ps) == want
    assert handoff(one, four, ps) == want
    assert handoff(four, two, ps) == want
    for e in (two, one, four):
        clean(e)


def test_a_rank_killed_mid_stream_raises_rank_failed_and_frees_the_blocks(model_dir, ep_group):
    e = ep_group(model_dir("qwen3_moe"), 4)  # the module's group: this test, which kills it, comes after its others
    kill_rank_mid_stream(e, PROMPTS[0], 1)


class _Now:
    """An AsyncEngine's `call` for a collector test: runs `fn(engine)` at once."""

    def __init__(self, engine):
        self.engine = engine

    def call(self, fn):
        from concurrent.futures import Future
        f = Future()
        f.set_result(fn(self.engine))
        return f


def test_the_expert_load_per_expert_and_per_rank_on_the_worker_metrics(model_dir, ep_group):
    from pdserve.deploy.model_server_metrics import ModelServerCollector
    from pdserve.engine.model.tiny import tiny_llama

    e = ep_group(model_dir("mixtral"), 4)  # 6 experts: ranks 0, 0, 1, 1, 2, 3
    before = sum(e.runner.model.expert_tokens())  # the module's group: the series count since it started
    e.generate(PROMPTS, GREEDY)
    families = {f.name: f for f in ModelServerCollector(_Now(e), "m").collect()}
    experts = {(s.labels["expert"], s.labels["rank"]): s.value
               for s in families["pdserve:moe_expert_tokens"].samples if s.name.endswith("_total")}
    ranks = {s.labels["rank"]: s.value for s in families["pdserve:moe_rank_tokens"].samples
             if s.name.endswith("_total")}
    tokens = e.runner.model.expert_tokens()
    assert experts == {(str(x), str(r)): tokens[x] for x, r in enumerate([0, 0, 1, 1, 2, 3])}
    assert ranks == {"0": tokens[0] + tokens[1], "1": tokens[2] + tokens[3], "2": tokens[4], "3": tokens[5]}
    assert sum(ranks.values()) - before == sum(len(p) + GREEDY.max_tokens - 1 for p in PROMPTS) * 2 * 2
    dense = {f.name for f in ModelServerCollector(_Now(LLMEngine(tiny_llama(0), CONFIG)), "d").collect()}
    assert "pdserve:moe_expert_tokens" not in dense  # no expert series for a dense model


def test_each_rank_keeps_its_experts_and_rank_0_the_shared_one(model_dir):
    state, cfg, _ = load_state_dict(model_dir("qwen2_moe"))  # 4 experts and a shared one
    names = {r: set(shard_experts(state, cfg, 3, r)[0]) for r in range(3)}
    assert [experts_of(cfg, 3, r) for r in range(3)] == [range(2), range(2, 3), range(3, 4)]
    for r, kept in names.items():
        experts = {int(n.split(".experts.")[1].split(".")[0]) for n in kept if ".experts." in n}
        assert experts == set(experts_of(cfg, 3, r))
        assert any(".shared_expert." in n for n in kept) == (r == 0)
        assert {n for n in state if ".experts." not in n and ".shared_expert" not in n} <= kept  # the rest whole


def test_degrees_and_combinations_it_cannot_run_are_refused(model_dir):
    from pdserve.config import PoolConfig
    from pdserve.engine.model.tiny import tiny_config

    _, cfg, _ = load_state_dict(model_dir("mixtral"))
    with pytest.raises(ValueError, match="degree 7: this model has 6 experts per layer: use 1 to 6"):
        check_experts(cfg, 7)
    with pytest.raises(ValueError, match="degree 2: this llama model is dense"):
        check_experts(tiny_config(), 2)
    with pytest.raises(ValueError, match="dense"):  # before any rank starts
        LLMEngine.tensor_parallel(ModelSource(tiny_seed=0), CONFIG, 2, expert=True)
    with pytest.raises(ValueError, match="LoRA adapters on an expert-parallel group"):
        LLMEngine.tensor_parallel(ModelSource(str(model_dir("mixtral"))), EngineConfig(lora=LoRAConfig(max_loras=1)),
                                  2, expert=True)
    with pytest.raises(ValueError, match="not both > 1: 2, 2"):
        EngineConfig(tensor_parallel_size=2, expert_parallel_size=2)
    with pytest.raises(ValueError, match=r"tp \(2\) and ep \(2\) cannot both be above 1"):
        PoolConfig(tp=2, ep=2)
    assert PoolConfig(ep=4).ranks(EngineConfig()) == 4 and PoolConfig().ranks(EngineConfig(expert_parallel_size=3)) == 3


def test_up_refuses_a_degree_the_experts_do_not_allow_before_starting_ray(model_dir):
    import subprocess
    import sys

    from tests.helpers.procs import ENV

    path = str(model_dir("mixtral"))
    refusals = {("--decode-ep", "7"): "--decode-ep: expert-parallel degree 7: this model has 6 experts per layer: "
                                      "use 1 to 6",
                ("--prefill-tp", "2"): "--prefill-tp: tensor-parallel degree 2: a mixture-of-experts model",
                ("--decode-ep", "2", "--decode-tp", "2"): "tp (2) and ep (2) cannot both be above 1"}
    runs = {flags: subprocess.Popen([sys.executable, "-m", "pdserve", "up", "--model", path, *flags],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
            for flags in refusals}  # the three at once
    for flags, why in refusals.items():
        _, stderr = runs[flags].communicate(timeout=120)
        assert runs[flags].returncode != 0 and why in stderr, (flags, stderr)
        assert "Ray" not in stderr  # refused before a local Ray started
