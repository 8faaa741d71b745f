"""KV tiers under the pool (engine/kv/tiers.py): evicted prefix blocks kept in host memory and
on disk, copied back on a prefix hit, token-exact against an engine without tiers; a torn
disk entry is refused; every block and every tier entry is accounted for."""

import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.kv.cache import bytes_per_block, engine_kv_format
from pdserve.engine.kv.tiers import TieredStore, host_tier_bytes
from pdserve.engine.model.tiny import tiny_llama
from tests.conftest import assert_engine_clean

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def pool(blocks: int = 4) -> torch.Tensor:
    return torch.randn(2, 2, blocks, 16, 2, 8)  # (layers, K/V, blocks, block_size, kv heads, head_dim)


def test_host_tier_keeps_evicted_blocks_lru_and_spills_to_disk(tmp_path):
    kv = pool()
    t = TieredStore(kv, host_bytes=2 * kv[:, :, 0].numel() * 4, disk_dir=str(tmp_path), disk_bytes=1 << 20)
    want = [kv[:, :, b].clone() for b in range(3)]
    for b in range(3):
        t.store(100 + b, b)
    assert t.host.entries == 2 and t.host.dropped == 1 and t.disk.entries == 1  # the oldest went to disk
    kv.zero_()
    assert t.load(100, 3) == "disk" and torch.equal(kv[:, :, 3], want[0])
    assert t.load(102, 3) == "host" and torch.equal(kv[:, :, 3], want[2])
    assert t.load(999, 3) is None and not t.has(999)
    t.close()
    assert not any(tmp_path.iterdir()), "the disk tier's directory is removed"


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_a_torn_or_altered_disk_entry_is_refused_not_read(tmp_path, damage):
    kv = pool()
    t = TieredStore(kv, host_bytes=0, disk_dir=str(tmp_path), disk_bytes=1 << 20)
    t.store(7, 0)
    path = next(p for p in next(tmp_path.iterdir()).iterdir())
    raw = path.read_bytes()
    path.write_bytes({"truncate": raw[:-5], "flip": raw[:-1] + bytes([raw[-1] ^ 1]), "empty": b""}[damage])
    before = kv[:, :, 1].clone()
    assert t.load(7, 1) is None and torch.equal(kv[:, :, 1], before)
    assert t.disk.refused == 1 and t.disk.entries == 0 and not path.exists()
    t.close()


def test_host_tier_size_from_available_memory():
    assert host_tier_bytes(0) == 0 and host_tier_bytes(123) == 123
    assert 0 < host_tier_bytes(-1) <= 8 << 30
    with pytest.raises(ValueError, match="kv_host_memory"):
        CacheConfig(kv_host_memory=-2)


def engine(loaded, host: int, disk: int = 0, disk_dir: str = "", blocks: int = 10, step_tokens: int = 512) -> LLMEngine:
    probe = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=1 << 20, kv_host_memory=0)))
    cache = CacheConfig(kv_cache_memory=blocks * probe.kv_cache.bytes_per_block, kv_host_memory=host,
                        kv_disk_memory=disk, kv_disk_dir=disk_dir)
    return LLMEngine(loaded, EngineConfig(cache=cache, scheduler=SchedulerConfig(max_num_batched_tokens=step_tokens)))


def sessions(n: int = 4, length: int = 64) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, 250, (length,), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_evicted_prefixes_come_back_from_a_tier_token_exact(tmp_path, tier):
    """Four 64-token prompts through a 10-block pool: each evicts the last one's blocks.
    Sent again, each finds its prefix in the tier: the same tokens as an engine without tiers
    (and as computing it), counted as hits of that tier, and every block back."""
    loaded = tiny_llama(0)
    prompts = sessions()
    plain = engine(loaded, host=0)
    want = [plain.generate([p], GREEDY)[0] for p in prompts]
    tiered = engine(loaded, host=1 << 20 if tier == "host" else 0, disk=(1 << 20) if tier == "disk" else 0,
                    disk_dir=str(tmp_path))
    first = [tiered.generate([p], GREEDY)[0] for p in prompts]
    hits_before = tiered.blocks.prefix_hits
    again = [tiered.generate([p + [9, 9]], GREEDY)[0] for p in prompts]
    assert first == want
    assert again == [plain.generate([p + [9, 9]], GREEDY)[0] for p in prompts]
    stats = tiered.stats()
    got = stats.kv_host_hits if tier == "host" else stats.kv_disk_hits
    assert got >= 3 * 64 and tiered.blocks.prefix_hits - hits_before >= got  # whole prefixes came back
    assert (stats.kv_host_stored if tier == "host" else stats.kv_disk_stored) > 0
    assert plain.stats().kv_host_hits == 0 and plain.blocks.tiers is None
    assert_engine_clean(tiered)
    assert_engine_clean(plain)
    tiered.shutdown()
    assert not any(tmp_path.iterdir()), "the disk tier is removed with its engine"


