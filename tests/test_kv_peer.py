"""Peer prefix pulls (kv_transfer/peer.py): a worker pulls the KV of a prompt's prefix from a
peer that holds it, over real gRPC between real workers, and its tokens equal recomputing; a
pull that fails (wrong token, corrupted payload, hashes of another prefix, another cache salt,
a peer killed mid-way) computes the prefix and gives the same tokens; every block and every
tier entry is accounted for after each test. The decision and the router's choice of peer are
pure functions, tested here too."""
import asyncio

import grpc
import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.decode_worker.service import DecodeWorker
from pdserve.engine.core.async_engine import AsyncEngine
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.peer import PeerKVServicer, PullCounters
from pdserve.kv_transfer.pull_decision import RunningRate, pull_or_compute
from pdserve.protos import kv_transfer_pb2_grpc as kv_grpc
from pdserve.protos import worker_pb2 as pb
from pdserve.protos import worker_pb2_grpc as pb_grpc
from pdserve.protos.convert import params_to_proto
from pdserve.protos.security import SecurityConfig
from pdserve.router.policies import pick_peer
from pdserve.router.prefix_index import PrefixIndex
from pdserve.common.kv_events import BlockStored

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PREFIX = [(7 * j) % 400 + 5 for j in range(100)]  # 6 full blocks of 16, then 4 tokens
ALWAYS = TransferConfig(peer_pull="always", peer_timeout_s=3.0)


# ---- pure parts --------------------------------------------------------------------------------
def test_pull_when_the_transfer_beats_the_compute():
    # 10 blocks of 1 MB at 1 GB/s: 10 ms; 160 tokens at 1000 tok/s: 160 ms
    c = pull_or_compute(10, 1 << 20, 16, 1e9, 1000.0)
    assert c.pull and c.pull_s == pytest.approx(10 * (1 << 20) / 1e9) and c.compute_s == pytest.approx(0.16)
    assert not pull_or_compute(10, 1 << 20, 16, 1e7, 1000.0).pull  # a slow link: 1 s to pull, 0.16 s to compute
    assert not pull_or_compute(10, 1 << 20, 16, 1e9, 1e6).pull      # a fast prefill wins
    assert not pull_or_compute(1, 1000, 16, 1e9, 1000.0, overhead_s=0.1).pull  # the call's overhead counts
    assert not pull_or_compute(0, 1000, 16, 1e9, 1000.0).pull and not pull_or_compute(3, 1000, 16, 0, 1.0).pull


def test_running_rates_start_at_the_prior_and_follow_measurements():
    r = RunningRate(100.0, weight=0.5)
    assert r.value == 100.0
    r.observe(50, 0)  # nothing measured
    assert r.value == 100.0 and r.samples == 0
    r.observe(400, 2.0)  # the first measurement replaces the prior
    assert r.value == 200.0
    r.observe(100, 1.0)
    assert r.value == 150.0 and r.samples == 2


def test_the_router_names_the_peer_holding_most_of_the_prefix():
    index = PrefixIndex()
    seq = {}

    def stored(w, h, tier="device"):
        seq[w] = seq.get(w, 0) + 1
        index.apply(w, BlockStored(seq[w], h, 0, (), -1, tier))

    for h in (1, 2, 3):
        stored("a", h)
    for h in (1, 2, 3):
        stored("b", h, "host")
    stored("c", 1)
    holders = index.holders([1, 2, 3, 4])
    assert holders["a"] == (3, 3.0) and holders["b"] == (3, pytest.approx(2.7)) and holders["c"] == (1, 1.0)
    healthy = {"a", "b", "c"}
    assert pick_peer(holders, "c", healthy).worker_id == "a"  # the pool beats a host tier
    assert pick_peer(holders, "c", healthy - {"a"}).worker_id == "b"  # an unhealthy peer is skipped
    assert pick_peer(holders, "c", healthy - {"a"}).blocks == 3
    assert pick_peer(holders, "a", healthy) is None  # no one holds more than it does
    assert pick_peer(holders, "d", healthy).blocks == 3  # a worker holding none of it
    index.needs_resync.add("a")
    assert "a" not in index.holders([1, 2, 3])  # out of sync: not trusted


