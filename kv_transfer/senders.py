"""The KV sender a prefill worker uses: it pushes over whichever transport the decode
worker's KV address names (`ucx://host:port`: UCX; `host:port`: gRPC), so only decode
workers choose a transport (`--kv-transport`) and mixed clusters work during a change."""
from __future__ import annotations

import torch

from pdserve.protos.security import TLSConfig

from .grpc_transport import GrpcKVSender
from .ucx_transport import SCHEME as UCX_SCHEME


class SchemeKVSender:
    def __init__(self, sender_id: str, cluster_token: str = "", tls: TLSConfig | None = None):
        self.sender_id, self.cluster_token, self.tls = sender_id, cluster_token, tls
        self._senders: dict[str, object] = {}

    def _sender(self, target: str):
        kind = "ucx" if target.startswith(UCX_SCHEME) else "grpc"
        if kind not in self._senders:
            if kind == "ucx":
                from .ucx_transport import UcxKVSender
                self._senders[kind] = UcxKVSender(self.sender_id, self.cluster_token)
            else:
                self._senders[kind] = GrpcKVSender(self.sender_id, self.cluster_token, tls=self.tls)
        return self._senders[kind]

    async def push(self, target: str, request_id: str, kv: torch.Tensor, **kw) -> None:
        await self._sender(target).push(target, request_id, kv, **kw)

    async def close(self) -> None:
        for s in self._senders.values():
            await s.close()
        self._senders.clear()