def test_tiers_under_batches_and_preemption_stay_exact():
    """Many prompts sharing prefixes, batched in a pool too small for them all (preemption),
    twice: outputs equal the tierless engine's, and the block accounting holds."""
    loaded = tiny_llama(0)
    base = sessions(3, 48)
    prompts = [b + [i] * 20 for b in base for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = engine(loaded, host=0, blocks=14).generate(prompts, params)
    tiered = engine(loaded, host=1 << 20, blocks=14)
    assert tiered.generate(prompts, params) == want
    assert tiered.generate(prompts[::-1], params) == want[::-1]
    assert tiered.stats().kv_host_hits > 0
    assert_engine_clean(tiered)
    assert tiered.blocks.reset_prefix_cache() and tiered.blocks.tiers.host.entries == 0


def _block_bytes(loaded) -> int:
    """One 16-token block of the real model's KV in the format the default engine gives it."""
    return bytes_per_block(loaded.config, 16, engine_kv_format(EngineConfig(), loaded.model))


@pytest.mark.slow
def test_real_model_prefix_back_from_the_host_tier(smollm):
    loaded, tok = smollm
    chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Tell me about {x}. " * 8}]))
             for x in ("the sea", "mountains", "rivers", "deserts")]
    params = SamplingParams(max_tokens=12, temperature=0)
    small = CacheConfig(kv_cache_memory=12 * _block_bytes(loaded), kv_host_memory=0)  # 12 blocks
    plain = LLMEngine(loaded, EngineConfig(cache=small), tok)
    tiered = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=small.kv_cache_memory,
                                                              kv_host_memory=64 << 20)), tok)
    for e in (plain, tiered):
        for c in chats:
            e.generate([c], params)
    assert [tiered.generate([c], params)[0] for c in chats] == [plain.generate([c], params)[0] for c in chats]
    assert tiered.stats().kv_host_hits > 0  # copied back, not recomputed
    assert_engine_clean(tiered)


@pytest.mark.slow
def test_cluster_workers_report_their_tiers(smollm):
    """Through a cluster whose prefill worker's pool holds one prompt: a prompt sent again is
    copied back from that worker's host tier, the answer is unchanged, and /admin/workers and
    /metrics show the tier's bytes and hits."""
    import time

    import httpx

    from pdserve.deploy.local import LocalCluster
    from tests.helpers.clusters import MODEL, local_config

    loaded, tok = smollm
    cache = CacheConfig(kv_cache_memory=12 * _block_bytes(loaded), kv_host_memory=32 << 20)  # 12 blocks
    c = LocalCluster(loaded, tok, local_config(engine=EngineConfig(cache=cache))).start()
    body = lambda x: {"model": MODEL, "prompt": f"Tell me about {x}. " * 16, "max_tokens": 6, "temperature": 0}  # noqa: E731
    try:
        first = [httpx.post(c.url + "/v1/completions", json=body(x), timeout=120).json() for x in ("seas", "hills", "woods")]
        again = httpx.post(c.url + "/v1/completions", json=body("seas"), timeout=120).json()
        assert again["choices"][0]["text"] == first[0]["choices"][0]["text"]
        deadline = time.monotonic() + 30  # the router's view is one stats poll old
        while time.monotonic() < deadline:
            view = {w["role"]: w for w in httpx.get(c.url + "/admin/workers").json()["workers"]}
            if (view["prefill"].get("kv_tiers") or {}).get("host", {}).get("hit_tokens", 0) > 0:
                break
            time.sleep(0.2)
        tiers = view["prefill"]["kv_tiers"]
        assert tiers["host"]["hit_tokens"] >= 64 and tiers["host"]["bytes"] > 0 and tiers["host"]["stored_blocks"] > 0
        metrics = httpx.get(c.url + "/metrics").text
        assert [x for x in metrics.splitlines() if x.startswith("pdserve_kv_tier_hits_tokens_total{")
                and 'role="prefill"' in x and 'tier="host"' in x and float(x.split()[-1]) >= 64], metrics
        engines = c.engines()
    finally:
        c.stop()
    for e in engines:
        assert_engine_clean(e)


