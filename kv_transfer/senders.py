"""The KV sender a prefill worker uses: it pushes over whichever transport the decode
worker's KV address names (`ucx://host:port`: UCX; `host:port`: gRPC), so only decode
workers choose a transport (`--kv-transport`) and mixed clusters work during a change. A
decode pipeline's address (`stages:`, kv_transfer/stages.py) names each of its ranks' layers
and heads: the KV is cut by it and each rank gets its own part, the pushes at once."""
from __future__ import annotations

import asyncio

import torch

from pdserve.protos.security import TLSConfig

from .grpc_transport import GrpcKVSender
from .stages import SCHEME as STAGES
from .stages import pieces, targets
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
        """kv: the whole model's KV heads of layers [layer_start, layer_start + kv.shape[0])."""
        if not target.startswith(STAGES):
            return await self._sender(target).push(target, request_id, kv, **kw)
        start = kw.pop("layer_start", 0)
        shape = (max(ls.stop for ls, _, _ in targets(target, 0, 0)), kv.shape[4])
        await asyncio.gather(*(self._sender(addr).push(addr, request_id, piece, layer_start=lo, **kw,
                                                       **({"head_start": h0, "head_end": h1} if h1 else {}))
                               for addr, piece, lo, h0, h1 in pieces(kv, range(start, start + kv.shape[0]),
                                                                     range(kv.shape[4]), target, shape)))

    async def close(self) -> None:
        for s in self._senders.values():
            await s.close()
        self._senders.clear()
