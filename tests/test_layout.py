"""The package layout a newcomer and an installer rely on: one installed package, `pdserve`;
every import written `pdserve.…` (or relative); each layer imports only the layers below it
(docs/architecture.md); no two modules import each other, directly or round a circle; and each
test file within its time budget (tests/budgets.toml), checked last."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.timing import PLUGIN, load_budgets, over_budget

ROOT = Path(__file__).resolve().parents[1]

# installed name -> folder in the checkout (pyproject.toml's package-dir)
FOLDERS = {"pdserve": "pdserve", "pdserve.common": "common", "pdserve.engine": "engine", "pdserve.protos": "protos",
           "pdserve.kv_transfer": "kv_transfer", "pdserve.registry": "registry", "pdserve.router": "router",
           "pdserve.prefill_worker": "prefill_worker", "pdserve.decode_worker": "decode_worker",
           "pdserve.deploy": "deploy", "pdserve.bench": "bench"}

# each layer and what it may import (besides itself); the root package's own modules are
# layers of their own: `pdserve.config` (the cluster's typed config), `pdserve.flags` (the
# command line's flags and the config they build) and `pdserve.cli`
ALLOWED = {
    "pdserve.common": set(),
    "pdserve.engine": {"pdserve.common"},
    "pdserve.protos": {"pdserve.common"},
    "pdserve.config": {"pdserve.common", "pdserve.engine", "pdserve.protos", "pdserve.kv_transfer"},
    "pdserve.kv_transfer": {"pdserve.common", "pdserve.engine", "pdserve.protos"},
    "pdserve.registry": {"pdserve.common"},
    "pdserve.prefill_worker": {"pdserve.common", "pdserve.engine", "pdserve.protos", "pdserve.kv_transfer"},
    "pdserve.decode_worker": {"pdserve.common", "pdserve.engine", "pdserve.protos", "pdserve.kv_transfer"},
    "pdserve.router": {"pdserve.common", "pdserve.protos", "pdserve.registry", "pdserve.config"},
    "pdserve.deploy": {"pdserve.common", "pdserve.engine", "pdserve.protos", "pdserve.kv_transfer",
                       "pdserve.registry", "pdserve.config", "pdserve.router", "pdserve.prefill_worker",
                       "pdserve.decode_worker"},
    "pdserve.bench": {"pdserve.common", "pdserve.engine", "pdserve.protos", "pdserve.kv_transfer",
                      "pdserve.registry", "pdserve.config", "pdserve.router", "pdserve.prefill_worker",
                      "pdserve.decode_worker", "pdserve.deploy"},
    "pdserve.flags": {"pdserve.common", "pdserve.engine", "pdserve.protos", "pdserve.config", "pdserve.models_file"},
    "pdserve.models_file": {"pdserve.common", "pdserve.engine", "pdserve.config"},
    "pdserve.cli": {"pdserve.common", "pdserve.engine", "pdserve.config", "pdserve.flags", "pdserve.deploy",
                    "pdserve.bench"},
    "pdserve.__main__": {"pdserve.cli"},
    "pdserve": set(),
}

# the engine's rooms, bottom up, and what each may import of the engine (the most specific
# name that matches a module is its room); the engine's front (LLMEngine, its async wrapper,
# the interactive session, its flags) drives every room
_E = "pdserve.engine"
ENGINE_ROOMS = {
    f"{_E}.config": set(),
    f"{_E}.kernels.native": set(),
    f"{_E}.kv": {f"{_E}.config", f"{_E}.kernels.native"},
    f"{_E}.kernels": {f"{_E}.config", f"{_E}.kv", f"{_E}.kernels.native"},
    f"{_E}.model": {f"{_E}.config", f"{_E}.kernels", f"{_E}.kernels.native"},
    f"{_E}.core": {f"{_E}.config", f"{_E}.kv", f"{_E}.kernels", f"{_E}.model"},
    f"{_E}.sampling": {f"{_E}.config", f"{_E}.core", f"{_E}.kv", f"{_E}.kernels", f"{_E}.kernels.native",
                       f"{_E}.model"},
    f"{_E}.parallel": {f"{_E}.config", f"{_E}.core", f"{_E}.kv", f"{_E}.kernels", f"{_E}.kernels.native",
                       f"{_E}.model"},
    **{f"{_E}.core.{front}": {"*"} for front in ("engine", "kv_hooks", "async_engine", "interactive", "arg_utils",
                                                          "micro_batches")},
}
OLD_NAMES = {"common", "engine", "router", "deploy", "protos", "kv_transfer", "prefill_worker", "decode_worker",
             "registry", "bench"}


def modules() -> dict[str, Path]:
    """Every module of the package, by its installed name."""
    out = {}
    for pkg, folder in FOLDERS.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if pkg == "pdserve" and parts and f"pdserve.{parts[0]}" in FOLDERS:
                continue
            out[".".join([pkg, *parts])] = path
    return out


def imports_of(name: str, path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, relative ones resolved, at any depth."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append((node.lineno, mod))
            found += [(node.lineno, f"{mod}.{a.name}") for a in node.names]  # `from pkg import module`
    return found


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "pdserve"
    if ".".join(parts[:2]) in FOLDERS:
        return ".".join(parts[:2])
    return ".".join(parts[:2])  # a module of the root package (pdserve.config, pdserve.cli)


MODULES = modules()


def test_every_import_names_the_installed_package():
    bad = [f"{MODULES[m].relative_to(ROOT)}:{line}: {imp}" for m in MODULES for line, imp in imports_of(m, MODULES[m])
           if imp.split(".")[0] in OLD_NAMES]
    assert not bad, "imports of the checkout's folders instead of pdserve.*:\n" + "\n".join(bad)


def test_layers_import_only_the_layers_below():
    bad = []
    for m, path in MODULES.items():
        mine = layer_of(m)
        for line, imp in imports_of(m, path):
            if imp.split(".")[0] != "pdserve" or imp == "pdserve":
                continue
            theirs = layer_of(imp)
            if theirs != mine and theirs not in ALLOWED[mine]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {mine} imports {imp}")
    assert not bad, "imports against the layering (docs/architecture.md):\n" + "\n".join(bad)


def test_no_import_circles():
    graph = {m: {imp for _, imp in imports_of(m, p) if imp in MODULES and imp != m} for m, p in MODULES.items()}
    for m in graph:  # a package's __init__ is not a dependency of the modules inside it
        graph[m] = {d for d in graph[m] if not m.startswith(d + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                pytest.fail("import circle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def engine_room(module: str) -> str | None:
    """The engine room a module belongs to (the longest ENGINE_ROOMS name it starts with)."""
    rooms = [r for r in ENGINE_ROOMS if module == r or module.startswith(r + ".")]
    return max(rooms, key=len) if rooms else None


def test_engine_rooms_import_only_the_rooms_below():
    bad = []
    for m, path in MODULES.items():
        mine = engine_room(m)
        if mine is None:
            continue
        for line, imp in imports_of(m, path):
            theirs = engine_room(imp)
            if theirs is None or theirs == mine or "*" in ENGINE_ROOMS[mine]:
                continue
            if theirs not in ENGINE_ROOMS[mine]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {mine} imports {imp}")
    assert not bad, "imports against the engine's rooms (docs/architecture.md):\n" + "\n".join(bad)


def test_every_engine_module_is_in_a_room():
    loose = [m for m in MODULES if m.startswith(_E + ".") and engine_room(m) is None]
    assert not loose, f"engine modules outside the rooms: {loose}"


def test_no_file_over_the_size_limit():
    """Files stay small enough to read in one sitting (STYLE.md: about 400 lines)."""
    big = [f"{p.relative_to(ROOT)}: {n}" for p in ROOT.glob("[!.]*/**/*.py")
           if "_pb2" not in p.name and ".venv" not in p.parts and (n := len(p.read_text().splitlines())) > 420]
    assert not big, f"files over 420 lines: {big}"


def test_router_runs_without_torch():
    """The router is an HTTP process: importing it and building its app pulls in no torch or
    numpy (value types come from pdserve.common, never from the engine)."""
    code = ("import sys; import pdserve.router.app, pdserve.router.router, pdserve.protos.convert; "
            "from pdserve.config import ClusterConfig; ClusterConfig(); "
            "bad = [m for m in ('torch', 'numpy') if m in sys.modules]; assert not bad, bad; "
            "assert not [m for m in sys.modules if m.startswith('pdserve.engine.') and m != 'pdserve.engine.config'], "
            "sorted(m for m in sys.modules if m.startswith('pdserve.engine'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_wheel_installs_one_package(tmp_path):
    """A non-editable build holds `pdserve/` and nothing else at the top level, with the
    data files the package reads (C kernels, .proto files)."""
    src = tmp_path / "src"  # a copy: a build writes build/ and *.egg-info/ into the tree it builds
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv*", ".peers", ".git", ".cache", "build", "dist",
                                                               "*.egg-info", "__pycache__", ".pytest_cache",
                                                               ".hypothesis"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(src)], check=True, capture_output=True, cwd=tmp_path)
    wheel, = tmp_path.glob("pdserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"pdserve"}, tops
    for needed in ("pdserve/engine/kernels/native/attention.c", "pdserve/protos/worker.proto", "pdserve/__main__.py",
                   "pdserve/protos/worker_pb2.py", "pdserve/router/app.py"):
        assert needed in names, needed
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "pdserve = pdserve.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


@pytest.mark.slow
def test_installed_package_runs_from_anywhere(tmp_path):
    """`python -m pdserve` and the modules import from a directory outside the checkout
    (no folder of the checkout shadows or stands in for the package)."""
    r = subprocess.run([sys.executable, "-c", "import pdserve.router.app, pdserve.deploy.up, pdserve.bench.serving; "
                        "import sys; assert 'engine' not in sys.modules and 'router' not in sys.modules"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "pdserve", "--help"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "bench-transfer" in r.stdout, r.stderr


def test_the_budget_check_names_each_file_over_its_budget_stretched_by_the_load():
    times = {"tests/test_a.py": 50.0, "tests/test_b.py": 20.0, "tests/test_c.py": 95.0}
    assert over_budget(times, 30.0, {"tests/test_c.py": 100.0}) == ["tests/test_a.py: 50 s, budget 30 s"]
    assert over_budget(times, 30.0, {}, {"tests/test_a.py": 2.0}) == ["tests/test_c.py: 95 s, budget 30 s"]
    default, budgets = load_budgets()
    assert default > 0 and all(v > 0 for v in budgets.values())
    missing = [name for name in budgets if not (ROOT / name).exists()]
    assert not missing, f"budgets for test files that do not exist: {missing}"


def test_every_test_file_keeps_within_its_time_budget(request):
    """Runs last (tests/timing.py puts it there): each test file's time in this run (setup,
    call and teardown of its tests) within its budget in tests/budgets.toml, so the next slow
    test is seen the day it lands."""
    clock = request.config.pluginmanager.get_plugin(PLUGIN)
    over = clock.over(request.session)  # with pytest workers, once the others' tests are done
    assert not over, ("test files over their time budget (tests/budgets.toml; the slow fixtures are named in "
                      "the summary):\n" + "\n".join(over))
