"""The grid forms' cache (engine/model/packed_cache.py): a load of the real model records what
the grid check and the packers derive; the next load of the same file, quantization and code
replays it without checking a grid, and answers with the same bits; a cache file that does not
fit (truncated, or made for other shapes) is set aside and rewritten, never trusted; another
quantization, another version of the file or a part of the model (a rank's slice, a stage)
gets its own key; an old version's file and a gone file's are removed."""
import os

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.model import packed_cache, quant
from pdserve.engine.model.weights import default_model_path, load_model
from tests.helpers.engine_runs import clean
from tests.helpers.reference import engine_logits

pytestmark = pytest.mark.slow


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The forms' cache in a directory of the test's own (the conversion cache stays shared)."""
    monkeypatch.setattr(packed_cache, "cache_dir", lambda: tmp_path)
    return tmp_path


def forms_files(cache):
    return sorted((cache / "forms").glob(f"*{packed_cache.SUFFIX}"))


def logits(loaded, quantization="auto", ids=(1, 9690, 314, 253, 1345, 2165, 30, 2)):
    """Every position's logits of one prompt, through an engine on the loaded model's kernels;
    every KV block back after."""
    e = LLMEngine(loaded, EngineConfig(quantization=quantization, cache=CacheConfig(kv_cache_memory=16 << 20)))
    out = engine_logits(e, list(ids))
    clean(e)
    return out


def entries(file):
    """A cache file's entries: each matrix's shape, tag and tensors' bytes."""
    forms = packed_cache.load(file)
    assert forms is not None, f"{file} does not read back"
    return [(tuple(shape), tag, [t.numpy().tobytes() for t in ts]) for shape, tag, ts in forms.replay]


def packed_state(model):
    return [(type(lin).__name__, [t.clone() for t in getattr(lin, "packed", ())]) for lin in model._linears()]


def no_grid_check(monkeypatch):
    def refuse(w):
        raise AssertionError("a replayed load checked a grid")
    monkeypatch.setattr(quant, "exact_grid", refuse)


@pytest.mark.parametrize("quantization", ["auto", "exact"])
def test_a_second_load_replays_the_first_s_forms_and_answers_with_the_same_bits(cache, monkeypatch, quantization):
    first = load_model(quantization=quantization)
    (file,) = forms_files(cache)
    assert quantization in file.name
    want_state, want = packed_state(first.model), logits(first, quantization)
    with monkeypatch.context() as m:
        no_grid_check(m)
        second = load_model(quantization=quantization)
    assert second.fingerprint == first.fingerprint
    got_state = packed_state(second.model)
    assert [k for k, _ in got_state] == [k for k, _ in want_state]
    assert any(k == ("W4A8Linear" if quantization == "auto" else "WeightOnlyLinear") for k, _ in got_state)
    for (_, a), (_, b) in zip(want_state, got_state):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(logits(second, quantization), want)
    assert forms_files(cache) == [file]


def test_a_cache_file_that_does_not_fit_is_set_aside_and_rewritten(cache):
    want = logits(load_model())
    (file,) = forms_files(cache)
    good = entries(file)
    text = file.read_bytes()
    file.write_bytes(text[: len(text) // 3])  # a crash mid-write (the real writer renames into place)
    assert torch.equal(logits(load_model()), want)
    assert entries(file) == good
    wrong = packed_cache.PackedForms()
    wrong.take((8, 32), lambda: ("", ()))  # forms of some other model's first matrix
    packed_cache.save(wrong, file, default_model_path())
    assert torch.equal(logits(load_model()), want)
    assert entries(file) == good


def small_recording():
    forms = packed_cache.PackedForms()
    forms.take((8, 32), lambda: ("q8_0", (torch.zeros(8, 32, dtype=torch.int8), torch.ones(8, 1))))
    return forms


def test_another_quantization_or_version_of_the_file_gets_its_own_key_and_a_gone_one_is_removed(cache, tmp_path):
    src = default_model_path()
    assert packed_cache.cache_path(src, "auto") != packed_cache.cache_path(src, "exact")
    copy = tmp_path / "model" / src.name
    copy.parent.mkdir()
    copy.write_bytes(b"GGUF")  # its key reads the path, size and mtime alone
    old = packed_cache.cache_path(copy, "auto")
    packed_cache.save(small_recording(), old, copy)
    part = packed_cache.cache_path(copy, "auto", "tp3r0")
    packed_cache.save(small_recording(), part, copy)
    assert forms_files(cache) == sorted([old, part])
    os.utime(copy, ns=(0, copy.stat().st_mtime_ns + 10**9))  # a new version of the file, same path
    new = packed_cache.cache_path(copy, "auto")
    assert new != old and new.parent == cache / "forms"
    packed_cache.save(small_recording(), new, copy)
    assert forms_files(cache) == sorted([new, part])  # the old version's file is pruned, the part's is not
    assert [tag for _, tag, _ in packed_cache.load(new).replay] == ["q8_0"]
    copy.unlink()
    packed_cache.save(small_recording(), packed_cache.cache_path(src, "auto"), src)
    assert forms_files(cache) == [packed_cache.cache_path(src, "auto")]  # a gone file's are removed


def test_each_rank_s_slice_and_each_stage_keeps_forms_of_its_own(cache, monkeypatch):
    """A tensor-parallel rank's slice and a pipeline stage's layers are other matrices than the
    whole model's: each gets its own file, replayed by the next load of that same part."""
    from pdserve.engine.parallel.tp import ModelSource, load_rank

    config = EngineConfig()
    load_model()  # the whole model's file stays beside its parts'
    parts = [dict(tp=3, rank=0), dict(tp=3, rank=1), dict(tp=2, rank=1, pipeline=True)]
    first = [packed_state(load_rank(ModelSource(), config, **p)[0].model) for p in parts]
    names = sorted(f.name for f in forms_files(cache))
    assert len(names) == 4 and any("-tp3r1-" in n for n in names) and any("-pp2r1l15-30tp1r0-" in n for n in names)
    with monkeypatch.context() as m:
        no_grid_check(m)
        again = [packed_state(load_rank(ModelSource(), config, **p)[0].model) for p in parts]
    for want, got in zip(first, again):
        assert [k for k, _ in got] == [k for k, _ in want]
        for (_, a), (_, b) in zip(want, got):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert sorted(f.name for f in forms_files(cache)) == names


def test_a_cache_that_cannot_be_written_costs_the_load_nothing_but_time(cache, monkeypatch):
    """A full or read-only disk: the load answers as ever, and leaves no half-written file."""
    import safetensors.torch

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    first = load_model()
    assert first.model.int8_activation_matrices() > 0
    assert not list((cache / "forms").iterdir())