def test_tier_moves_are_kv_events_and_the_prefix_index_weighs_them():
    """An evicted block is announced as stored in the host tier (and removed from the pool),
    a block the host tier drops as removed from it; the router's index counts a prefix kept
    in a worker's host tier at TIER_WEIGHTS["host"], below one in a pool, above none; the
    events survive the Redis encoding."""
    from pdserve.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
    from pdserve.engine.core.block_manager import BlockManager
    from pdserve.registry.events import EventPublisher, decode_event
    from pdserve.router.prefix_index import TIER_WEIGHTS, PrefixIndex

    events = []
    bm = BlockManager(2, 16, listener=events.append)
    kv = pool(2)
    bm.tiers = TieredStore(kv, host_bytes=kv[:, :, 0].numel() * 4)  # one block
    a, b, c = ([i] * 16 + [0] for i in (1, 2, 3))
    for rid, toks in (("a", a), ("b", b), ("c", c)):  # c evicts a (to host), then b pushes a out of host
        assert bm.allocate(rid, 17 if rid == "a" else 16)
        bm.cache_full_blocks(rid, toks, 16)
        bm.free(rid)
    ha = bm.match_prefix(a, count=False).hashes  # a comes back from... nowhere: dropped from host
    kinds = [(type(e).__name__, e.tier) for e in events]
    assert ("BlockStored", "host") in kinds and ("BlockRemoved", "host") in kinds and ha == ()
    for e in events:
        back = decode_event(EventPublisher.encode(e))
        assert (type(back), back.seq, back.block_hash, back.tier) == (type(e), e.seq, e.block_hash, e.tier)
    with pytest.raises(ValueError, match="tier"):
        decode_event({"seq": "1", "type": "stored", "hash": "5", "tier": "tape"})

    index = PrefixIndex()
    index.apply("pool", BlockStored(1, 11, 0, (), -1))
    index.apply("pool", BlockStored(2, 12, 0, (), -1))
    index.apply("tier", BlockStored(1, 11, 0, (), -1, "host"))
    index.apply("tier", BlockStored(2, 12, 0, (), -1, "host"))
    got = index.match([11, 12, 13])
    assert got["pool"] == 2 and got["tier"] == pytest.approx(2 * TIER_WEIGHTS["host"])
    index.apply("tier", BlockRemoved(3, 12, -1, "host"))
    assert index.match([11, 12])["tier"] == pytest.approx(TIER_WEIGHTS["host"])
    index.apply("tier", AllBlocksCleared(4))
    assert "tier" not in index.match([11, 12])


def test_a_prefix_is_copied_back_only_for_a_prompt_that_fits_now():
    """A waiting prompt whose blocks are not all free gets nothing copied back (it would be
    evicted again before it runs, at every step); once they are free, its prefix comes back."""
    from pdserve.engine.core.block_manager import BlockManager

    bm = BlockManager(3, 16)
    kv = pool(3)
    bm.tiers = TieredStore(kv, host_bytes=1 << 20)
    prompt = [7] * 32 + [1]
    assert bm.allocate("a", 33)
    bm.cache_full_blocks("a", prompt, 32)
    bm.free("a")
    assert bm.allocate("x", 48)  # three other blocks: a's two cached ones go to the host tier
    bm.free("x")
    assert bm.allocate("busy", 16)  # one block in use: the prompt's three do not fit
    assert bm.match_prefix(prompt, count=False).num_tokens == 0 and bm.tier_hits == {}
    bm.free("busy")
    assert bm.match_prefix(prompt).num_tokens == 32 and bm.tier_hits == {"host": 32}
    bm.check_invariants()
    # with chunked prefill a request starts with one chunk: the prefix plus that chunk must fit
    bm = BlockManager(4, 16)
    bm.tiers = TieredStore(pool(4), host_bytes=1 << 20)
    bm.admit_tokens = 16
    long_prompt = [7] * 32 + [1] * 40  # 5 blocks: never all free at once here
    assert bm.allocate("a", 33)
    bm.cache_full_blocks("a", long_prompt, 32)
    bm.free("a")
    assert bm.allocate("x", 64)
    bm.free("x")
    assert bm.allocate("busy", 16)  # 3 free: two to copy back and one for the first chunk
    assert bm.match_prefix(long_prompt).num_tokens == 32 and bm.tier_hits == {"host": 32}


