"""bench/procs.py: a started server's process tree is found from /proc, and the libiomp
registration files its ended processes leave in /dev/shm are removed, those of live processes
and of processes not in the tree kept."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from pdserve.bench.procs import KMP_PREFIX, clear_leftovers, descendants, leftovers_of

# a parent that starts a child which prints its PID and sleeps
TREE = ("import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(60)\n")


def test_the_tree_is_found_and_only_its_ended_processes_files_go(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert child in descendants(parent.pid) and parent.pid not in descendants(parent.pid)
        tree = {parent.pid} | descendants(parent.pid)
        mine = tmp_path / f"{KMP_PREFIX}{os.getpid()}_0"  # a live process outside the tree
        files = {pid: tmp_path / f"{KMP_PREFIX}{pid}_0" for pid in tree} | {os.getpid(): mine}
        for f in files.values():
            f.write_text("x")
        assert leftovers_of(tree, tmp_path) == []  # all alive: nothing is a leftover
        os.kill(child, 9)
        deadline = time.monotonic() + 30
        while leftovers_of(tree, tmp_path) == [] and time.monotonic() < deadline:
            time.sleep(0.05)  # until it is gone (a zombie, its parent asleep, counts as ended)
        assert clear_leftovers(tree, tmp_path) == [files[child]]
        assert sorted(tmp_path.iterdir()) == sorted([files[parent.pid], mine])
    finally:
        parent.kill()
        parent.wait(30)
    assert clear_leftovers(tree, tmp_path) == [files[parent.pid]] and list(tmp_path.iterdir()) == [mine]
