"""A pipeline group's ranks each moving their own part of a KV hand-off (PPKVCache's side of
kv_transfer/stages.py): no rank gathers the whole model's KV.

Prefill: `ship` has every rank push its own rectangle (its stage's layers; under PP x TP its
KV heads, one rank per distinct head range) straight to the receivers of the decode worker's
address that own parts of it, each from its own process, at once; rank 0 collects every
rank's result (bytes sent, or a failure) and raises KVTransferError if one failed.

Decode: `serve_kv` starts a KV server on every other rank for its own rectangle (rank 0's is
the worker's own), `expect_kv` hands them a request's lease (`drop_kv` takes it back), and
an import of rank 0's part alone (`import_blocks` with rank 0's shape) has every rank take
its own arrival by the request's blocks and write it, rank 0 raising if one is missing.

The engine may not import the worker layers (tests/test_layout.py), so the network side
comes as a module of pdserve.kv_transfer: rank 0 gets it from its worker, and the other ranks
import it by the name rank 0 sends (authenticated, and only under that package).
"""
from __future__ import annotations

import importlib
import sys

import torch

from pdserve.common.errors import KVTransferError
from pdserve.engine.kv.cache import KVCache

COMMANDS = ("ship", "serve_kv", "expect_kv", "drop_kv", "take_kv")  # what the other ranks run on rank 0's word
PACKAGE = "pdserve.kv_transfer."
TAKE_WAIT_S = 10.0  # how long a rank waits for its part at import (it came before the prefill answered)


def _module(name: str):
    if not name.startswith(PACKAGE):
        raise KVTransferError(f"a pipeline rank loads its KV endpoint from {PACKAGE}*, not {name!r}")
    return importlib.import_module(name)


