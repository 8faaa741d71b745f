"""One `pdserve up` under Ray, started as a user starts it (no flags but a cluster token and a
shutdown grace), shared by the tests of what it serves (tests/test_bf16_kv_up.py,
tests/test_isolation_up.py, then tests/test_up.py): its start is paid once. A pytest plugin (conftest.py loads it): the
`default_up` fixture (over the session's `default_up_session`), and a collection hook that
runs the tests using it one after another (where the first of them was), so the cluster never
idles beside other files (an idle one takes ~4% of a core). Each
test leaves it as it found it (every KV block back); tests/test_up.py's last test stops it
with Ctrl-C and checks that stop; if none did, the session's end stops it (exit code 0)."""
from __future__ import annotations

import pytest

from pdserve.registry.embedded import free_port
from tests.helpers.procs import Proc, descendants, stop

FIXTURE = "default_up_session"
# the files whose tests use it: one unit of work for the suite's workers (tests/helpers/split.py)
FILES = ("tests/test_bf16_kv_up.py", "tests/test_isolation_up.py", "tests/test_up.py")


class SharedUp:
    """The running `pdserve up`: its Proc (`up`), the router's `url`, and `procs`, every
    process below it seen so far (`track` adds the ones there now)."""

    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.up = Proc("up", "--port", str(self.port), "--cluster-token", "test-token", "--shutdown-grace", "3")
        self.procs: set[int] = set()
        self.stopped = False

    def wait_ready(self) -> None:
        line = self.up.p.stdout.readline()  # the curl line: printed once /health would answer 200
        assert line.startswith("curl "), self.up.text() if self.up.p.poll() is not None else line
        self.track()

    def track(self) -> set[int]:
        self.procs |= descendants(self.up.p.pid)
        return self.procs

    def text(self) -> str:
        return self.up.text()


@pytest.fixture(scope="session")
def default_up_session():
    """The shared `pdserve up` (SharedUp), ready to serve; stopped at the session's end (exit
    code 0 asserted) unless a test stopped it."""
    shared = SharedUp()
    try:
        shared.wait_ready()
        yield shared
    finally:
        if not shared.stopped and shared.up.p.poll() is None:
            rc = stop(shared.up, 90)
            assert rc == 0, shared.text()


@pytest.fixture
def default_up(default_up_session):
    """The shared `pdserve up`, checked to be still running (a test after the one that stopped
    it fails here)."""
    shared = default_up_session
    assert not shared.stopped and shared.up.p.poll() is None, "the shared pdserve up has stopped:\n" + shared.text()
    return shared


def stops_it(test):
    """Marks the test that stops the shared cluster: it runs after every other test using it."""
    test.stops_default_up = True
    return test


def pytest_collection_modifyitems(config, items):
    """The tests using the shared cluster run one after another, in their collected order (the
    one that stops it last), where the first of them was."""
    users = [i for i in items if FIXTURE in getattr(i, "fixturenames", ())]
    if not users:
        return
    strays = sorted({i.nodeid.split("::")[0] for i in users} - set(FILES))
    if strays:
        raise pytest.UsageError(f"{strays} use the shared pdserve up: add them to FILES in {__name__}")
    first = items.index(users[0])
    users.sort(key=lambda i: getattr(getattr(i, "function", None), "stops_default_up", False))
    rest = [i for i in items if FIXTURE not in getattr(i, "fixturenames", ())]
    items[:] = rest[:first] + users + rest[first:]
