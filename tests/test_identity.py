"""Identities bound to addresses: a registry record is served only if the worker behind its
address proves the cluster token over that record's worker id, role and address. Records
that point at a real worker under another id, role or address (directly, or through a relay
that forwards the router's probes byte for byte or rewrites them) are impostors: never
healthy, never routed to, never sent the token; the honest records serve as before."""
import asyncio

import grpc
import pytest

from pdserve.protos import worker_pb2 as pb
from pdserve.protos.security import ReplyCheck, WorkerIdentity, check_reply, stats_request, token_proof
from pdserve.router.cluster import ClusterClient, WorkerEndpoint
from tests.helpers.workers import PARAMS, PROMPTS, Cluster

TOKEN = "s3cret"


class Relay(grpc.GenericRpcHandler):
    """A gRPC server that forwards every call, as raw bytes, to `upstream` (a real worker):
    what whoever can write a registry record can run. `target`: the service it calls there
    ("": the one called here; a relay to a worker of another role rewrites it); `rewrite`: a
    function applied to each forwarded StatsRequest's bytes."""

    def __init__(self, upstream: str, target: str = "", rewrite=None):
        self.upstream, self.target, self.rewrite = upstream, target, rewrite
        self.calls: list[str] = []
        self.channel = None

    def _method(self, method: str) -> str:
        if not self.target:
            return method
        return f"/pdserve.worker.{self.target}/{method.rsplit('/', 1)[1]}"

    def service(self, details):  # grpc.GenericRpcHandler: every method, unparsed
        method = details.method
        self.calls.append(method.rsplit("/", 1)[1])
        if method.endswith("/Generate"):
            async def stream(request: bytes, context):
                async for msg in self.channel.unary_stream(self._method(method))(request):
                    yield msg
            return grpc.unary_stream_rpc_method_handler(stream)

        async def unary(request: bytes, context):
            if self.rewrite is not None and method.rsplit("/", 1)[1] in ("Stats", "CachedBlocks"):
                request = self.rewrite(request)
            try:
                return await self.channel.unary_unary(self._method(method))(request)
            except grpc.aio.AioRpcError as e:  # passed on as the worker said it
                await context.abort(e.code(), e.details())
        return grpc.unary_unary_rpc_method_handler(unary)

    async def start(self) -> str:
        self.channel = grpc.aio.insecure_channel(self.upstream)
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((self,))
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return f"127.0.0.1:{port}"

    async def stop(self) -> None:
        await self.server.stop(0)
        await self.channel.close()


def as_identity(who: WorkerIdentity):
    """A rewrite that makes the relayed probe name `who` (the worker behind the relay)."""
    def rewrite(raw: bytes) -> bytes:
        req = pb.StatsRequest.FromString(raw)
        req.worker_id, req.role, req.address = who.worker_id, who.role, who.address
        return req.SerializeToString()
    return rewrite


async def poll(records: list[WorkerEndpoint]) -> ClusterClient:
    client = ClusterClient(cluster_token=TOKEN, block_size=16)
    client.set_workers(records)
    await client.refresh()
    return client


