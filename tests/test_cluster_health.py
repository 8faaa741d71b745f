"""The router's view of worker health: a worker it cannot reach leaves the pool at once; one
that answers its Stats poll too slowly (a long engine step, a loaded machine) stays in until
it has been slow for a grace period, since it still serves the streams it has."""
from __future__ import annotations

import asyncio

import grpc

from pdserve.protos import worker_pb2 as pb
from pdserve.protos import worker_pb2_grpc as pb_grpc
from pdserve.protos.security import WorkerIdentity, token_proof
from pdserve.router.cluster import ClusterClient, WorkerEndpoint


class SlowStats(pb_grpc.DecodeServiceServicer):
    def __init__(self):
        self.delay_s = 0.0
        self.address = ""

    async def Stats(self, request, context):  # a worker of a cluster without a token: it proves ""
        await asyncio.sleep(self.delay_s)
        me = WorkerIdentity("d0", "decode", self.address)
        return pb.WorkerStats(worker_id="d0", role="decode", address=self.address, num_blocks=8, free_blocks=8,
                              proof=token_proof("", "reply", request.nonce, me))


def test_slow_polls_keep_a_worker_until_they_repeat_and_a_dead_one_leaves_at_once():
    async def main():
        servicer, server = SlowStats(), grpc.aio.server()
        pb_grpc.add_DecodeServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servicer.address = f"127.0.0.1:{port}"
        client = ClusterClient(stats_timeout_s=0.2, slow_grace_s=2.0)
        client.set_workers([WorkerEndpoint("d0", "decode", servicer.address)])
        seen = []
        try:
            await client.refresh()
            seen.append(client.healthy["d0"])
            servicer.delay_s = 0.5
            await client.refresh()  # slow since now
            seen.append(client.healthy["d0"])
            await client.refresh()  # ~0.2 s later: well within the grace period
            seen.append(client.healthy["d0"])
            await asyncio.sleep(2.0)
            await client.refresh()  # slow for over 2 s: out
            seen.append(client.healthy["d0"])
            servicer.delay_s = 0.0
            await client.refresh()
            seen.append(client.healthy["d0"])
            await server.stop(0)
            await client.refresh()
            seen.append(client.healthy["d0"])
        finally:
            await server.stop(0)
            await client.close()
        return seen

    # healthy; slow polls tolerated for the grace period, then out; back when it answers; gone when down
    assert asyncio.run(main()) == [True, True, True, False, True, False]
