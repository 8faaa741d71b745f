"""The suite's own clock (a pytest plugin, loaded by conftest.py): each test file's time (the
setup, call and teardown of its tests, so its module fixtures too) against its budget in
tests/budgets.toml, and the fixtures that slow tests waited on (`--durations` names only the
test). `tests/test_layout.py::test_every_test_file_keeps_within_its_time_budget` runs last
and fails with each file over its budget; the terminal summary lists the slow fixtures and the
slowest files; `.cache/test-times.json` keeps the figures of the last run that checked the
budgets."""
from __future__ import annotations

import json
import time
import tomllib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

BUDGETS = Path(__file__).with_name("budgets.toml")
SLOW_FIXTURE_S = 3.0  # a fixture's setup this long is named in the summary
PLUGIN = "pdserve-suite-clock"
BUDGET_TEST = "tests/test_layout.py::test_every_test_file_keeps_within_its_time_budget"
LOAD_LOOK_S = 5.0  # how often the machine's load is looked at while a file runs


def load_budgets(path: Path = BUDGETS) -> tuple[float, dict[str, float]]:
    """(default seconds, {test file: seconds}) from the budgets file."""
    data = tomllib.loads(path.read_text())
    return float(data["default"]), {k: float(v) for k, v in data.get("files", {}).items()}


def over_budget(times: dict[str, float], default: float, budgets: dict[str, float],
                stretch: dict[str, float] | None = None) -> list[str]:
    """Each file whose time is over its budget (stretched by the machine's load while it ran,
    `stretch`, 1 on a quiet machine), worst first, as 'file: N s, budget M s'."""
    stretch = stretch or {}
    out = []
    for name, took in times.items():
        allowed = budgets.get(name, default) * stretch.get(name, 1.0)
        if took > allowed:
            out.append((took - allowed, f"{name}: {took:.0f} s, budget {budgets.get(name, default):.0f} s"
                        + (f" (x{stretch[name]:.1f} for the machine's load)" if stretch.get(name, 1.0) > 1 else "")))
    return [line for _, line in sorted(out, reverse=True)]


@dataclass(eq=False)  # a plugin object must hash by identity
class SuiteClock:
    times: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    stretch: dict[str, float] = field(default_factory=dict)
    fixtures: list[tuple[float, str, str, str]] = field(default_factory=list)  # (s, fixture, scope, first test)
    _looks: dict[str, list[float]] = field(default_factory=dict)  # each file's load samples
    _looked: float = float("-inf")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        start = time.perf_counter()
        yield
        took = time.perf_counter() - start
        if took >= SLOW_FIXTURE_S:
            item = getattr(request, "_pyfuncitem", None)
            self.fixtures.append((took, fixturedef.argname, fixturedef.scope,
                                  item.nodeid if item is not None else request.node.nodeid))

    def pytest_runtest_logstart(self, nodeid, location):
        # the load while the file runs stretches its budget: looked at as it starts and then at most
        # every LOAD_LOOK_S (a look is a ~20 ms loop), its budget stretched by their mean
        name, now = nodeid.split("::")[0], time.monotonic()
        if name not in self._looks or now - self._looked >= LOAD_LOOK_S:
            from tests.helpers.ray_procs import slowness

            self._looks.setdefault(name, []).append(slowness())
            self._looked = now
            self.stretch[name] = sum(self._looks[name]) / len(self._looks[name])

    def pytest_runtest_logreport(self, report):
        self.times[report.nodeid.split("::")[0]] += report.duration

    def over(self) -> list[str]:
        default, budgets = load_budgets()
        return over_budget({k: v for k, v in self.times.items() if k != BUDGET_TEST.split("::")[0]},
                           default, budgets, self.stretch)

    def pytest_terminal_summary(self, terminalreporter):
        write = terminalreporter.write_line
        if self.fixtures:
            terminalreporter.section("slow fixtures (setup seconds, the test that waited)")
            for took, name, scope, nodeid in sorted(self.fixtures, reverse=True)[:25]:
                write(f"{took:8.1f}s  {name} ({scope})  {nodeid}")
        if self.times:
            default, budgets = load_budgets()
            terminalreporter.section("slowest test files (seconds, budget)")
            for name, took in sorted(self.times.items(), key=lambda kv: -kv[1])[:25]:
                write(f"{took:8.1f}s  {budgets.get(name, default):6.0f}  {name}")

    def pytest_sessionfinish(self, session):
        if not self.times or BUDGET_TEST.split("::")[0] not in self.times:
            return  # only a run with the budget check (the whole suite) replaces the last figures
        out = Path(session.config.rootpath) / ".cache" / "test-times.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps({"files": dict(sorted(self.times.items())), "stretch": self.stretch,
                                   "fixtures": sorted(self.fixtures, reverse=True)}, indent=1))


def pytest_configure(config):
    config.pluginmanager.register(SuiteClock(), PLUGIN)


def pytest_collection_modifyitems(config, items):
    """The budget check runs last: it reads every other file's time."""
    last = [i for i in items if i.nodeid == BUDGET_TEST]
    items[:] = [i for i in items if i.nodeid != BUDGET_TEST] + last
