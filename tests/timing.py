"""The suite's own clock (a pytest plugin, loaded by conftest.py): each test file's time (the
setup, call and teardown of its tests, so its module fixtures too) against its budget in
tests/budgets.toml, and the fixtures that slow tests waited on (`--durations` names only the
test). `tests/test_layout.py::test_every_test_file_keeps_within_its_time_budget` runs last
and fails with each file over its budget; the terminal summary lists the slow fixtures and the
slowest files; `.cache/test-times.json` keeps the figures of the last run that checked the
budgets. Under pytest workers (xdist) each worker's clock writes its figures to a directory the
controller made (`pytest_configure_node`), so that the budget check, on one worker, waits for the
other workers' last tests and reads their files' times too."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
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
SHARED_KEY = "pdserve_suite_clock"  # the shared directory's key in a worker's workerinput
WAIT_FOR_WORKERS_S = 1800.0  # the budget check's wait for the other workers' last tests


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


@dataclass
class Figures:
    """A run's figures: seconds and load stretch per file, slow fixtures, finished nodeids."""
    times: dict[str, float]
    stretch: dict[str, float]
    fixtures: list[tuple[float, str, str, str]]
    done: set[str]


@dataclass(eq=False)  # a plugin object must hash by identity
class SuiteClock:
    """Each file's seconds and load stretch, and the slow fixtures, of the tests this process ran
    (a worker's, or the whole run's without workers). `shared`: the directory where workers'
    clocks keep their figures (None without workers); `worker`: this worker's id."""
    times: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    stretch: dict[str, float] = field(default_factory=dict)
    fixtures: list[tuple[float, str, str, str]] = field(default_factory=list)  # (s, fixture, scope, first test)
    shared: Path | None = None
    worker: str | None = None
    done: set[str] = field(default_factory=set)  # nodeids whose teardown was reported
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
        # every LOAD_LOOK_S (a look is a ~20 ms loop), its budget stretched by their mean; with
        # workers, each looks at its own files (the controller does not)
        if self.shared is not None and self.worker is None:
            return
        name, now = nodeid.split("::")[0], time.monotonic()
        if name not in self._looks or now - self._looked >= LOAD_LOOK_S:
            from tests.helpers.ray_procs import slowness

            self._looks.setdefault(name, []).append(slowness())
            self._looked = now
            self.stretch[name] = sum(self._looks[name]) / len(self._looks[name])

    def pytest_runtest_logreport(self, report):
        self.times[report.nodeid.split("::")[0]] += report.duration
        if report.when == "teardown":
            self.done.add(report.nodeid)
            if self.worker is not None:
                self._publish()

    def _publish(self) -> None:
        record = {"times": self.times, "stretch": self.stretch, "fixtures": self.fixtures, "done": sorted(self.done)}
        tmp = self.shared / f".{self.worker}.json"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.shared / f"{self.worker}.json")  # a reader never sees half a record

    def _records(self) -> list[dict]:
        # (pathlib's glob also matches the dot-named files a record is written to first)
        return [json.loads(f.read_text()) for f in sorted(self.shared.glob("gw*.json"))] if self.shared else []

    def gather(self, expect: set[str] = frozenset(), timeout: float = WAIT_FOR_WORKERS_S) -> Figures:
        """The workers' figures together, once the tests `expect` have all finished on some worker
        (waiting up to `timeout` s); without workers, this clock's own."""
        if self.shared is None:
            return Figures(dict(self.times), dict(self.stretch), list(self.fixtures), set(self.done))
        deadline = time.monotonic() + timeout
        while True:
            records = self._records()
            done = set().union(*(r["done"] for r in records))
            if expect <= done:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(expect - done)} tests never finished on the other workers, "
                                     f"e.g. {sorted(expect - done)[:3]}")
            time.sleep(0.5)
        out = Figures(defaultdict(float), {}, [], done)
        for r in records:
            for name, took in r["times"].items():
                out.times[name] += took  # a file runs on one worker; summed all the same
            out.stretch.update(r["stretch"])
            out.fixtures.extend(tuple(f) for f in r["fixtures"])
        return out

    def over(self, session=None) -> list[str]:
        """Each file over its budget; with workers, after every other test of `session` finished."""
        expect = {i.nodeid for i in session.items} - {BUDGET_TEST} if session is not None else set()
        figures = self.gather(expect)
        default, budgets = load_budgets()
        return over_budget({k: v for k, v in figures.times.items() if k != BUDGET_TEST.split("::")[0]},
                           default, budgets, figures.stretch)

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
        if self.worker is not None:
            return
        if self.shared is not None:  # the workers' figures are the run's
            figures = self.gather(timeout=0)
            self.times, self.stretch, self.fixtures = figures.times, figures.stretch, figures.fixtures
            self.done |= figures.done
            shutil.rmtree(self.shared, ignore_errors=True)
        if BUDGET_TEST not in self.done:
            return  # only a run with the budget check (the whole suite) replaces the last figures
        out = Path(session.config.rootpath) / ".cache" / "test-times.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps({"files": dict(sorted(self.times.items())), "stretch": self.stretch,
                                   "fixtures": sorted(self.fixtures, reverse=True)}, indent=1))

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node):
        """(The controller, with workers) gives each worker the directory for its figures."""
        if self.shared is None:
            self.shared = Path(tempfile.mkdtemp(prefix="pdserve-suite-clock-"))
        node.workerinput[SHARED_KEY] = str(self.shared)


def pytest_configure(config):
    clock = SuiteClock()
    worker_input = getattr(config, "workerinput", None)
    if worker_input is not None:
        clock.worker = worker_input["workerid"]
        clock.shared = Path(worker_input[SHARED_KEY])
    config.pluginmanager.register(clock, PLUGIN)


def pytest_collection_modifyitems(config, items):
    """The budget check runs last: it reads every other file's time."""
    last = [i for i in items if i.nodeid == BUDGET_TEST]
    items[:] = [i for i in items if i.nodeid != BUDGET_TEST] + last
