"""Shared fixtures. Engines built here are checked after each test: every KV block back in
its pool, no request left, block accounting exact."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# converted-model caches live in the checkout (ignored by git), not in the user's home
os.environ.setdefault("PDSERVE_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache"))

# the suite's processes (the test's, Ray's, each worker's) share the machine's cores: OpenMP's
# threads sleep at a parallel region's end instead of spinning (libgomp's default spins ~300k
# times), which held a core another process needed. Twelve of the slowest files on a 2-core
# AVX2 EPYC: 521 -> 436 s, busy CPU 579 s. Read by libgomp as torch loads it, so set before.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():  # Triton kernels run in its interpreter on the CPU (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from pdserve.engine.core.engine import LLMEngine  # noqa: E402
from pdserve.engine.model.tiny import tiny_llama  # noqa: E402

# each file's time against its budget, the fixtures slow tests waited on; the shared `pdserve up`;
# how the suite splits over pytest workers
pytest_plugins = ["tests.timing", "tests.helpers.shared_up", "tests.helpers.split"]
THREADS = torch.get_num_threads()  # the process's default, before any engine set its own


@pytest.fixture(autouse=True, scope="module")
def default_torch_threads():
    """Each test module starts on the process's default torch threads: an engine built with
    `EngineConfig.num_threads` (or a group's rank 0) sets them for the whole process, and every
    later module ran on one thread (the native step's tests 4x slower in the suite than alone)."""
    if torch.get_num_threads() != THREADS:
        torch.set_num_threads(THREADS)
    yield


def pytest_generate_tests(metafunc):
    """PDSERVE_STRESS=N: every cancellation test runs N times (see `cpu_contention`)."""
    rounds = int(os.environ.get("PDSERVE_STRESS", "0") or 0)
    if rounds > 0 and metafunc.definition.get_closest_marker("cancellation"):
        metafunc.fixturenames.append("stress_round")
        metafunc.parametrize("stress_round", range(rounds))


@pytest.fixture(autouse=True)
def cpu_contention(request):
    """Under PDSERVE_STRESS, a cancellation test runs beside a process that keeps a core
    busy (races between a cancel and the engine thread show up there: a clean-clone CI run
    on a loaded machine found one that passed alone), and a chaos test beside one per core
    (a fault test proves the recovery, not the machine's speed)."""
    node = request.node
    if not (os.environ.get("PDSERVE_STRESS") and (node.get_closest_marker("cancellation")
                                                  or node.get_closest_marker("chaos"))):
        yield
        return
    import subprocess
    import sys

    n = len(os.sched_getaffinity(0)) if node.get_closest_marker("chaos") else 1
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def assert_engine_clean(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests(), "requests left in the engine"
    assert engine.blocks.num_used_blocks == 0, f"{engine.blocks.num_used_blocks} KV blocks leaked"
    engine.blocks.check_invariants()
    draft_blocks = getattr(engine.speculator, "draft", None) and engine.speculator.blocks
    if draft_blocks:
        assert draft_blocks.num_used_blocks == 0, f"{draft_blocks.num_used_blocks} draft KV blocks leaked"
        draft_blocks.check_invariants()


@pytest.fixture
def make_engine():
    """make_engine(tiny=True, **config) -> LLMEngine; all engines are leak-checked at teardown."""
    made: list[LLMEngine] = []

    def factory(tiny: bool = True, seed: int = 0, block_size: int = 16, kv_cache_memory: int = 4 << 20,
                max_num_seqs: int = 64, max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
                long_prefill_token_threshold: int = 0, listener=None, loaded=None, tokenizer=None,
                kv_cache_dtype: str = "auto"):
        cfg = EngineConfig(
            cache=CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory,
                              enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      long_prefill_token_threshold=long_prefill_token_threshold))
        loaded = loaded or (tiny_llama(seed) if tiny else None)
        eng = LLMEngine(loaded, cfg, tokenizer, listener)
        made.append(eng)
        return eng

    yield factory
    for eng in made:
        assert_engine_clean(eng)


@pytest.fixture(scope="session")
def smollm():
    """The real default model (loaded once per session) and its tokenizer."""
    from pdserve.common.tokenizer import Tokenizer
    from pdserve.engine.model.weights import load_model

    loaded = load_model()
    return loaded, Tokenizer.from_model_path(loaded.path)


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer alone (no weights)."""
    from pdserve.common.tokenizer import Tokenizer
    from pdserve.engine.model.weights import default_model_path

    return Tokenizer.from_model_path(default_model_path())