def test_a_waiting_prompt_is_looked_up_once_and_copied_back_once():
    """A prompt whose history went to the host tier waits several steps behind a long request
    that holds most of the pool: it is counted once in the prefix statistics (not at every
    step it waits) and its 4 blocks are copied back once, when it is admitted; its tokens equal
    the tierless engine's; every block and tier entry is accounted for."""
    loaded = tiny_llama(0)
    p, x, y = sessions(3)
    long = sessions(5, 100)[4]
    again = p + [9, 9]
    hold = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    results = []
    for e in (engine(loaded, host=0), engine(loaded, host=1 << 20)):
        for prompt in (p, x, y):  # y takes p's blocks: p's history goes to the host tier (if any)
            e.generate([prompt], GREEDY)
        e.add_request("long", long, hold)  # 7 blocks now, 9 by its end: the 5 `again` needs are not free
        e.add_request("again", again, GREEDY)
        out, waited = {"long": [], "again": []}, 0
        while e.has_unfinished_requests():
            for o in e.step():
                out[o.request_id].extend(o.new_token_ids)
            waited += any(r.request_id == "again" for r in e.scheduler.waiting)
        assert waited >= 10  # it waited for the long request's blocks
        assert e.blocks.prefix_queries == 3 * 64 + len(long) + len(again)  # each prompt once
        results.append(out)
        assert_engine_clean(e)
    assert results[1] == results[0]
    tiers = e.blocks.tiers  # the tiered engine's
    assert e.blocks.tier_hits == {"host": 64} and tiers.host.loaded == 4  # once, at admission
    assert e.blocks.prefix_hits == 64
    assert tiers.host.entries == len(tiers._host) == tiers.host.stored - tiers.host.dropped


def test_a_kv_import_copies_a_prefix_back_only_once_its_whole_prompt_fits():
    """A decode worker admits a request whose KV will be imported only with blocks for its whole
    prompt, and retries until they are free: no copy-back while they are not (it would be
    evicted again between retries); once they are, its 4 blocks come back from the host tier
    and only the rest is left to import. (A local prompt would start with one 16-token chunk:
    its prefix and that chunk fit in the 3 free blocks.)"""
    e = engine(tiny_llama(0), host=1 << 20, step_tokens=16)
    p, x, y = sessions(3)
    for prompt in (p, x, y):  # p's history goes to the host tier
        e.generate([prompt], GREEDY)
    e.add_request("busy", sessions(5, 100)[4], GREEDY)
    while e.blocks.num_used_blocks < 7:
        e.step()  # it holds 7 of the 10 blocks: the 5 the import needs are not free
    assert e.add_remote_request("r", p + [9, 9], GREEDY) is None
    assert e.blocks.tiers.host.loaded == 0 and e.blocks.tier_hits == {}
    e.abort("busy")
    dest = e.add_remote_request("r", p + [9, 9], GREEDY)
    assert dest is not None and len(dest) == 1  # 4 blocks copied back, one to import
    assert e.blocks.tiers.host.loaded == 4 and e.blocks.tier_hits == {"host": 64}
    assert e.abort("r")
    assert_engine_clean(e)


def test_agent_sessions_that_outgrow_the_pool_compute_their_histories_once_with_tiers():
    """The agentic benchmark's pattern in one engine: 8 sessions, two in flight at a time, each
    turn resending its whole history plus a tool result, in a pool of 40 blocks (about 4 of
    the histories). Without tiers every turn recomputes its evicted history; with the host
    tier it is copied back: the same tokens, under half the tokens computed, no preemption
    either way, every block back."""
    loaded = tiny_llama(0)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    runs = []
    for host in (0, 1 << 24):
        e = engine(loaded, host=host, blocks=40, step_tokens=128)
        computed, schedule = [0], e.scheduler.schedule

        def counted(schedule=schedule, computed=computed):
            out = schedule()
            computed[0] += out.num_tokens
            return out
        e.scheduler.schedule = counted
        g = torch.Generator().manual_seed(3)
        history = [torch.randint(5, 250, (96,), generator=g).tolist() for _ in range(8)]
        outs = []
        for _turn in range(4):
            for pair in range(0, 8, 2):
                prompts = [history[s] + torch.randint(5, 250, (40,), generator=g).tolist() for s in (pair, pair + 1)]
                got = e.generate(prompts, params)
                outs.append(got)
                history[pair], history[pair + 1] = (p + o for p, o in zip(prompts, got))
        assert e.scheduler.preemptions == {"memory": 0, "priority": 0, "stopped": 0}
        assert_engine_clean(e)
        runs.append((outs, computed[0], e))
    (plain, computed_off, off), (tiered, computed_on, on) = runs
    assert tiered == plain
    assert 2 * computed_on < computed_off
    assert off.blocks.prefix_queries == on.blocks.prefix_queries  # each prompt counted once, both ways
    assert on.blocks.tier_hits["host"] == on.blocks.prefix_hits - off.blocks.prefix_hits > 0
    t = on.blocks.tiers
    assert t.host.entries == len(t._host) == t.host.stored - t.host.dropped
