"""The router's view of the LoRA adapters the cluster serves, and the admin changes to them.

What flows in: each worker's `WorkerStats.loras` (the adapters its engine knows, with their
identities, and whether their weights are resident), polled by `ClusterClient.refresh`; the
admin API's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`. What flows out: the
adapter a request's `model` names (`resolve_model`: "" for the base model, a 404
`model_not_found` naming the served models otherwise), the model cards of `/v1/models`
(adapters with `parent` = the base model), and LoadLoRA / UnloadLoRA calls on every worker.

An adapter loaded at run time is remembered (`AdapterAdmin.wanted`): a worker that starts
later, or comes back, is given it by `reconcile` after the next poll, so every worker of the
pools serves the same adapters. The pure parts (`served_adapters`, `resolve_model`,
`model_cards`) take plain data, so a test drives them without workers.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import grpc

from pdserve.protos import worker_pb2 as pb

from .errors import APIError

log = logging.getLogger("pdserve.router")


def served_adapters(stats: Mapping[str, pb.WorkerStats], healthy: Mapping[str, bool]) -> dict[str, pb.LoRAAdapterInfo]:
    """Adapter name -> its info, as the healthy workers report them (the first that does)."""
    out: dict[str, pb.LoRAAdapterInfo] = {}
    for wid in sorted(stats):
        if healthy.get(wid):
            for info in stats[wid].loras:
                out.setdefault(info.name, info)
    return out


def resident_on(stats: Mapping[str, pb.WorkerStats], name: str) -> set[str]:
    """The workers that hold adapter `name`'s weights loaded now (no load before its request)."""
    return {wid for wid, s in stats.items() if any(i.name == name and i.resident for i in s.loras)}


def resolve_model(model: str, base: str, adapters: Mapping[str, object]) -> str:
    """The adapter a request's `model` selects ("" for the base model); APIError 404 naming
    the served models when it is neither."""
    if model == base:
        return ""
    if model in adapters:
        return model
    served = ", ".join(repr(m) for m in [base, *sorted(adapters)])
    raise APIError(404, f"the model {model!r} does not exist; this server serves {served}",
                   param="model", code="model_not_found")


def model_cards(base: str, created: int, adapters: Mapping[str, pb.LoRAAdapterInfo]) -> list[dict]:
    """`/v1/models` entries: the base model, then each adapter with `parent` = the base (vLLM's)."""
    cards = [{"id": base, "object": "model", "created": created, "owned_by": "pdserve", "root": base,
              "parent": None}]
    cards += [{"id": name, "object": "model", "created": created, "owned_by": "pdserve", "root": info.path,
               "parent": base} for name, info in sorted(adapters.items())]
    return cards


def _api_error(e: grpc.aio.AioRpcError, name: str, worker_id: str) -> APIError:
    """A worker's refusal of an adapter change as the admin API's JSON error."""
    code = e.code()
    if code == grpc.StatusCode.NOT_FOUND:
        return APIError(404, f"adapter {name!r} is not loaded", param="lora_name", code="model_not_found")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(400, f"adapter {name!r} cannot be loaded: {e.details()}", param="lora_path",
                        code="invalid_adapter")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return APIError(409, f"adapter {name!r}: {e.details()}", code="adapter_in_use")
    return APIError(503, f"worker {worker_id} did not apply the change to adapter {name!r}: "
                         f"{code.name}: {e.details()}", "server_error", code="worker_failed")