class StagedHandoff:
    """PPKVCache's hand-off by parts (uses its group, spans, heads, owners, full and settle)."""

    endpoint = None  # a decode rank's own KV server (kv_transfer/stages.StageEndpoint), once served
    shipped = 0  # KV bytes this rank pushed itself
    last_ship: list[int] | None = None  # rank 0: the bytes each rank pushed in the last `ship`

    def part_of(self, r: int) -> tuple[range, range]:
        """Rank r's rectangle: the whole model's layers and KV heads it holds."""
        h = self.heads[r]
        return range(self.spans[r].start, self.spans[r].stop), range(h.start, h.stop)

    @property
    def own(self) -> tuple[range, range]:
        return self.part_of(self.group.rank)

    def _results(self) -> list[int]:
        """Rank 0: one number from every other rank, in rank order (under tag 0, as its parts came)."""
        return [int(self.group.recv((1,), torch.int64, r)[0]) for r in range(1, self.group.world)]

    def _answer(self, n: int) -> None:
        self.group.send(torch.tensor([n], dtype=torch.int64), 0)

    def ship(self, block_ids: list[int], meta: str, module) -> int:
        """Push the blocks' KV, every rank its own part (kv_transfer/stages.ship_part with
        `meta`); `module`: that module (rank 0), its name (the others). Rank 0: the bytes all
        ranks sent; KVTransferError if a rank failed (after every rank answered)."""
        g = self.group
        if g.rank == 0:
            if self.settle is not None:  # the results come under tag 0, as activations do
                self.settle()
            g.broadcast(("ship", block_ids, meta, module.__name__))
        sent, error = -1, None
        try:
            mine = module if g.rank == 0 else _module(module)
            sent = 0
            if g.rank % self.width in self.owners:  # one rank of each replicated KV head sends it
                sent = mine.ship_part(KVCache.export_blocks(self, block_ids), *self.own,
                                      (self.full.num_hidden_layers, self.full.num_key_value_heads), meta)
        except Exception as e:  # noqa: BLE001 -- every rank answers, whatever failed (tag 0 is the activations')
            sent, error = -1, e
            if g.rank:
                print(f"pdserve pipeline rank {g.rank}: KV hand-off: {e!r}", file=sys.stderr, flush=True)
        self.shipped += max(sent, 0)
        if g.rank:
            return self._answer(sent)
        results = self.last_ship = [sent] + self._results()
        failed = [r for r, n in enumerate(results) if n < 0]
        if failed:
            raise KVTransferError(f"KV push of pipeline rank(s) {failed} failed" + (f": {error}" if error else "")) \
                from error
        return sum(results)

    def serve_kv(self, meta: str, module) -> list[tuple[range, range, int]] | None:
        """Start every other rank's KV server (kv_transfer/stages.StageEndpoint with `meta`).
        Rank 0: (layers, heads, port) of every rank but itself (which serves with its worker)."""
        g = self.group
        if g.rank == 0:
            if self.settle is not None:  # the ports come under tag 0
                self.settle()
            g.broadcast(("serve_kv", meta, module.__name__))
            ports = self._results()
            if min(ports, default=0) <= 0:
                raise KVTransferError(f"a pipeline rank could not serve KV (ports {ports})")
            return [(*self.part_of(r), p) for r, p in enumerate(ports, 1)]
        port = -1
        if self.endpoint is not None:  # a worker started again on the same group
            self.endpoint.stop()
        try:
            self.endpoint = _module(module).StageEndpoint(meta, self.layout, self.format.name, self.own)
            port = self.endpoint.port
        except Exception as e:  # noqa: BLE001 -- told to rank 0, which refuses to start
            print(f"pdserve pipeline rank {g.rank}: KV server: {e!r}", file=sys.stderr, flush=True)
        self._answer(port)

    def expect_kv(self, request_id: str, dest_block_ids: list[int], num_tokens: int, timeout_s: float,
                  first_token_index: int, lora_identity: str) -> None:
        """Hand every other rank's receiver the request's lease (rank 0's is its worker's)."""
        if self.group.rank == 0:
            self.group.broadcast(("expect_kv", request_id, dest_block_ids, num_tokens, timeout_s, first_token_index,
                                  lora_identity))
        elif self.endpoint is not None:
            self.endpoint.receiver.expect(request_id, dest_block_ids, num_tokens, timeout_s,
                                          first_token_index=first_token_index, lora_identity=lora_identity)

    def drop_kv(self, request_id: str) -> None:
        """Drop the request's lease on every other rank (its hand-off failed or was left)."""
        if self.group.rank == 0:
            self.group.broadcast(("drop_kv", request_id))
        elif self.endpoint is not None:
            self.endpoint.receiver.cancel(request_id)

    def take_kv(self, block_ids: list[int], data: torch.Tensor | None = None) -> None:
        """Write a hand-off's KV into the blocks, every rank its own part: rank 0 `data`, the
        others their arrivals of these blocks. Rank 0 raises if a rank's part is missing."""
        g = self.group
        if g.rank != 0:
            ok = 0
            try:
                arrival = None if self.endpoint is None else self.endpoint.receiver.take_blocks(block_ids, TAKE_WAIT_S)
                if arrival is not None:
                    KVCache.import_blocks(self, block_ids, arrival.kv)
                    ok = 1
            except Exception as e:  # noqa: BLE001 -- told to rank 0
                print(f"pdserve pipeline rank {g.rank}: KV import: {e!r}", file=sys.stderr, flush=True)
            return self._answer(ok)
        layers, heads = self.own
        expected = (len(layers), 2, len(block_ids), self.block_size, len(heads), self.kv.shape[-1])
        if tuple(data.shape) != expected or data.dtype != self.kv.dtype:
            raise KVTransferError(f"KV data of rank 0 has shape {tuple(data.shape)} and dtype {data.dtype}, "
                                  f"expected {expected} and {self.kv.dtype}")
        if self.settle is not None:
            self.settle()
        g.broadcast(("take_kv", block_ids))
        try:
            KVCache.import_blocks(self, block_ids, data)
        finally:
            results = self._results()
        missing = [r for r, ok in enumerate(results, 1) if ok != 1]
        if missing:
            raise KVTransferError(f"the KV of pipeline rank(s) {missing} did not arrive")