def test_records_bound_to_another_identity_are_impostors_and_honest_ones_serve(make_engine):
    async def main():
        async with Cluster(make_engine, token=TOKEN) as c:
            d, p = c.decode.address, c.prefill.address
            relays = {"to-decode": Relay(d), "decode-as-prefill": Relay(p, target="PrefillService"),
                      "renamed": Relay(d, rewrite=as_identity(WorkerIdentity("decode-0", "decode", d))),
                      "anonymous": Relay(d, rewrite=as_identity(WorkerIdentity()))}
            at = {name: await r.start() for name, r in relays.items()}
            honest = [WorkerEndpoint("decode-0", "decode", d), WorkerEndpoint("prefill-0", "prefill", p)]
            forged = {
                "another id": WorkerEndpoint("decode-9", "decode", d),
                "another address (relay)": WorkerEndpoint("decode-0", "decode", at["to-decode"]),
                "another id and address (relay)": WorkerEndpoint("decode-7", "decode", at["to-decode"]),
                "another role (relay)": WorkerEndpoint("prefill-0", "decode", at["decode-as-prefill"]),
                "probe renamed by the relay": WorkerEndpoint("decode-8", "decode", at["renamed"]),
                "probe stripped by the relay": WorkerEndpoint("decode-6", "decode", at["anonymous"]),
            }
            seen = {}
            for why, rec in forged.items():  # each beside the honest records it does not replace
                client = await poll([rec] + [h for h in honest if h.worker_id != rec.worker_id])
                routes = [client.route(q) for q in PROMPTS] if client.ready() else []
                seen[why] = (client.healthy[rec.worker_id], rec.worker_id in client.impostors,
                             {r.decode.worker_id for r in routes} | {r.prefill.worker_id for r in routes if r.prefill})
                await client.close()
            client = await poll(honest)
            route = client.route(PROMPTS[0])
            outs = [m async for m in client.generate(route, "honest", PROMPTS[0], PARAMS[0])]
            client.release(route)
            await client.close()
            for r in relays.values():
                await r.stop()
        return seen, client, outs, {n: r.calls for n, r in relays.items()}

    seen, client, outs, calls = asyncio.run(main())
    for why, (healthy, impostor, routed_to) in seen.items():
        assert not healthy, why
        assert routed_to <= {"decode-0", "prefill-0"}, why  # only the honest workers get prompts
    # a token holder reached under another identity is named an impostor (a stripped or
    # rewritten probe no longer proves the token: the worker refuses it, and it is down)
    assert {why for why, (_, impostor, _) in seen.items() if impostor} == {
        "another id", "another address (relay)", "another id and address (relay)", "another role (relay)"}
    assert all("Generate" not in c for c in calls.values())  # no relay saw a request, nor the token
    assert client.healthy == {"decode-0": True, "prefill-0": True} and not client.impostors
    assert outs[-1].finished and sum(len(m.token_ids) for m in outs) == PARAMS[0].max_tokens


def test_a_worker_refuses_a_probe_that_names_another_worker_and_proves_its_own_identity(make_engine):
    async def main():
        async with Cluster(make_engine, token=TOKEN) as c:
            me = WorkerIdentity("decode-0", "decode", c.decode.address)
            req = stats_request(TOKEN, me)
            mine = await c.stub.Stats(req)
            snap = await c.stub.CachedBlocks(req)
            with pytest.raises(grpc.aio.AioRpcError) as other:
                await c.stub.CachedBlocks(stats_request(TOKEN, WorkerIdentity("decode-0", "decode", "10.0.0.9:1")))
            forged = stats_request(TOKEN, me)
            forged.address = "10.0.0.9:1"  # the identity changed after the proof was made
            with pytest.raises(grpc.aio.AioRpcError) as unproven:
                await c.stub.Stats(forged)
            anyone = stats_request(TOKEN)
            return req, mine, snap, other.value, unproven.value, anyone, await c.stub.Stats(anyone)

    req, mine, snap, other, unproven, anyone, any_reply = asyncio.run(main())
    assert check_reply(TOKEN, req, mine) is ReplyCheck.PROVEN and check_reply(TOKEN, req, snap) is ReplyCheck.PROVEN
    assert (mine.worker_id, mine.role, mine.address) == ("decode-0", "decode", req.address)
    assert other.code() == grpc.StatusCode.PERMISSION_DENIED and "this is worker decode-0" in other.details()
    assert unproven.code() == grpc.StatusCode.UNAUTHENTICATED
    # a probe that names no one is answered with the worker's own identity, proven
    assert check_reply(TOKEN, anyone, any_reply) is ReplyCheck.PROVEN
    # the reply is checked against the record the request named, and against the token
    elsewhere = stats_request(TOKEN, WorkerIdentity("decode-0", "decode", "10.0.0.9:1"))
    elsewhere.nonce = req.nonce
    assert check_reply(TOKEN, elsewhere, mine) is ReplyCheck.OTHER_WORKER
    assert check_reply("not-the-token", req, mine) is ReplyCheck.NO_TOKEN


def test_proofs_bind_every_field_without_ambiguity():
    nonce = b"n" * 16
    base = token_proof("t", "reply", nonce, WorkerIdentity("ab", "c", "d:1"))
    for other in (WorkerIdentity("a", "bc", "d:1"), WorkerIdentity("ab", "c", "d:2"), WorkerIdentity("ab", "", "d:1"),
                  WorkerIdentity("ab", "prefill", "d:1")):
        assert token_proof("t", "reply", nonce, other) != base, other
    assert token_proof("t", "request", nonce, WorkerIdentity("ab", "c", "d:1")) != base
