"""In-process KV transfer: the tensor itself goes to the receiver (no serialization, no copy).
Used by the aggregated single-box mode and by tests; same checks as the network transports."""
from __future__ import annotations

import torch

from pdserve.common.errors import KVTransferError

from .receiver import KVReceiver
from .wire import make_header


class LocalKVSender:
    def __init__(self, receivers: dict[str, KVReceiver], sender_id: str = "local", cluster_token: str = ""):
        """receivers: target name -> the receiver of a decode engine in this process."""
        self.receivers = receivers
        self.sender_id = sender_id
        self.cluster_token = cluster_token

    async def push(self, target: str, request_id: str, kv: torch.Tensor, *, dest_block_ids: list[int],
                   num_tokens: int, first_token: int, model_fingerprint: str, timeout_s: float,
                   layer_start: int = 0, token_offset: int = 0, lora_identity: str = "",
                   head_start: int = 0, head_end: int = 0) -> None:
        receiver = self.receivers.get(target)
        if receiver is None:
            raise KVTransferError(f"no in-process KV receiver named {target!r}")
        header = make_header(request_id, kv, sender_id=self.sender_id, model_fingerprint=model_fingerprint,
                             dest_block_ids=dest_block_ids, num_tokens=num_tokens, first_token=first_token,
                             layer_start=layer_start, cluster_token=self.cluster_token,
                             token_offset=token_offset, lora_identity=lora_identity,
                             head_start=head_start, head_end=head_end)
        receiver.accept_tensor(header, kv)

    async def close(self) -> None:
        pass
