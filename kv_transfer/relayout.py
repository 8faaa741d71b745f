"""Converting KV between block layouts: the prefill and decode pools may page their caches
with different block sizes (each tuned to its own hardware and workload), so a push carries
its sender's block size and the first token it holds, and the receiver re-blocks it."""
from __future__ import annotations

import torch


def reblock(kv: torch.Tensor, token_offset: int, first_token: int, num_tokens: int, block_size: int) -> torch.Tensor:
    """Re-page KV for tokens [first_token, num_tokens) into blocks of `block_size`.

    kv: (layers, 2, n, src_block_size, heads, head_dim), holding tokens from `token_offset`
    (a multiple of the sender's block size; its last block may be partly filled).
    Returns (layers, 2, ceil((num_tokens - first_token) / block_size), block_size, heads,
    head_dim); slots past `num_tokens` in the last block are never read (attention stops at
    the sequence length): zero when converted. Same layout and alignment: `kv` itself, no copy.
    """
    L, two, n, src_bs, h, d = kv.shape
    held = n * src_bs
    if not token_offset <= first_token <= num_tokens <= token_offset + held:
        raise ValueError(f"KV holds tokens [{token_offset}, {token_offset + held}), asked for "
                         f"[{first_token}, {num_tokens})")
    n_dst = -(-(num_tokens - first_token) // block_size)
    if src_bs == block_size and first_token == token_offset and n == n_dst:
        return kv
    tokens = kv.reshape(L, two, held, h, d)[:, :, first_token - token_offset:num_tokens - token_offset]
    out = kv.new_zeros((L, two, n_dst * block_size, h, d))
    out[:, :, :tokens.shape[2]] = tokens
    return out.view(L, two, n_dst, block_size, h, d)