def test_the_route_names_a_peer_for_the_worker_that_computes_the_prompt():
    """The prefill worker computes the prompt: its peer is whoever holds more of the prefix (here
    the decode worker, whose events say it holds 3 blocks); a worker computing its own prompt
    (no prefill pool) gets the other decode worker; a salted prompt's blocks are others."""
    from pdserve.common.block_hash import hash_blocks
    from pdserve.router.cluster import ClusterClient, WorkerEndpoint

    prompt = list(range(60))
    hashes = hash_blocks(prompt, 16)
    c = ClusterClient(routing="least_loaded", block_size=16)
    c.set_workers([WorkerEndpoint("p0", "prefill", "a:1"), WorkerEndpoint("d0", "decode", "a:2")])
    c.healthy = {"p0": True, "d0": True}
    for i, h in enumerate(hashes):
        c.index.apply("d0", BlockStored(i + 1, h, 0, (), i))
    route = c.route(prompt)
    assert route.prefill.worker_id == "p0" and route.peer.worker_id == "d0" and route.peer_blocks == 3
    assert c.route(prompt, cache_salt="x").peer is None
    c.set_workers([WorkerEndpoint("d0", "decode", "a:2"), WorkerEndpoint("d1", "decode", "a:3")])
    c.healthy = {"d0": True, "d1": True}
    c.decode_streams = {"d0": 3}  # d0 is busy: the prompt goes to d1, which may pull from d0
    route = c.route(prompt)
    assert route.decode.worker_id == "d1" and route.prefill is None and route.peer.address == "a:2"


def test_round_robin_routes_name_the_holder_as_peer_for_the_other_worker():
    """Round robin alternates a prompt between two workers whatever they hold; the route that
    lands on the worker lacking the prefix names the holder (by its events) as its peer."""
    from pdserve.common.block_hash import hash_blocks
    from pdserve.router.cluster import ClusterClient, WorkerEndpoint

    prompt = list(range(60))
    c = ClusterClient(routing="round_robin", block_size=16)
    c.set_workers([WorkerEndpoint("d0", "aggregated", "a:1"), WorkerEndpoint("d1", "aggregated", "a:2")])
    c.healthy = {"d0": True, "d1": True}
    for i, h in enumerate(hash_blocks(prompt, 16)):
        c.index.apply("d1", BlockStored(i + 1, h, 0, (), i, "host"))  # in d1's host tier
    routes = [c.route(prompt) for _ in range(4)]
    assert [r.decode.worker_id for r in routes] == ["d0", "d1", "d0", "d1"]  # prefix-oblivious
    assert [(r.peer.worker_id, r.peer_blocks) if r.peer else None for r in routes] == [("d1", 3), None] * 2
    c.healthy["d1"] = False
    assert c.route(prompt).peer is None  # an unhealthy holder is not named


# ---- real workers ------------------------------------------------------------------------------
def assert_tiers_accounted(engine) -> None:
    """Every tier entry accounted for: what each tier holds is what it stored less what it dropped."""
    t = engine.blocks.tiers
    if t is None:
        return
    assert t.host.entries == len(t._host) == t.host.stored - t.host.dropped
    assert t.host.bytes == t.host.entries * t.block_bytes
    assert t.disk.entries == len(t._disk)


class Peers:
    """Two aggregated workers (each prefills its own prompts) over real gRPC; `b` pulls from `a`."""

    def __init__(self, make_engine, a_token="t", b_token="t", transfer=ALWAYS, a_kv=4 << 20):
        self.engines = [make_engine(kv_cache_memory=a_kv), make_engine()]
        self.a = DecodeWorker(AsyncEngine(self.engines[0]), "a", transfer=transfer,
                              security=SecurityConfig(cluster_token=a_token))
        self.b = DecodeWorker(AsyncEngine(self.engines[1]), "b", transfer=transfer,
                              security=SecurityConfig(cluster_token=b_token))
        self.tokens = {"a": a_token, "b": b_token}

    async def __aenter__(self):
        await self.a.start()
        await self.b.start()
        return self

    async def __aexit__(self, *exc):
        await self.b.stop()
        await self.a.stop()
        for e in self.engines:
            assert_tiers_accounted(e)

    async def generate(self, worker, prompt, params=GREEDY, peer="", peer_blocks=0):
        req = pb.GenerateRequest(request_id=f"r{id(prompt)}-{worker.worker_id}-{peer_blocks}", prompt_token_ids=prompt,
                                 params=params_to_proto(params), cluster_token=self.tokens[worker.worker_id],
                                 peer_address=peer, peer_worker_id="a" if peer else "", peer_blocks=peer_blocks)
        async with grpc.aio.insecure_channel(worker.address) as ch:
            return [t async for msg in pb_grpc.DecodeServiceStub(ch).Generate(req) for t in msg.token_ids]


def reference(make_engine, prompt, params=GREEDY):
    return make_engine().generate([prompt], [params])[0]


