"""The native kernels' library from its C sources: each source compiled to an object in a
process of its own, as many at once as this process has CPUs, then linked. One compiler
invocation for all of them compiles them one after another (8.5 s on 2 cores, every first
load of a build: each instruction set, each fresh machine, every clean CI run); the objects
are the same code either way (no link-time optimization)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path


def compile_library(cc: str, flags: list[str], srcs: list[Path], objs: Path, out: str, error: type) -> None:
    """`srcs` into the shared library `out` with `cc` and `flags` (the link's; the compiles
    drop -shared), objects in the directory `objs`; raises `error` with the compiler's stderr
    when a step fails."""
    compile_flags = [f for f in flags if f != "-shared"]
    cmds = [[cc, *compile_flags, "-c", "-o", str(objs / f"{i}-{s.stem}.o"), str(s)] for i, s in enumerate(srcs)]
    link = [cc, *flags, "-o", out, *(c[-2] for c in cmds)]
    width, running = max(len(os.sched_getaffinity(0)), 1), []
    try:
        for cmd in [*cmds, link]:
            while running and (cmd is link or len(running) >= width):  # the link waits for every object
                _finish(*running.pop(0), error)
            running.append((cmd, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)))
        while running:
            _finish(*running.pop(0), error)
    except OSError as e:
        raise error(f"running {cc} failed: {e}") from e
    finally:
        for _, proc in running:
            proc.kill()
            proc.wait()


def _finish(cmd: list[str], proc: subprocess.Popen, error: type) -> None:
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired as e:
        proc.kill()
        proc.wait()
        raise error(f"running {' '.join(cmd)} failed: {e}") from e
    if proc.returncode != 0:
        raise error(f"compiling the native kernels failed ({' '.join(cmd)}, exit {proc.returncode}):\n{err}")
