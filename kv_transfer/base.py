"""One interface for every KV transport (gRPC, UCX, and in-process for single-box runs and
tests): push one request's blocks to a decode worker and raise on any failure."""
from __future__ import annotations

from typing import Protocol

import torch

from .wire import make_header, tensor_bytes


class KVSender(Protocol):
    async def push(self, target: str, request_id: str, kv: torch.Tensor, *, dest_block_ids: list[int],
                   num_tokens: int, first_token: int, model_fingerprint: str, timeout_s: float,
                   layer_start: int = 0, token_offset: int = 0, lora_identity: str = "",
                   head_start: int = 0, head_end: int = 0) -> None:
        """Deliver `kv` (layers, 2, n_blocks, block_size, n_kv_heads, head_dim), holding tokens
        from `token_offset` in the sender's block size, into `dest_block_ids` of the decode
        worker at `target` (re-blocked there if its block size differs); `lora_identity`: the
        adapter the KV was computed under ("": the base model), checked by the receiver. Raises
        KVTransferError when the receiver refuses it, the connection fails, or `timeout_s`
        passes."""

    async def close(self) -> None:
        """Release connections."""


class HeaderSender:
    """What every network sender does before its transport's part: the payload's bytes and
    the header that announces them (with this sender's id and the cluster token)."""

    sender_id: str
    cluster_token: str

    def framed(self, request_id: str, kv: torch.Tensor, *, dest_block_ids: list[int], num_tokens: int,
               first_token: int, model_fingerprint: str, layer_start: int = 0, token_offset: int = 0,
               lora_identity: str = "", head_start: int = 0, head_end: int = 0):
        """(header, payload) of one push."""
        payload = tensor_bytes(kv)
        header = make_header(request_id, kv, sender_id=self.sender_id, model_fingerprint=model_fingerprint,
                             dest_block_ids=dest_block_ids, num_tokens=num_tokens, first_token=first_token,
                             payload=payload, layer_start=layer_start, cluster_token=self.cluster_token,
                             token_offset=token_offset, lora_identity=lora_identity,
                             head_start=head_start, head_end=head_end)
        return header, payload