def test_a_pull_between_two_workers_equals_recomputing(make_engine):
    prompt = PREFIX + [9, 8, 7, 6, 5]
    want = reference(make_engine, prompt)

    async def go():
        async with Peers(make_engine) as p:
            await p.generate(p.a, PREFIX)  # a caches the prefix's 6 blocks
            got = await p.generate(p.b, prompt, peer=p.a.address, peer_blocks=6)
            assert p.b.pulls.pulls == 1 and p.b.pulls.blocks_pulled == 6 and p.b.pulls.failures == 0
            assert p.a.pulls.blocks_served == 6 and p.a.pulls.bytes_served == p.b.pulls.bytes_pulled > 0
            stats = await p.b.engine.stats()
            assert stats.prefix_hits >= 6 * 16  # started from the pulled blocks, not computed
            again = await p.generate(p.b, prompt, peer=p.a.address, peer_blocks=6)  # b holds them now: no pull
            assert p.b.pulls.pulls == 1 and again == got
            return got
    assert asyncio.run(go()) == want


def test_a_pull_from_the_peers_host_tier_and_a_partial_local_prefix(make_engine):
    """The peer's pool is too small to keep the prefix (it went to its host tier); the puller
    holds the first 2 blocks itself and pulls the other 4."""
    probe = make_engine()
    small = 9 * probe.kv_cache.bytes_per_block
    prompt = PREFIX + [1, 2, 3]
    want = reference(make_engine, prompt)

    async def go():
        async with Peers(make_engine, a_kv=small) as p:
            await p.generate(p.a, PREFIX)
            await p.generate(p.a, [500 - j for j in range(120)])  # evicts the prefix to a's host tier
            assert p.engines[0].blocks.tiers.host.entries > 0
            await p.generate(p.b, PREFIX[:40])  # b caches the first 2 blocks
            got = await p.generate(p.b, prompt, peer=p.a.address, peer_blocks=6)
            assert p.b.pulls.blocks_pulled == 4 and p.a.pulls.blocks_served == 4
            return got
    assert asyncio.run(go()) == want


class FaultyPeer(PeerKVServicer):
    """Worker a's real pull service on a port of its own, with one fault in its answers:
    "corrupt" flips a payload byte, "hashes" names other blocks, "stall" and "late" send the
    header and then nothing (the test kills a stalled peer meanwhile; a late one outlasts the
    pull's timeout)."""

    def __init__(self, worker, fault: str):
        super().__init__(worker.engine, worker.worker_id, worker.cluster_token, PullCounters())
        self.fault = fault
        self.sent_header = asyncio.Event()

    async def chunks(self, header, payload):
        if self.fault == "hashes":
            header.block_hashes[-1] ^= 1
        async for chunk in super().chunks(header, payload):
            if chunk.WhichOneof("kind") == "data" and self.fault == "corrupt":
                chunk.data = bytes([chunk.data[0] ^ 0x40]) + chunk.data[1:]
            yield chunk
            self.sent_header.set()
            if self.fault in ("stall", "late"):
                await asyncio.sleep(30)

    async def __aenter__(self):
        self.server = grpc.aio.server()
        kv_grpc.add_KVTransferServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()
        return self

    async def __aexit__(self, *exc):
        await self.server.stop(0)


@pytest.mark.parametrize("fault", ["wrong token", "corrupt", "hashes", "stall", "late", "salt", "gone"])
def test_a_failed_pull_computes_the_prefix_and_gives_the_right_answer(make_engine, fault):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, cache_salt="s" if fault == "salt" else "")
    prompt = PREFIX + [4, 4, 4]
    want = reference(make_engine, prompt, params)

    async def go():
        transfer = TransferConfig(peer_pull="always", peer_timeout_s=0.5) if fault == "late" else ALWAYS
        async with Peers(make_engine, a_token="other" if fault == "wrong token" else "t", transfer=transfer) as p:
            await p.generate(p.a, PREFIX)  # unsalted: a request salted "s" hashes to other blocks
            async with FaultyPeer(p.a, fault) as peer:
                address = {"wrong token": p.a.address, "salt": p.a.address, "gone": "127.0.0.1:1"}.get(fault, peer.address)
                if fault == "stall":  # the peer dies after its header: the pull fails at once, not at its timeout
                    asyncio.get_running_loop().call_later(0.3, lambda: asyncio.ensure_future(peer.server.stop(0)))
                got = await p.generate(p.b, prompt, params, peer=address, peer_blocks=6)
            # a peer that holds none of the blocks asked for (another salt's chain) is a miss, not a fault
            assert (p.b.pulls.misses, p.b.pulls.failures) == ((1, 0) if fault == "salt" else (0, 1))
            assert p.b.pulls.pulls == 0 and p.b.pulls.blocks_pulled == 0
            assert p.engines[1].blocks.owners() == []  # no block of the pull kept
            stats = await p.b.engine.stats()
            assert stats.prefix_hits == 0  # computed, nothing installed
            return got
    assert asyncio.run(go()) == want


