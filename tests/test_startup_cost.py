"""What a worker's or a command's start pays before it serves: no torch import for a command
that does not run a model, no torch._dynamo import while a model loads (~2 s each), and a KV
cache whose memory the OS makes as blocks are first written, zero until then. Each check runs
in a fresh interpreter, where the test process's own imports cannot hide an import."""
import os
import subprocess
import sys

import pytest
import torch

from pdserve.engine.config import CacheConfig
from pdserve.engine.kv.cache import KVCache


def run_python(code: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_serving_commands_parse_without_torch_and_a_bench_command_gets_its_flags():
    out = run_python(
        "import sys\n"
        "from pdserve.cli import parser\n"
        "for cmd in ('up', 'router', 'worker', 'scale'):\n"
        "    parser([cmd]).format_help()\n"
        "assert parser(['up']).parse_args(['up']).func.__name__ == '_up'\n"
        "print('torch' in sys.modules)\n"
        "args = parser(['bench']).parse_args(['bench', '--base-url', 'http://h:1', '--num-requests', '3'])\n"
        "print(args.num_requests, callable(args.func))\n")
    assert out.split() == ["False", "3", "True"]


def test_loading_the_default_model_does_not_import_torch_dynamo():
    out = run_python(
        "import sys\n"
        "from pdserve.engine.config import EngineConfig\n"
        "from pdserve.deploy.worker_host import load_worker_model\n"
        "loaded, _ = load_worker_model(EngineConfig())\n"
        "print(loaded.model.rotary.cos.device, 'torch._dynamo' in sys.modules)\n")
    assert out.split() == ["cpu", "False"]


def _resident_mb() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/statm")
def test_a_fresh_cache_is_zero_and_takes_memory_only_where_blocks_are_written(smollm):
    cfg = smollm[0].config
    before = _resident_mb()
    cache = KVCache(cfg, CacheConfig(kv_cache_memory=512 << 20), torch.float32)
    assert cache.kv.shape[2] == cache.num_blocks and cache.kv.is_contiguous()
    assert _resident_mb() - before < 64  # 512 MB reserved, none of it made yet
    block = cache.kv[:, :, 7]
    assert not block.any()  # padded attention slots read as zeros: 0 * NaN would be NaN
    block.fill_(1.5)
    assert cache.kv[:, :, 7].eq(1.5).all() and not cache.kv[:, :, 6].any() and not cache.kv[:, :, 8].any()
    assert _resident_mb() - before < 128


# `pdserve up` with the arguments given, its exit code, then whether torch and Ray were imported
UP_IMPORTS = ("import atexit, sys\n"
              "atexit.register(lambda: print('torch' in sys.modules, 'ray' in sys.modules))\n"
              "from pdserve.cli import main\n"
              "sys.argv = ['pdserve', 'up', *sys.argv[1:]]\n"
              "print(main())\n")


def test_up_refuses_flags_that_cannot_fit_without_importing_torch_or_ray():
    # a degree the model cannot be split into, and ranks the local Ray's CPUs cannot hold:
    # each refused from the model file's header and the flags, before Ray or a model loads
    out = run_python(UP_IMPORTS, "--decode-pp", "31")
    assert out.split() == ["2", "False", "False"], out
    tp = (os.cpu_count() or 1) + 1
    out = run_python(UP_IMPORTS, "--prefill-tp", str(tp), "--kv-cache-memory", "64MiB")
    assert out.split() == ["2", "False", "False"], out
