"""What both worker services answer the same way: the cluster-token check, `Abort`,
`CachedBlocks` and `Stats`. Each service subclasses `WorkerServicer` together with its
generated servicer; the worker behind it provides `engine` (an AsyncEngine), `worker_id`,
`address` (where its services are registered), `cluster_token`, `forget(request_id)` and
`counters()`. Stats and CachedBlocks answer only a caller that proves the token and names this
worker (or none), and prove the token over this worker's identity in turn (protos/security.py)."""
from __future__ import annotations

from pdserve.protos import worker_pb2 as pb
from pdserve.protos.convert import block_snapshot, worker_stats
from pdserve.protos.security import WorkerIdentity, check_cluster_token, check_stats_request


class WorkerServicer:
    role = ""
    """"prefill" or "decode": the role its Stats report."""

    def __init__(self, worker):
        self.w = worker

    @property
    def identity(self) -> WorkerIdentity:
        return WorkerIdentity(self.w.worker_id, self.role, self.w.address)

    async def check_token(self, token: str, context) -> None:
        """Abort the call unless it carries the cluster token."""
        await check_cluster_token(self.w.cluster_token, token, context)

    async def Abort(self, request, context):
        await self.check_token(request.cluster_token, context)
        self.w.forget(request.request_id)
        return pb.AbortReply(found=await self.w.engine.abort(request.request_id))

    async def CachedBlocks(self, request, context):
        me = self.identity
        proof = await check_stats_request(self.w.cluster_token, request, context, me)
        snap = block_snapshot(*await self.w.engine.cached_blocks())
        snap.proof, snap.worker_id, snap.role, snap.address = proof, me.worker_id, me.role, me.address
        return snap

    async def Stats(self, request, context):
        me = self.identity
        proof = await check_stats_request(self.w.cluster_token, request, context, me)
        return worker_stats(await self.w.engine.stats(), me.worker_id, me.role, proof=proof, address=me.address,
                            **self.w.counters())