class AdapterAdmin:
    """Applies adapter loads and unloads to every worker of the cluster and remembers them."""

    def __init__(self, cluster):
        """cluster: the router's ClusterClient (its workers, their stats and gRPC stubs)."""
        self.cluster = cluster
        self.wanted: dict[str, str] = {}  # loaded at run time: name -> directory
        self.unwanted: set[str] = set()   # unloaded at run time (a worker started with it drops it)
        self._refused: set[tuple[str, str, str]] = set()  # (worker, name, path) a reconcile failed on: not retried
        # one change at a time: a reconcile's list, made before an admin unload, would load the adapter back
        self._changing = asyncio.Lock()

    async def _on_all(self, method: str, name: str, path: str = "") -> list[tuple[str, object]]:
        """Call LoadLoRA / UnloadLoRA on every healthy worker: (worker id, reply or AioRpcError)."""
        workers = [w for w in self.cluster.workers.values() if self.cluster.healthy.get(w.worker_id)]
        if not workers:
            raise APIError(503, "no worker is available to apply the adapter change", "server_error",
                           code="no_worker")
        req = pb.LoRARequest(cluster_token=self.cluster.cluster_token, lora_name=name, lora_path=path)

        async def one(w):
            try:
                return w.worker_id, await getattr(self.cluster._stub(w), method)(req, timeout=60.0)
            except grpc.aio.AioRpcError as e:
                return w.worker_id, e
        return await asyncio.gather(*(one(w) for w in workers))

    async def load(self, name: str, path: str) -> str:
        """Load adapter `name` from directory `path` on every worker; raises APIError (the
        first worker's refusal) if any refuses it, after unloading it from those that took it."""
        if not name or not path:
            raise APIError(400, "lora_name and lora_path are both required", param="lora_name" if not name
                           else "lora_path", code="missing_field")
        async with self._changing:
            return await self._load(name, path)

    async def _load(self, name: str, path: str) -> str:
        results = await self._on_all("LoadLoRA", name, path)
        failed = [(wid, r) for wid, r in results if isinstance(r, grpc.aio.AioRpcError)]
        if failed:
            await self._on_all("UnloadLoRA", name)  # all or none: a half-loaded adapter would 404 by chance
            raise _api_error(failed[0][1], name, failed[0][0])
        self.wanted[name] = path
        self.unwanted.discard(name)
        await self.cluster.refresh()  # its identity, for the prefix index, before the next request
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str) -> str:
        """Unload adapter `name` from every worker; 404 if none knows it."""
        if not name:
            raise APIError(400, "lora_name is required", param="lora_name", code="missing_field")
        async with self._changing:
            return await self._unload(name)

    async def _unload(self, name: str) -> str:
        results = await self._on_all("UnloadLoRA", name)
        if all(isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.NOT_FOUND for _, r in results):
            raise _api_error(results[0][1], name, results[0][0])
        failed = [(wid, r) for wid, r in results if isinstance(r, grpc.aio.AioRpcError)
                  and r.code() != grpc.StatusCode.NOT_FOUND]
        self.wanted.pop(name, None)
        self.unwanted.add(name)
        await self.cluster.refresh()
        if failed:
            raise _api_error(failed[0][1], name, failed[0][0])
        return f"Success: LoRA adapter '{name}' removed successfully."

    async def reconcile(self) -> None:
        """Give each healthy worker the adapters loaded at run time that it lacks (it started
        later, or restarted), and take away those unloaded since it started. A change a worker
        refuses is logged once and not retried until that worker has been away (unhealthy)."""
        async with self._changing:
            for w in list(self.cluster.workers.values()):
                await self._reconcile(w)

    async def _reconcile(self, w) -> None:
        """One worker's share of `reconcile`."""
        s = self.cluster.stats.get(w.worker_id)
        if s is None or not self.cluster.healthy.get(w.worker_id):
            self._refused = {r for r in self._refused if r[0] != w.worker_id}
            return
        has = {i.name for i in s.loras}
        todo = [("LoadLoRA", n, p) for n, p in self.wanted.items() if n not in has]
        todo += [("UnloadLoRA", n, "") for n in self.unwanted & has]
        for method, name, path in todo:
            if (w.worker_id, name, path) in self._refused:
                continue
            try:
                await getattr(self.cluster._stub(w), method)(pb.LoRARequest(
                    cluster_token=self.cluster.cluster_token, lora_name=name, lora_path=path), timeout=60.0)
            except grpc.aio.AioRpcError as e:
                self._refused.add((w.worker_id, name, path))
                log.warning("%s of adapter %s on worker %s failed: %s", method, name, w.worker_id, e.details())
