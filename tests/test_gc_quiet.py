"""common/gc_quiet.py: after start-up the router and every worker freeze what is alive, so a
full collection walks only what was made since; garbage made later is still collected. Run in
a fresh interpreter: freezing the test process would keep its garbage for the rest of the suite."""
import subprocess
import sys

CHECK = r"""
import gc, weakref
import pdserve.router.app  # a server's worth of modules, functions and types
from pdserve.common.gc_quiet import freeze_startup

class Node:
    pass

old = Node(); old.self = old  # a cycle alive at start-up: frozen, kept
before = len(gc.get_objects())
frozen = freeze_startup()
assert frozen >= before // 2, (frozen, before)
assert len(gc.get_objects()) < before // 10, (len(gc.get_objects()), before)
assert not any(o is old for o in gc.get_objects())  # full collections skip it
new = Node(); new.self = new; gone = weakref.ref(new); del new
gc.collect()
assert gone() is None  # garbage made after start-up is still collected
print("ok", frozen)
"""


def test_startup_objects_are_frozen_and_later_garbage_is_still_collected():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")
