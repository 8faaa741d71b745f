"""How the suite splits over its two pytest workers (tests/helpers/split.py) and how the budget
check, on one of them, gets the other's figures (tests/timing.py): pure, no pytest run inside."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.procs import OtherLoad
from tests.helpers.shared_up import FILES as SHARED_UP_FILES
from tests.helpers.split import expected_seconds, order, unit_of
from tests.timing import BUDGET_TEST, SuiteClock


def test_a_unit_is_a_file_the_shared_clusters_files_together_and_the_budget_check_alone():
    assert unit_of("tests/test_engine.py::test_a[1]") == unit_of("tests/test_engine.py::test_b") == "tests/test_engine.py"
    assert len({unit_of(f"{name}::test_x") for name in SHARED_UP_FILES}) == 1
    assert unit_of(BUDGET_TEST) != unit_of("tests/test_layout.py::test_other")


def test_units_go_longest_first_and_the_budget_check_last():
    units = {BUDGET_TEST: [BUDGET_TEST], "tests/test_a.py": ["tests/test_a.py::t"],
             "tests/test_b.py": ["tests/test_b.py::t", "tests/test_b.py::u"],
             "shared": ["tests/test_c.py::t", "tests/test_d.py::t"]}
    seconds = {"tests/test_a.py": 50.0, "tests/test_c.py": 20.0, "tests/test_d.py": 40.0, "": 30.0}
    assert order(units, seconds) == ["shared", "tests/test_a.py", "tests/test_b.py", BUDGET_TEST]


def test_expected_seconds_are_the_last_runs_or_else_the_budgets(tmp_path):
    fresh = expected_seconds(tmp_path)
    assert fresh[""] > 0 and fresh["tests/test_cli.py"] > fresh[""]  # the budgets
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "test-times.json").write_text(json.dumps({"files": {"tests/test_cli.py": 12.5}}))
    assert expected_seconds(tmp_path)["tests/test_cli.py"] == 12.5


def _record(shared: Path, worker: str, times: dict[str, float], done: list[str]) -> None:
    tmp = shared / f".{worker}.json"  # whole, as a worker writes it
    tmp.write_text(json.dumps({"times": times, "stretch": {k: 1.5 for k in times},
                               "fixtures": [[4.0, "cluster", "module", done[0]]], "done": done}))
    tmp.rename(shared / f"{worker}.json")


def test_the_budget_check_waits_for_the_other_workers_tests_and_reads_their_times(tmp_path):
    mine = SuiteClock(shared=tmp_path, worker="gw1")
    _record(tmp_path, "gw1", {"tests/test_a.py": 3.0}, ["tests/test_a.py::t"])
    _record(tmp_path, "gw0", {"tests/test_b.py": 1.0}, ["tests/test_b.py::t"])
    later = threading.Timer(0.5, _record, (tmp_path, "gw0", {"tests/test_b.py": 1.0, "tests/test_c.py": 7.0},
                                           ["tests/test_b.py::t", "tests/test_c.py::t"]))
    later.start()
    start = time.monotonic()
    got = mine.gather({"tests/test_a.py::t", "tests/test_b.py::t", "tests/test_c.py::t"}, timeout=30)
    assert time.monotonic() - start >= 0.4  # it waited for gw0's last test
    assert got.times == {"tests/test_a.py": 3.0, "tests/test_b.py": 1.0, "tests/test_c.py": 7.0}
    assert got.stretch["tests/test_c.py"] == 1.5 and len(got.fixtures) == 2
    assert mine.times == {}  # its own figures (what it publishes) stay its own


def test_the_budget_check_names_the_tests_that_never_finished(tmp_path):
    _record(tmp_path, "gw0", {"tests/test_b.py": 1.0}, ["tests/test_b.py::t"])
    with pytest.raises(AssertionError, match=r"1 tests never finished.*tests/test_c.py::t"):
        SuiteClock(shared=tmp_path, worker="gw1").gather({"tests/test_b.py::t", "tests/test_c.py::t"}, timeout=0.2)


def test_a_worker_publishes_its_figures_after_each_test(tmp_path):
    clock = SuiteClock(shared=tmp_path, worker="gw3")
    for when in ("setup", "call", "teardown"):
        clock.pytest_runtest_logreport(type("Report", (), {"nodeid": "tests/test_a.py::t", "when": when,
                                                           "duration": 0.25})())
    record = json.loads((tmp_path / "gw3.json").read_text())
    assert record["times"] == {"tests/test_a.py": 0.75} and record["done"] == ["tests/test_a.py::t"]
    assert not list(tmp_path.glob(".*"))  # written whole, then renamed into place


def test_the_other_load_counts_a_busy_process_outside_the_roots_and_not_one_inside():
    """Two readings over the same window, one with a spinning process as its root: the other one
    sees about a core more, less on a loaded machine (what another worker's test adds beside a
    timing check)."""
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"])
    try:
        inside, outside = OtherLoad([spin.pid]), OtherLoad([])
        time.sleep(1.2)
        extra = outside.cores() - inside.cores()
    finally:
        spin.wait(10)
    assert 0.3 < extra < 1.2, extra  # a loaded machine gives the spinner less than a core
