"""How `make test` splits the suite over its two pytest workers (pytest-xdist, `-n 2`): a pytest
plugin (conftest.py loads it) whose scheduler hands each worker whole units, one at a time as
it runs dry, the longest first (so that the two finish together), and the budget check last.
A unit is a test file (its module fixtures are paid once), or every file of a shared cluster
(tests/helpers/shared_up.py: the cluster is started once, on one worker). A unit's expected
seconds are its files' times in the last full run (`.cache/test-times.json`), or their budgets
(tests/budgets.toml) on a fresh checkout."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.shared_up import FILES as SHARED_UP_FILES
from tests.timing import BUDGET_TEST, load_budgets

ROOT = Path(__file__).resolve().parents[2]


def unit_of(nodeid: str) -> str:
    """The unit a test runs in: the budget check alone, a shared cluster's files together, else
    its file."""
    if nodeid == BUDGET_TEST:
        return nodeid
    name = nodeid.split("::", 1)[0]
    return "shared default cluster" if name in SHARED_UP_FILES else name


def expected_seconds(root: Path = ROOT) -> dict[str, float]:
    """Each test file's expected seconds: the last full run's, or its budget."""
    default, budgets = load_budgets()
    last = root / ".cache" / "test-times.json"
    try:
        times = json.loads(last.read_text())["files"]
    except (OSError, ValueError, KeyError):
        times = {}
    return {**budgets, **times} | {"": default}


def order(units: dict[str, list[str]], seconds: dict[str, float]) -> list[str]:
    """The units longest first by their files' expected seconds, the budget check last."""
    def cost(unit: str) -> float:
        if unit == BUDGET_TEST:
            return float("-inf")
        files = {nodeid.split("::", 1)[0] for nodeid in units[unit]}
        return sum(seconds.get(f, seconds[""]) for f in files)
    return sorted(units, key=cost, reverse=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def schedule(self) -> None:
            first = self.collection is None
            if first and self._check_nodes_have_same_collection():
                # the work queue is built in collected order; put it in cost order before any is handed out
                self.config.option.loadscopereorder = False
                collection = next(iter(self.registered_collections.values()))
                units: dict[str, list[str]] = {}
                for nodeid in collection:
                    units.setdefault(unit_of(nodeid), []).append(nodeid)
                self._ranked = order(units, expected_seconds())
            super().schedule()

        def _assign_work_unit(self, node) -> None:
            rank = {unit: i for i, unit in enumerate(getattr(self, "_ranked", ()))}
            unit = min(self.workqueue, key=lambda u: rank.get(u, len(rank)))
            self.workqueue.move_to_end(unit, last=False)
            super()._assign_work_unit(node)

    return Units(config, log)