def test_auto_skips_a_pull_that_costs_more_than_computing(make_engine):
    """With a prior that makes the link slow, "auto" computes the prefix (and counts the skip)."""
    slow = TransferConfig(peer_pull="auto", peer_gbps=1e-6)
    prompt = PREFIX + [3]
    want = reference(make_engine, prompt)

    async def go():
        async with Peers(make_engine, transfer=slow) as p:
            await p.generate(p.a, PREFIX)
            got = await p.generate(p.b, prompt, peer=p.a.address, peer_blocks=6)
            assert p.b.pulls.skipped == 1 and p.b.pulls.pulls == 0 and p.engines[1].blocks.owners() == []
            return got
    assert asyncio.run(go()) == want


def test_a_prefill_worker_pulls_the_prefix_the_router_named_for_it(make_engine):
    """Disaggregated: the decode worker passes the router's peer on to the prefill worker,
    which pulls the prefix from it, computes the rest and hands the KV off as usual."""
    from tests.helpers.workers import Cluster

    prompt = PREFIX + [2, 7, 1, 8]
    want = reference(make_engine, prompt)

    async def go():
        peer = DecodeWorker(AsyncEngine(make_engine()), "peer", transfer=ALWAYS)
        await peer.start()
        try:
            async with Cluster(make_engine) as c:
                c.prefill.peer.transfer = ALWAYS
                async with grpc.aio.insecure_channel(peer.address) as ch:  # the peer caches the prefix
                    req = pb.GenerateRequest(request_id="warm", prompt_token_ids=PREFIX, params=params_to_proto(GREEDY))
                    [m async for m in pb_grpc.DecodeServiceStub(ch).Generate(req)]
                req = pb.GenerateRequest(request_id="r", prompt_token_ids=prompt, params=params_to_proto(GREEDY),
                                         prefill_address=c.prefill.address, peer_address=peer.address,
                                         peer_worker_id="peer", peer_blocks=6)
                got = [t async for m in c.stub.Generate(req) for t in m.token_ids]
                assert c.prefill.pulls.blocks_pulled == 6 and peer.pulls.blocks_served == 6
                assert c.decode.remote_prefills == 1
                for e in (c.prefill_engine, c.decode_engine):
                    assert_tiers_accounted(e)
                return got
        finally:
            await peer.stop()
    assert asyncio.run(go()) == want


@pytest.mark.parametrize("routing", ["round_robin", "least_loaded"])
def test_prefix_oblivious_routing_still_names_the_holder_as_peer(make_engine, routing):
    """Under a policy that ignores prefixes the router still follows the workers' KV events:
    the prompt goes to the worker that lacks its prefix (round robin's turn, or the less loaded
    one), the route names the worker holding it as peer, and the worker pulls it over real gRPC
    instead of computing it; the tokens equal recomputing."""
    from pdserve.router.cluster import ClusterClient, WorkerEndpoint

    prompt = PREFIX + [6, 6, 6]
    want = reference(make_engine, prompt)

    async def go():
        client = ClusterClient(routing=routing, block_size=16, cluster_token="t")
        # each engine's KV events go straight into the router's index (Redis streams carry them in a cluster)
        workers = [DecodeWorker(AsyncEngine(make_engine(listener=lambda ev, w=w: client.index.apply(w, ev))), w,
                                transfer=ALWAYS, security=SecurityConfig(cluster_token="t")) for w in ("a", "b")]
        for w in workers:
            await w.start()
        try:
            client.set_workers([WorkerEndpoint(w.worker_id, "aggregated", w.address) for w in workers])
            client.healthy = {"a": True, "b": True}
            first = client.route(PREFIX)
            assert first.decode.worker_id == "a" and first.peer is None  # no one holds any of it yet
            [m async for m in client.generate(first, "first", PREFIX, GREEDY)]
            second = client.route(prompt)  # a still counts the first stream: least loaded is b too
            assert (second.decode.worker_id, second.peer.worker_id, second.peer_blocks) == ("b", "a", 6)
            got = [t async for m in client.generate(second, "second", prompt, GREEDY) for t in m.token_ids]
            for r in (first, second):
                client.release(r)
            assert workers[1].pulls.blocks_pulled == 6 and workers[0].pulls.blocks_served == 6
            assert workers[1].pulls.failures == 0
            return got
        finally:
            for w in workers[::-1]:
                await w.stop()
            await client.close()
    assert asyncio.run(go()) == want
