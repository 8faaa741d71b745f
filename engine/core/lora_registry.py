"""The engine's LoRA adapters by name: known ones (name -> directory), resident ones (loaded
onto the model, at most `LoRAConfig.max_loras`, least recently used first) and how many
unfinished requests use each.

A request takes its adapter at admission (`acquire`) and gives it back when it finishes
(`release`); an adapter in use is never dropped. Loading beyond the bound drops the least
recently used idle adapter's weights but remembers its directory: a later request naming it
loads it again (a new id; the same identity if the files did not change, so its cached
blocks still match). When every resident adapter is in use, another cannot come in:
`LoRACapacityError`, until a request finishes.

How the workers serve adapters (docs/adapters.md):
- at start, `EngineConfig(lora=LoRAConfig(max_loras=N, max_lora_rank=R, modules=((name, dir), ...)))`
  loads the `--lora-modules`; at run time the admin API calls `AsyncEngine.load_lora(name, dir)` /
  `unload_lora(name)` on every worker of the base model (`loras()` lists them, with identities);
- a request names its adapter with `add_request(..., lora=name)` (the API's `model` field when it
  names an adapter); prefill and decode workers must both be given it (a decode worker runs the
  request's decode steps under it, so the prefill worker's KV must come from the same adapter:
  the hand-off carries the adapter's identity and the receiver refuses another);
- a worker looking a prompt's blocks up itself (a local prefix check, a KV peer pull) starts the
  chain at `LLMEngine.cache_root(cache_salt, lora=name)`, and the router's prefix index needs
  the identities the workers report to compute the same hashes.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from pdserve.common.errors import InvalidRequestError, PdserveError
from pdserve.engine.config import LoRAConfig
from pdserve.engine.model.lora import LoRAAdapter, LoRAError, LoRAUnsupportedError, load_adapter

MAX_NAME = 256


class LoRANotFoundError(InvalidRequestError):
    """A request or an unload names an adapter this engine does not know (code
    "model_not_found", as OpenAI answers an unknown model)."""


class LoRACapacityError(PdserveError, RuntimeError):
    """Every resident adapter is in use by a request: another cannot be loaded until one of
    those finishes (retry later, or raise `max_loras`)."""


class LoRAInUseError(PdserveError, RuntimeError):
    """An adapter cannot be unloaded or replaced while requests use it."""


@dataclass(frozen=True)
class LoRAInfo:
    """What `LoRARegistry.adapters` says of one known adapter."""

    name: str
    path: str
    resident: bool
    users: int        # unfinished requests using it
    id: int = 0       # of its resident copy (0: not resident)
    rank: int = 0
    identity: str = ""  # as of its latest load (LoRAAdapter.identity)


class LoRARegistry:
    """Adapters of one engine's model (see the module docstring)."""

    def __init__(self, config: LoRAConfig, model, model_config, dtype, device):
        """`model`: the fused base model (LlamaForCausalLM) the adapters apply to; when it is
        rank 0's slice of a tensor-parallel group, every rank holds its part of each resident
        adapter (engine/parallel/lora.py)."""
        self.config, self.model, self.model_config = config, model, model_config
        # rank 0's side of a tensor-parallel group's adapters (engine/parallel/lora.GroupAdapters)
        self._ranks = getattr(model, "lora_ranks", None)
        self.dtype, self.device = dtype, device
        self._paths: dict[str, Path] = {}
        self._resident: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self._users: dict[str, int] = {}
        self._identities: dict[str, str] = {}  # of each known adapter's latest load (kept when dropped)
        self._ids = itertools.count(1)
        self.loads = self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.config.max_loras > 0

    def load(self, name: str, path: str | Path) -> LoRAAdapter:
        """Load the adapter in directory `path` as `name` (replacing an idle one of that name).
        Raises a `LoRAError` for a bad adapter, `LoRAInUseError` if `name` is in use,
        `LoRACapacityError` if every resident adapter is in use."""
        if not self.enabled:
            raise LoRAError("LoRA is off on this engine: set lora.max_loras (--max-loras) above 0")
        if not isinstance(name, str) or not name or len(name) > MAX_NAME or name != name.strip():
            raise LoRAError(f"an adapter name is a non-empty string of at most {MAX_NAME} characters "
                            f"without surrounding spaces, got {name!r}")
        if self._users.get(name):
            raise LoRAInUseError(f"adapter {name!r} is in use by {self._users[name]} request(s): "
                                 "load it under another name, or unload it once they finish")
        old_path, old = self._paths.pop(name, None), self._resident.pop(name, None)
        try:
            adapter = self._load(name, Path(path))
        except BaseException:  # a failed replacement keeps the adapter it would have replaced
            if old_path is not None:
                self._paths[name] = old_path
            if old is not None:
                self._resident[name] = old
                self._restore(name)
            raise
        self._paths[name] = Path(path)
        return adapter

    def unload(self, name: str) -> None:
        """Forget adapter `name` (its weights and its directory). Raises LoRANotFoundError,
        or LoRAInUseError while requests use it."""
        if name not in self._paths:
            raise self._not_found(name)
        if self._users.get(name):
            raise LoRAInUseError(f"adapter {name!r} is in use by {self._users[name]} request(s): "
                                 "unload it once they finish")
        del self._paths[name]
        dropped = self._resident.pop(name, None)
        self._users.pop(name, None)
        self._identities.pop(name, None)
        if dropped is not None:
            self._sync()

    def acquire(self, name: str) -> LoRAAdapter:
        """The resident adapter `name` for a new request (loaded again if it was dropped),
        counted as in use until `release`."""
        if name not in self._paths:
            raise self._not_found(name)
        adapter = self._resident.get(name)
        if adapter is None:
            adapter = self._load(name, self._paths[name])
        self._resident.move_to_end(name)
        self._users[name] = self._users.get(name, 0) + 1
        return adapter

    def release(self, adapter: LoRAAdapter) -> None:
        """A request using `adapter` finished."""
        n = self._users.get(adapter.name, 0)
        assert n > 0, f"adapter {adapter.name!r} released more often than acquired"
        self._users[adapter.name] = n - 1

    def identity(self, name: str) -> str:
        """Adapter `name`'s identity (`LoRAAdapter.identity`, as of its latest load: the root
        of its requests' block hashes); LoRANotFoundError if unknown."""
        if name not in self._paths:
            raise self._not_found(name)
        return self._identities[name]

    def get(self, name: str) -> LoRAAdapter | None:
        """The resident adapter `name`, or None (no load, no use counted)."""
        return self._resident.get(name)

    def adapters(self) -> list[LoRAInfo]:
        """Every known adapter, resident ones in least-recently-used order first."""
        out = []
        for name in list(self._resident) + [n for n in self._paths if n not in self._resident]:
            a = self._resident.get(name)
            out.append(LoRAInfo(name, str(self._paths[name]), a is not None, self._users.get(name, 0),
                                a.id if a else 0, a.rank if a else 0, self._identities[name]))
        return out

    @property
    def in_use(self) -> int:
        """Unfinished requests holding an adapter."""
        return sum(self._users.values())

    def _load(self, name: str, path: Path) -> LoRAAdapter:
        """Read the adapter and make it resident, dropping the least recently used idle one
        if the bound is reached (checked first: a full registry does not read the files)."""
        if len(self._resident) >= self.config.max_loras and self._idle() is None:
            raise LoRACapacityError(f"all {self.config.max_loras} resident adapters are in use by requests: "
                                    f"adapter {name!r} can load once one of them finishes")
        if self.model.model.layers[0].self_attn.qkv_weight is None:
            raise LoRAUnsupportedError("LoRA needs the fused model (LlamaForCausalLM.fuse)")
        cfg, split = (self.model_config, None) if self._ranks is None else self._ranks.source()
        adapter = load_adapter(name, path, cfg, self.config.max_lora_rank, self.dtype, self.device, split=split)
        if len(self._resident) >= self.config.max_loras:
            del self._resident[self._idle()]
            self.evictions += 1
        adapter.id = next(self._ids)
        self._resident[name] = adapter
        try:
            self._sync()
        except LoRAError:  # a rank could not load it: no rank keeps it
            del self._resident[name]
            self._sync()
            raise
        self._identities[name] = adapter.identity
        self.loads += 1
        assert len(self._resident) <= self.config.max_loras
        return adapter

    def _sync(self) -> None:
        """Every rank of the tensor-parallel group holds its part of exactly the resident adapters."""
        if self._ranks is not None:
            self._ranks.sync(list(self._resident.values()))

    def _restore(self, name: str) -> None:
        """The other ranks take back the adapter `name` a failed replacement restored here; if
        they cannot, it stays known but not resident (a request loads it again)."""
        try:
            self._sync()
        except LoRAError:
            self._resident.pop(name)
            self._sync()

    def _idle(self) -> str | None:
        """The least recently used resident adapter no request uses."""
        return next((n for n in self._resident if not self._users.get(n)), None)

    def _not_found(self, name: str) -> LoRANotFoundError:
        known = ", ".join(sorted(self._paths)) or "none"
        return LoRANotFoundError(f"unknown LoRA adapter {name!r} (loaded: {known})", param="lora",
                                 code="model_not_found")
