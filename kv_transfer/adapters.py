"""The LoRA adapters a worker serves, as it reports and changes them over gRPC.

Both worker services mix in `AdapterServicer`: `Stats` also lists the adapters the engine knows
(name, path, identity, resident, users: `WorkerStats.loras`), which the router folds into its
prefix index's hashes and its routing; `LoadLoRA` / `UnloadLoRA` are what the router's
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` call on every worker of the pools. The
engine's named errors become gRPC statuses the router turns back into JSON errors:
a bad adapter (`ModelLoadError`) INVALID_ARGUMENT, an unknown one NOT_FOUND, one in use or no
room (`LoRAInUseError`, `LoRACapacityError`) FAILED_PRECONDITION.

It lives beside the hand-off because both worker services share it, as they share the peer
pulls' service (peer.py), and because the adapter's identity it reports is the one every KV
hand-off header carries (`KVHeader.lora_identity`, checked by receiver.py).
"""
from __future__ import annotations

import grpc

from pdserve.common.errors import InvalidRequestError, ModelLoadError, PdserveError
from pdserve.protos import worker_pb2 as pb


def adapter_info(info) -> pb.LoRAAdapterInfo:
    """The wire's form of an engine `LoRAInfo`."""
    return pb.LoRAAdapterInfo(name=info.name, path=str(info.path), identity=info.identity,
                              resident=info.resident, users=info.users)


def grpc_status(e: PdserveError) -> grpc.StatusCode:
    """The status an adapter error answers with (see the module docstring)."""
    if isinstance(e, InvalidRequestError):  # LoRANotFoundError: code model_not_found
        return grpc.StatusCode.NOT_FOUND
    if isinstance(e, ModelLoadError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.FAILED_PRECONDITION


class AdapterServicer:
    """Adapter RPCs and stats of a worker service (mixed in before `WorkerServicer`); the worker
    provides `engine` (an AsyncEngine) and, if it serves one, `metrics_port`."""

    async def Stats(self, request, context):
        stats = await super().Stats(request, context)
        stats.loras.extend(adapter_info(i) for i in await self.w.engine.loras())
        stats.max_loras = self.w.engine.engine.config.lora.max_loras
        stats.metrics_port = getattr(self.w, "metrics_port", 0)
        return stats

    async def LoadLoRA(self, request: pb.LoRARequest, context) -> pb.LoRAReply:
        await self.check_token(request.cluster_token, context)
        try:
            info = await self.w.engine.load_lora(request.lora_name, request.lora_path)
        except PdserveError as e:
            await context.abort(grpc_status(e), str(e))
        return pb.LoRAReply(adapter=adapter_info(info))

    async def UnloadLoRA(self, request: pb.LoRARequest, context) -> pb.LoRAReply:
        await self.check_token(request.cluster_token, context)
        try:
            await self.w.engine.unload_lora(request.lora_name)
        except PdserveError as e:
            await context.abort(grpc_status(e), str(e))
        return pb.LoRAReply()
