"""Whether the pools fit on a Ray cluster, said before anything waits on Ray: what each pool
asks of Ray (pure, tested without Ray), what a cluster has (`ray_resources`, the one call
into Ray), and the message that names the difference and the flags that give room.

Ray never refuses a request it cannot satisfy: an actor or placement group that asks for more
than the cluster has stays pending, silently, for ever. `pdserve up` and `pdserve scale` check
here first and answer at once instead."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.config import ClusterConfig, PoolConfig

EPS = 1e-9  # Ray's resource arithmetic is in fixed point of 1e-4; this only absorbs float noise


@dataclass(frozen=True)
class PoolDemand:
    """What `workers` new workers of one pool ask of Ray. A worker's ranks (tensor-parallel
    degree `ranks`) are one placement group packed on one node, so `per_worker` must fit on
    a single node, and `workers * per_worker` on the cluster."""
    role: str
    workers: int
    ranks: int
    per_worker: dict[str, float] = field(default_factory=dict)

    def total(self) -> dict[str, float]:
        return {k: v * self.workers for k, v in self.per_worker.items()}


@dataclass(frozen=True)
class RayResources:
    """A cluster's resources: `total` (all nodes), `free` (not held by actors or placement
    groups now) and each live node's total."""
    total: dict[str, float]
    free: dict[str, float]
    nodes: list[dict[str, float]]


def pool_demand(role: str, pool: PoolConfig, ranks: int, workers: int | None = None) -> PoolDemand:
    """The demand of `workers` (default: the pool's replicas) workers of `pool`, each of
    `ranks` ranks; every rank takes the pool's CPUs and GPUs, the worker one of its resource."""
    per = {"CPU": pool.num_cpus * ranks, "GPU": pool.num_gpus * ranks} | ({pool.resource: 1.0} if pool.resource else {})
    return PoolDemand(role, pool.replicas if workers is None else workers, ranks, {k: v for k, v in per.items() if v})


def cluster_demands(config: ClusterConfig) -> list[PoolDemand]:
    """Every pool of `config` (of each of its models) at its configured size."""
    return [pool_demand(role, pool, pool.ranks(c.engine))
            for c in config.model_clusters() for role, pool in c.pools().items()]


def local_ray_cpus(config: ClusterConfig, cores: int) -> int:
    """CPUs of the local Ray `pdserve up` starts: --ray-cpus, else this machine's cores;
    grown to what the one-rank workers ask, which take turns on the cores (and lend them to
    each other while idle). It is not grown for tensor-parallel workers: their ranks step in
    lockstep, so a rank waiting for a core stalls every other; more ranks than cores only
    when asked (--ray-cpus)."""
    one_rank = sum(d.total().get("CPU", 0.0) for d in cluster_demands(config) if d.ranks == 1)
    return math.ceil(max(config.ray_cpus or cores, one_rank) - EPS)


def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(resources.items())) or "nothing"


def _sum(demands: list[PoolDemand]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in demands:
        for k, v in d.total().items():
            out[k] = out.get(k, 0.0) + v
    return out


def _describe(d: PoolDemand) -> str:
    ranks = f" ({d.ranks} tensor-parallel ranks packed on one node)" if d.ranks > 1 else ""
    return f"{d.workers} {d.role} worker(s) of {_fmt(d.per_worker)} each{ranks}"


def placement_shortfall(demands: list[PoolDemand], has: RayResources, local: bool = True) -> str | None:
    """None when `demands` fit in what Ray has free, else a message for the user: what the
    pools need, what Ray has, and the flags that give room (`local`: the Ray is the one
    `pdserve up` started, which --ray-cpus sizes; else a cluster that was joined)."""
    demands = [d for d in demands if d.workers > 0 and d.per_worker]
    need = _sum(demands)
    short = sorted(k for k, v in need.items() if v > has.free.get(k, 0.0) + EPS)
    # no node big enough for one worker: it can never be placed, however much is free in all
    unpackable = [d for d in demands if not any(all(v <= node.get(k, 0.0) + EPS for k, v in d.per_worker.items())
                                                for node in has.nodes)]
    if not short and not unpackable:
        return None
    total, free = ({k: of.get(k, 0.0) for k in need} for of in (has.total, has.free))
    lines = [f"they need {_fmt(need)} in all: " + "; ".join(_describe(d) for d in demands) + ".",
             f"Ray has {_fmt(total)} (free: {_fmt(free)})"
             + (f" on {len(has.nodes)} nodes, the largest {_fmt(max(has.nodes, key=lambda n: n.get('CPU', 0)))}."
                if len(has.nodes) > 1 else ".")]
    if unpackable:
        lines.append("No node has room for one " + " or one ".join(f"{d.role} worker" for d in unpackable) + ".")
    lines.append(_room_hint(demands, need, has, short, unpackable, local))
    return " ".join(lines)


def _room_hint(demands: list[PoolDemand], need: dict[str, float], has: RayResources, short: list[str],
               unpackable: list[PoolDemand], local: bool) -> str:
    hints = []
    node_cpus = max((n.get("CPU", 0.0) for n in has.nodes), default=0.0)
    widest = max((d.per_worker.get("CPU", 0.0) for d in demands), default=0.0)
    if "CPU" in short or widest > node_cpus + EPS:
        cpus = math.ceil(need.get("CPU", 0.0) + has.total.get("CPU", 0.0) - has.free.get("CPU", 0.0) - EPS)
        if local:
            hints.append(f"--ray-cpus {cpus} (the local Ray's CPUs; more than the cores makes the workers share them)")
        fewer = _fewer_cpus(demands, min(has.free.get("CPU", 0.0) / need["CPU"], node_cpus / widest))
        if fewer:
            hints.append(f"fewer CPUs per worker: {fewer}")
        if any(d.ranks > 1 for d in demands):
            hints.append("a smaller " + " / ".join(f"--{d.role}-tp (or -ep, -pp)" for d in demands if d.ranks > 1))
    if "GPU" in short:
        gpus = " / ".join(f"--{d.role}-gpus" for d in demands)
        hints.append(f"fewer GPUs per worker ({gpus}) or nodes with GPUs")
    custom = [k for k in short if k not in ("CPU", "GPU")]
    if custom:
        hints.append(f"nodes that advertise {', '.join(custom)} (--prefill-resource / --decode-resource name it)")
    if not local:
        hints.append("or more nodes in the Ray cluster")
    return "Room: " + "; or ".join(hints) + "." if hints else ""


def _fewer_cpus(demands: list[PoolDemand], factor: float) -> str:
    """The --ROLE-cpus flags that shrink every pool's CPUs by `factor` ("" when that leaves
    none)."""
    if factor * min(d.per_worker.get("CPU", 1.0) / d.ranks for d in demands) < 0.01:
        return ""
    return " ".join(f"--{d.role}-cpus {math.floor(d.per_worker['CPU'] / d.ranks * factor * 100) / 100:g}"
                    for d in demands if d.per_worker.get("CPU"))


def ray_resources() -> RayResources:
    """What the connected Ray cluster has now."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    return RayResources(dict(ray.cluster_resources()), dict(ray.available_resources()), nodes)
