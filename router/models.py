"""Several base models behind one endpoint: one `Router` per model (its tokenizer, workers,
chat template and metrics), and `ModelRouters`, which picks a request's Router by its
`model` (a base model's name, or one of its LoRA adapters: the adapter's parent's Router).

The pure core is `pick_model` (a model name and what each base serves -> the base's name,
or the API's 400/404); the rest is a thin shell over the Routers. With one model, every
request goes to its Router, which checks `model` itself as it always has.
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from .adapters import model_cards
from .errors import APIError


def pick_model(model: str | None, served: Mapping[str, set[str]]) -> str:
    """The base model whose Router serves `model`; `served`: each base model's name -> its
    adapters' names. 400 naming the choices when `model` is missing and several bases are
    served (as vLLM), 404 `model_not_found` naming every model and adapter served when it is
    none of them."""
    if len(served) == 1 and not model:
        return next(iter(served))
    everything = [n for base, adapters in served.items() for n in (base, *sorted(adapters))]
    if not model:
        raise APIError(400, f"this server serves several models: say which in `model` (one of "
                            f"{', '.join(repr(m) for m in everything)})", param="model", code="model_required")
    if model in served:
        return model
    for base, adapters in served.items():
        if model in adapters:
            return base
    raise APIError(404, f"the model {model!r} does not exist; this server serves "
                        f"{', '.join(repr(m) for m in everything)}", param="model", code="model_not_found")


class _MergedMetrics:
    """The models' router metrics as one exposition: the families of the same name joined, each
    sample labelled with its model (`model`; series that already name one keep theirs)."""

    def __init__(self, routers: Mapping[str, object]):
        self.routers = routers

    def collect(self):
        families: dict[str, Metric] = {}
        for name, router in self.routers.items():
            for fam in router.metrics.registry.collect():
                merged = families.get(fam.name)
                if merged is None:
                    merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for s in fam.samples:
                    has_model = "model" in s.labels or "model_name" in s.labels
                    merged.samples.append(s if has_model else s._replace(labels={"model": name} | s.labels))
        yield from families.values()


class ModelRouters:
    """The Routers of the served base models, by model name (the first: the cluster's
    settings, its admin pools)."""

    def __init__(self, routers: list):
        self.routers = {r.model_name: r for r in routers}
        if len(self.routers) != len(routers):
            raise ValueError("two served models have the same name")
        self.first = routers[0]
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_MergedMetrics(self.routers))

    @property
    def several(self) -> bool:
        return len(self.routers) > 1

    def served(self) -> dict[str, set[str]]:
        """Each base model's name -> the adapters its workers serve now."""
        return {name: set(r.cluster.adapters()) for name, r in self.routers.items()}

    def pick(self, model: str | None):
        """The Router of the request's `model` (see `pick_model`)."""
        if not self.several:
            return self.first
        return self.routers[pick_model(model, self.served())]

    def for_base(self, base: str | None, what: str = "base_model_name"):
        """The Router of the base model named `base` (an adapter change's); with one model,
        the body may leave it out."""
        if not base and not self.several:
            return self.first
        if base in self.routers:
            return self.routers[base]
        raise APIError(400 if not base else 404, f"say which base model in {what!r}: one of "
                       f"{', '.join(repr(m) for m in self.routers)}", param=what,
                       code="model_required" if not base else "model_not_found")

    def of_adapter(self, name: str, base: str | None):
        """The Router of the base model that serves adapter `name` (for an unload): the one
        named by `base`, else the one whose workers have it."""
        if base or not self.several:
            return self.for_base(base)
        return next((r for r in self.routers.values() if name in r.cluster.adapters()), self.first)

    def model_cards(self) -> list[dict]:
        return [c for r in self.routers.values()
                for c in model_cards(r.model_name, int(r.started), r.cluster.adapters())]

    def ready(self) -> bool:
        return all(r.cluster.ready() for r in self.routers.values())

    def workers(self) -> int:
        return sum(len(r.cluster.workers) for r in self.routers.values())

    def render_metrics(self) -> bytes:
        for r in self.routers.values():
            r.metrics.observe_workers(r.cluster.stats)
        if not self.several:
            return self.first.metrics.render()
        return generate_latest(self._registry)

    async def refresh_forever(self) -> None:
        await asyncio.gather(*(r.refresh_forever() for r in self.routers.values()))

    async def close(self) -> None:
        for r in self.routers.values():
            await r.close()
