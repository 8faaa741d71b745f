"""Ray actor pools for the prefill and decode workers.

Each pool is a group of Ray actors with its own resource request, started and stopped on its
own. An actor loads the model itself (nothing big crosses Ray's object store) and hosts one
`HostedWorker`: its engine thread, gRPC services, KV events and registry heartbeat.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import threading
import time
from dataclasses import replace

import ray
from ray.exceptions import GetTimeoutError, RayError

from pdserve.config import ClusterConfig, PoolConfig, WorkerConfig


log = logging.getLogger("pdserve.deploy")


def _restore_priority() -> None:
    """Run at nice 0 where Ray started this worker lower (its default is 15, which starves a
    serving worker beside any ordinary process). Lowering niceness needs CAP_SYS_NICE; without
    it the worker says how to start the Ray nodes instead."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice <= 0:
        return
    try:  # Linux keeps a niceness per thread: every thread Ray started, and those to come from this one
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, int(tid), 0)
    except PermissionError:
        log.warning("this worker runs at nice %d (Ray's worker_niceness) and may not raise its priority: "
                    "start the Ray nodes with RAY_worker_niceness=0, or the worker gets a few percent of a "
                    "busy core", nice)


@ray.remote
class WorkerActor:
    """One worker in its own process. Async actor: the gRPC servers share its event loop."""

    def __init__(self, config: WorkerConfig):
        import torch

        from pdserve.common.threads import in_fresh_thread

        from .worker_host import HostedWorker, load_worker_model  # torch and the engine: the worker's process alone

        if config.host == "auto":  # multi-node: serve on this node's address, which other nodes reach
            config = replace(config, host=ray.util.get_node_ip_address())
        if config.core_share_dir:  # the workers of one node share cores: nodes may share a filesystem
            config = replace(config, core_share_dir=f"{config.core_share_dir}-{ray.get_runtime_context().get_node_id()}")
        self.config = config
        _restore_priority()
        if config.engine.num_threads:
            torch.set_num_threads(config.engine.num_threads)

        def build() -> HostedWorker:
            return HostedWorker(config, *load_worker_model(config.engine), exit_on_engine_death=True)

        # off this thread: the engine thread's OpenMP team must be the process's only one (common/threads.py)
        self.host = in_fresh_thread(build)
        self._record: dict | None = None
        self._starting: asyncio.Lock | None = None

    async def start(self) -> dict:
        """Start serving and registering (once); later calls return the same record. After
        Ray restarts a dead actor, the pool's supervisor calls this to bring it back."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._record is None:
                from pdserve.common.threads import single_threaded_here
                single_threaded_here()  # this loop's tensor ops (KV landing) must not open a 2nd OpenMP team
                record = await self.host.start()
                self._record = record.__dict__ | {"pid": os.getpid()}
        return self._record | {"registry_error": self.host.registry_error}

    async def stats(self) -> dict:
        e = self.host.engine
        return {"used_blocks": e.blocks.num_used_blocks, "unfinished": e.scheduler.num_unfinished}

    async def drain(self, timeout_s: float) -> bool:
        return await self.host.drain(timeout_s)

    async def stop(self) -> None:
        await self.host.stop()


class PoolScaleError(RuntimeError):
    """A pool could not be resized (new workers did not start)."""


class Pool:
    """A group of WorkerActors of one role, started, supervised and resized on its own."""

    def __init__(self, role: str, cluster: ClusterConfig, name_prefix: str = ""):
        """The pool of `role` in `cluster` (its size, resources and queues: cluster.pools()[role])."""
        self.role, self.cluster = role, cluster
        self.config: PoolConfig = cluster.pools()[role]
        self.name_prefix = name_prefix
        self.actors: list = []
        self.records: list[dict] = []
        self._down_since: list[float | None] = []
        self._next_index = 0
        self.groups: list = []  # each actor's placement group (None: one rank)
        # scale() and supervise_once() run on different threads; both change the lists
        self._lock = threading.Lock()

    @property
    def ranks(self) -> int:
        """The processes of each of this pool's workers (its tensor- or expert-parallel degree)."""
        return self.config.ranks(self.cluster.engine)

    def _new_actors(self, n: int) -> tuple[list, list]:
        """`n` new actors, and their placement groups (None for a worker of one rank)."""
        p, ranks = self.config, self.ranks
        opts = dict(num_cpus=p.num_cpus, num_gpus=p.num_gpus, max_restarts=p.max_restarts)
        if p.resource:
            opts["resources"] = {p.resource: 1}
        actors, groups = [], []
        for _ in range(n):  # ids are never reused: a removed worker's id stays retired
            worker_id = f"{self.name_prefix}{self.role}-{self._next_index}"
            worker = self.worker_config(worker_id)
            self._next_index += 1
            groups.append(self._placement_group(worker_id) if ranks > 1 else None)
            placed = opts
            if groups[-1] is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
                placed = opts | {"scheduling_strategy": PlacementGroupSchedulingStrategy(
                    groups[-1], placement_group_bundle_index=0)}
            actors.append(WorkerActor.options(**placed).remote(worker))
        return actors, groups

    def worker_config(self, worker_id: str) -> WorkerConfig:
        """A new worker's config: its pool's (KV dtype, degree, no speculation on prefill),
        torch threads following the pool's CPUs (each rank of a tensor- or expert-parallel
        worker gets them), and the cores shared with the other workers of its host."""
        c = self.cluster
        share = ""
        if c.share_cores and c.engine.device == "cpu" and self.ranks == 1:  # a directory per cluster and host
            cluster = c.registry.cluster_name.split("/")[0]  # every model's workers (cluster/model) share
            share = os.path.join(tempfile.gettempdir(), f"pdserve-cores-{cluster}")
        worker = c.worker(self.role, worker_id, core_share_dir=share)
        threads = worker.engine.num_threads or max(1, int(self.config.num_cpus)) * self.ranks
        return replace(worker, engine=replace(worker.engine, num_threads=threads))

    def _placement_group(self, worker_id: str):
        """A tensor- or expert-parallel worker's ranks are processes of its actor: a placement
        group of one bundle per rank, packed on one node, reserves their CPUs (and GPUs) there. The actor
        runs in the first bundle, which also holds the pool's resource; the group is removed
        with the actor (`remove_groups`)."""
        from ray.util.placement_group import placement_group

        p = self.config
        rank = {"CPU": p.num_cpus} | ({"GPU": p.num_gpus} if p.num_gpus else {})
        first = rank | ({p.resource: 1} if p.resource else {})
        return placement_group([first] + [rank] * (self.ranks - 1), strategy="STRICT_PACK", name=f"pdserve-{worker_id}")

    @staticmethod
    def remove_groups(groups: list) -> None:
        from ray.util.placement_group import remove_placement_group
        for g in groups:
            if g is not None:
                remove_placement_group(g)

    def launch(self) -> list:
        """Create the actors and ask them to start; returns the pending start results."""
        self.actors, self.groups = self._new_actors(self.config.replicas)
        return [a.start.remote() for a in self.actors]

    def wait(self, refs: list, log=lambda msg: None, every_s: float = 30.0) -> list[dict]:
        """The workers' records once all have started; every `every_s` until then, a line to
        `log` on how many are still loading or waiting to be placed (a model takes a while to
        load; a worker Ray cannot place waits for good, and the line says which)."""
        t0 = time.monotonic()
        while True:
            ready, pending = ray.wait(refs, num_returns=len(refs), timeout=every_s)
            if not pending:
                break
            unplaced = [g for g in self.groups if g is not None and not _placed(g)]
            log(f"{len(pending)} of {len(refs)} {self.role} worker(s) not started after "
                f"{time.monotonic() - t0:.0f}s" + (f" ({len(unplaced)} placement group(s) Ray has not placed: "
                                                     f"free {ray.available_resources().get('CPU', 0):g} CPU)"
                                                     if unplaced else " (loading)"))
        self.records = ray.get(refs)
        self._down_since = [None] * len(self.records)
        return self.records

    def start(self) -> list[dict]:
        return self.wait(self.launch())

    @property
    def size(self) -> int:
        return len(self.actors)

    def scale(self, n: int, drain_timeout_s: float = 60.0, start_timeout_s: float = 300.0) -> list[str]:
        """Grow to `n` workers (new ones load, start and register before this returns) or
        shrink to `n` (the newest ones drain: they refuse new requests and leave the registry,
        their requests in flight finish (or, after `drain_timeout_s`, migrate), then they
        stop). Returns a line per worker added or removed. Raises PoolScaleError if new
        workers do not start within `start_timeout_s` (no node has room for them)."""
        with self._lock:
            notes = []
            if n > len(self.actors):
                self._check_room(n - len(self.actors))
                added, groups = self._new_actors(n - len(self.actors))
                try:
                    records = ray.get([a.start.remote() for a in added], timeout=start_timeout_s)
                except (GetTimeoutError, RayError) as e:
                    for a in added:
                        ray.kill(a)
                    self.remove_groups(groups)
                    raise PoolScaleError(f"{len(added)} new {self.role} worker(s) did not start within "
                                         f"{start_timeout_s:g}s (no node with the resources they need?): {e}") from e
                self.actors += added
                self.groups += groups
                self.records += records
                self._down_since += [None] * len(added)
                notes += [f"{r['role']} worker {r['worker_id']} added (pid {r['pid']}) on {r['address']}"
                          + (f" (cannot reach the registry yet: {r['registry_error']})" if r["registry_error"] else "")
                          for r in records]
            elif n < len(self.actors):
                gone, records = self.actors[n:], self.records[n:]
                drained = ray.get([a.drain.remote(drain_timeout_s) for a in gone], timeout=drain_timeout_s + 60)
                self._stop_actors(gone)
                self.remove_groups(self.groups[n:])
                self.actors, self.records, self._down_since = self.actors[:n], self.records[:n], self._down_since[:n]
                self.groups = self.groups[:n]
                notes += [f"{r['role']} worker {r['worker_id']} removed after draining"
                          + ("" if ok else f" (requests still running after {drain_timeout_s:g}s were cut off)")
                          for r, ok in zip(records, drained)]
            return notes

    def _check_room(self, more: int) -> None:
        """Refuse at once to grow a local Ray cluster past its free resources: its actors would
        wait for room that never comes (a cluster joined with --ray-address may have an
        autoscaler that adds nodes, and is left to it)."""
        if self.cluster.ray_address:
            return
        from .placement import placement_shortfall, pool_demand, ray_resources

        short = placement_shortfall([pool_demand(self.role, self.config, self.ranks, more)], ray_resources())
        if short:
            raise PoolScaleError(f"no room for {more} more {self.role} worker(s): {short} (`pdserve up`'s flags)")

    def supervise_once(self, timeout_s: float = 1.0) -> list[str]:
        """Ask every actor to be started. An actor Ray restarted after its process died loads
        its model again; this starts its services, and it re-registers under its worker id
        (new incarnation, new address). Returns a line per worker that came back."""
        if not self._lock.acquire(blocking=False):
            return []  # being resized: next round
        try:
            return self._supervise(timeout_s)
        finally:
            self._lock.release()

    def _supervise(self, timeout_s: float) -> list[str]:
        refs = [a.start.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        notes = []
        for i, ref in enumerate(refs):
            if ref not in ready:
                if self._down_since[i] is None:
                    self._down_since[i] = time.monotonic()  # restarting, or stuck: not answering
                continue
            try:
                record = ray.get(ref)
            except RayError:  # dead for good (restarts used up), died again, or failed to start
                continue
            old = self.records[i]
            if record["pid"] != old["pid"] or record["incarnation"] != old["incarnation"]:
                since = self._down_since[i]
                took = f" after {time.monotonic() - since:.1f}s" if since is not None else ""
                notes.append(f"{record['role']} worker {record['worker_id']} restarted{took}: pid {old['pid']} -> "
                             f"{record['pid']}, {record['address']}")
                self.records[i] = record
            self._down_since[i] = None
        return notes

    @staticmethod
    def _stop_actors(actors: list, timeout_s: float = 30.0) -> None:
        """Ask the actors to stop, wait up to `timeout_s` for all of them, then kill them."""
        try:
            ray.get([a.stop.remote() for a in actors], timeout=timeout_s)
        except Exception:  # noqa: BLE001 - a dead or stuck actor is killed below
            pass
        for a in actors:
            ray.kill(a)

    def stop(self, timeout_s: float = 30.0) -> None:
        with self._lock:
            if self.actors:
                self._stop_actors(self.actors, timeout_s)
            self.remove_groups(self.groups)
            self.actors, self.records, self.groups = [], [], []


def stop_pools(pools: list[Pool], timeout_s: float) -> None:
    """Stop every pool's workers at once: one deadline for all, then they are killed."""
    with contextlib.ExitStack() as held:
        for pool in pools:
            held.enter_context(pool._lock)
        # workers that never started (still loading, or never placed) have nothing to finish
        started = [a for pool in pools if pool.records for a in pool.actors]
        for a in (a for pool in pools if not pool.records for a in pool.actors):
            ray.kill(a)
        if started:
            Pool._stop_actors(started, timeout_s)
        for pool in pools:
            pool.remove_groups(pool.groups)
            pool.actors, pool.records, pool.groups = [], [], []


def _placed(group) -> bool:
    """Whether Ray has placed a placement group (reserved its bundles)."""
    ready, _ = ray.wait([group.ready()], timeout=0)
    return bool(ready)


class RayPools:
    """The pools of this `pdserve up`, by role: the router's `PoolControl`
    (router/control.py), which the admin endpoint (POST /admin/scale) and the autoscaler act through."""

    def __init__(self, pools: list[Pool], log=lambda msg: None, max_replicas: int = 64):
        self.pools = {p.role: p for p in pools}
        self.log, self.max_replicas = log, max_replicas

    def sizes(self) -> dict[str, int]:
        return {role: p.size for role, p in self.pools.items()}

    def check(self, sizes: dict[str, int]) -> None:
        """Raise ValueError naming the first size this cluster cannot take."""
        for role, n in sizes.items():
            if role not in self.pools:
                raise ValueError(f"this cluster has no {role!r} pool (pools: {', '.join(self.pools)})")
            low = 0 if role == "prefill" else 1  # without prefill workers, decode workers prefill themselves
            if not isinstance(n, int) or not low <= n <= self.max_replicas:
                raise ValueError(f"{role} must be an integer in [{low}, {self.max_replicas}], got {n!r}")

    async def scale(self, sizes: dict[str, int]) -> dict[str, int]:
        self.check(sizes)
        for role, n in sizes.items():
            for note in await asyncio.to_thread(self.pools[role].scale, n):
                self.log(note)
        return self.sizes()
