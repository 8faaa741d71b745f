"""The native kernels' instruction set, chosen per CPU at start (engine/kernels/native/cpu.py):
the best the CPU has, a lower one on request, a clear error for one it lacks, the tiles' width per
row count on a Zen 4, fetches ahead into L2 on AMD CPUs; and every path this CPU can run
gives bitwise the same matmuls (the VNNI tiles sum the same integers as AVX2's), and each build
the same attention whichever cache level its blocks are fetched into."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pdserve.engine.kernels import native
from pdserve.engine.kernels.native import cpu as isa_mod

ZEN3 = {"avx2", "fma", "f16c"}
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16", "avx_vnni"}
ICE_LAKE = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}  # no VEX-encoded VNNI
ALDER_LAKE = ZEN3 | {"avx_vnni"}  # VNNI without AVX-512
SAPPHIRE_RAPIDS = ICE_LAKE | {"avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize("flags,best", [(SAPPHIRE_RAPIDS, "avx512-amx"), (ZEN4, "avx512-vnni"),
                                        (ICE_LAKE, "avx512-vnni"), (ALDER_LAKE, "avx-vnni"),
                                        (ZEN3, "avx2"), (set(), "portable"), ({"avx2"}, "portable")])
def test_the_best_instruction_set_the_cpu_has_is_chosen(flags, best, monkeypatch):
    monkeypatch.delenv(isa_mod.ISA_ENV, raising=False)
    assert isa_mod.isa(flags) == best
    assert isa_mod.isas(flags)[0] == best and isa_mod.isas(flags)[-1] == "portable"


def test_a_lower_instruction_set_is_taken_on_request_and_builds_without_the_higher_flags(monkeypatch):
    monkeypatch.setenv(isa_mod.ISA_ENV, "avx2")
    assert isa_mod.isa(ZEN4) == "avx2"
    monkeypatch.setattr(native, "cpu_flags", lambda: ZEN4)
    monkeypatch.setattr(isa_mod, "cpu_flags", lambda: ZEN4)
    flags = native._flags()
    assert "-mavx2" in flags and not any("512" in f or "vnni" in f for f in flags)
    monkeypatch.setenv(isa_mod.ISA_ENV, "avx512-vnni")
    assert "-mavx512vnni" in native._flags() and not any("amx" in f for f in native._flags())
    monkeypatch.setattr(native, "cpu_flags", lambda: SAPPHIRE_RAPIDS)
    monkeypatch.setattr(isa_mod, "cpu_flags", lambda: SAPPHIRE_RAPIDS)
    monkeypatch.delenv(isa_mod.ISA_ENV)
    assert {"-mamx-tile", "-mamx-bf16", "-mavx512bf16"} <= set(native._flags())


def test_a_zen_4_builds_256_bit_w4a8_tiles_up_to_8_rows_and_other_cpus_512_bit_ones(monkeypatch):
    """A Zen 4 runs a 512-bit operation as two 256-bit halves: its decode rows take the 256-bit
    tiles (engine/kernels/native/vnni.h), the build says so in its flags (and so its cache key)."""
    monkeypatch.delenv(isa_mod.NARROW_ROWS_ENV, raising=False)
    assert isa_mod.narrow_rows("avx512-vnni", ("AuthenticAMD", 25)) == 8
    assert isa_mod.narrow_rows("avx512-vnni", ("AuthenticAMD", 26)) == 0  # Zen 5: 512 bits wide
    assert isa_mod.narrow_rows("avx512-amx", ("GenuineIntel", 6)) == 0
    assert isa_mod.narrow_rows("avx2", ("AuthenticAMD", 25)) == 0  # a Zen 3, or a Zen 4 forced to AVX2
    monkeypatch.setenv(isa_mod.NARROW_ROWS_ENV, "4")
    assert isa_mod.narrow_rows("avx512-vnni", ("GenuineIntel", 6)) == 4
    monkeypatch.setattr(native, "cpu_flags", lambda: ZEN4)
    monkeypatch.setattr(isa_mod, "cpu_flags", lambda: ZEN4)
    monkeypatch.delenv(isa_mod.ISA_ENV, raising=False)
    assert "-DPDSERVE_NARROW_ROWS=4" in native._flags()
    monkeypatch.setenv(isa_mod.NARROW_ROWS_ENV, "0")
    assert not any("NARROW" in f for f in native._flags())  # the default build: no define, the same cache key
    monkeypatch.setenv(isa_mod.NARROW_ROWS_ENV, "eight")
    with pytest.raises(native.UnknownISA, match="PDSERVE_NARROW_ROWS='eight' is not a whole number"):
        native._flags()


def test_a_vnni_build_targets_avx512_bf16_on_an_amd_cpu_that_has_it(monkeypatch):
    """The long prompt rows' attention in bf16 vectors (engine/kernels/native/bf16_attention.c)
    is built where the CPU has AVX-512 BF16 and runs it fast: a Zen 4, not an Intel Xeon without
    AMX (bf16 dot products at half its fp32 rate) nor an Ice Lake; the AMX build has it anyway."""
    monkeypatch.delenv(isa_mod.ISA_ENV, raising=False)
    monkeypatch.setattr(isa_mod, "cpu_identity", lambda: ("AuthenticAMD", 25))
    for flags, bf16 in ((ZEN4, True), (ICE_LAKE, False), (SAPPHIRE_RAPIDS, True), (ZEN3, False)):
        monkeypatch.setattr(isa_mod, "cpu_flags", lambda f=flags: f)
        assert ("-mavx512bf16" in native._flags()) is bf16, flags
    monkeypatch.setattr(isa_mod, "cpu_flags", lambda: ICE_LAKE | {"avx512_bf16"})  # a Xeon without AMX
    assert "-mavx512bf16" in native._flags()  # were it an AMD
    monkeypatch.setattr(isa_mod, "cpu_identity", lambda: ("GenuineIntel", 6))
    assert "-mavx512bf16" not in native._flags() and not isa_mod.bf16_vectors("avx512-vnni")
    monkeypatch.setenv(isa_mod.BF16_VECTORS_ENV, "1")
    assert "-mavx512bf16" in native._flags()  # on request
    monkeypatch.setattr(isa_mod, "cpu_identity", lambda: ("AuthenticAMD", 25))
    monkeypatch.setenv(isa_mod.BF16_VECTORS_ENV, "0")
    assert "-mavx512bf16" not in native._flags()  # every prompt row's attention in fp32
    monkeypatch.setenv(isa_mod.BF16_VECTORS_ENV, "yes")
    with pytest.raises(native.UnknownISA, match="PDSERVE_BF16_VECTORS='yes' is not 0 or 1"):
        native._flags()
    monkeypatch.delenv(isa_mod.BF16_VECTORS_ENV)
    monkeypatch.setattr(isa_mod, "cpu_flags", lambda: ZEN4)
    monkeypatch.setenv(isa_mod.ISA_ENV, "avx2")
    assert not any("512" in f for f in native._flags())


def test_amd_cpus_fetch_ahead_into_l2_and_others_into_l1(monkeypatch):
    """The paged attention's and the LM head's fetches ahead (attention.c, q8a16.c): into L2 on AMD,
    into L1 elsewhere, or as PDSERVE_PREFETCH says; the build's flags (its cache key) say which."""
    monkeypatch.delenv(isa_mod.PREFETCH_ENV, raising=False)
    assert isa_mod.prefetch_l2(("AuthenticAMD", 25)) and isa_mod.prefetch_l2(("AuthenticAMD", 26))
    assert not isa_mod.prefetch_l2(("GenuineIntel", 6)) and not isa_mod.prefetch_l2(("", 0))
    monkeypatch.setenv(isa_mod.PREFETCH_ENV, "L2")
    assert isa_mod.prefetch_l2(("GenuineIntel", 6))
    monkeypatch.setattr(native, "cpu_flags", lambda: ZEN3)
    monkeypatch.setattr(isa_mod, "cpu_flags", lambda: ZEN3)
    monkeypatch.delenv(isa_mod.ISA_ENV, raising=False)
    assert "-DPDSERVE_PREFETCH_L2" in native._flags()
    monkeypatch.setenv(isa_mod.PREFETCH_ENV, "l1")
    assert not any("PREFETCH" in f for f in native._flags())
    monkeypatch.setenv(isa_mod.ISA_ENV, "portable")
    monkeypatch.setenv(isa_mod.PREFETCH_ENV, "l2")
    assert not any("PREFETCH" in f for f in native._flags())  # the scalar build fetches nothing ahead
    monkeypatch.setenv(isa_mod.PREFETCH_ENV, "l3")
    with pytest.raises(native.UnknownISA, match="PDSERVE_PREFETCH='l3' is not l1 or l2"):
        isa_mod.prefetch_l2()


@pytest.mark.parametrize("want,flags,match", [("avx512-vnni", ZEN3, "lacks avx512_vnni, avx512bw"),
                                              ("avx-vnni", ICE_LAKE, "lacks avx_vnni"),
                                              ("avx512-amx", ZEN4, "lacks amx_bf16, amx_tile"),
                                              ("sse9", ZEN4, "not one of avx512-amx, avx512-vnni, avx-vnni, avx2, portable")])
def test_an_instruction_set_the_cpu_lacks_or_that_does_not_exist_is_a_named_error(want, flags, match, monkeypatch):
    monkeypatch.setenv(isa_mod.ISA_ENV, want)
    with pytest.raises(native.UnknownISA, match=match):
        isa_mod.isa(flags)


_KERNELS = """
import json, sys, torch
from pdserve.engine.kernels import native
from pdserve.engine.kernels.native import q8a16, step, w4a8
g = torch.Generator().manual_seed(7)
out = {"isa": native.isa(), "library": str(native.library_path())}
for n, k in ((960, 576), (576, 1536), (24, 96)):  # 24: an odd count of 8-column blocks
    q, d, m = w4a8.pack(*native.quantize_q4_1(torch.randn(n, k, generator=g) * 0.05))
    head = q8a16.pack(*native.quantize_q8_0(torch.randn(n, k, generator=g) * 0.05))
    for rows in (1, 3, 4, 5, 8, 13, 32, 70):
        x = torch.randn(rows, k, generator=g) * 3
        dh, mh = d.half().float(), m.half().float()  # fp16 values, read in fp16 by the nibble kernels
        ys = (w4a8.matmul(x, q, d, m), step.nibble_matmul(x, step.nibbles(q), d, m), q8a16.matmul(x, *head),
              step.nibble_matmul(x, step.nibbles(q), dh, mh, step.half_scales(dh, mh)), w4a8.matmul(x, q, dh, mh))
        out[f"{n}x{k}x{rows}"] = [y.view(torch.int32).flatten().tolist() for y in ys]
json.dump(out, sys.stdout)
"""


def _run_kernels(isa: str, narrow_rows: str = "") -> dict:
    env = dict(os.environ, **{isa_mod.ISA_ENV: isa, isa_mod.NARROW_ROWS_ENV: narrow_rows})
    r = subprocess.run([sys.executable, "-c", _KERNELS], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.skipif(not native.available() or "avx2" not in isa_mod.isas(), reason="the integer kernels need AVX2")
def test_every_instruction_set_this_cpu_has_gives_bitwise_the_same_matmuls():
    """The W4A8 (byte and nibble weights) and Q8_0 x int16 matmuls of each build this CPU can
    run, each in its own process (on an AVX-512 CPU: the AVX2 path forced beside the VNNI one)."""
    runs = {name: _run_kernels(name) for name in isa_mod.isas() if name != "portable"}
    assert all(r["isa"] == name for name, r in runs.items())
    assert len({r["library"] for r in runs.values()}) == len(runs)  # a build per instruction set
    if "avx512-vnni" in runs:  # the 512-bit tiles at every row count, and 256-bit ones up to 16 rows
        for narrow in ("0", "16"):
            runs[f"avx512-vnni, 256-bit tiles up to {narrow} rows"] = _run_kernels("avx512-vnni", narrow)
    (first, best), *others = runs.items()
    for name, other in others:
        for key in best:
            if key not in ("isa", "library"):
                assert best[key] == other[key], f"{key}: {name} differs from {first}"
    assert torch.tensor(best["960x576x5"][0], dtype=torch.int32).view(torch.float32).abs().sum() > 0  # real results, not zeros
    for key, ys in best.items():  # the fp16 scales' nibble matmul gives the fp32 kernel's bits
        if key not in ("isa", "library"):
            assert ys[3] == ys[4], key


_ATTENTION = """
import json, sys, torch
from pdserve.engine.kernels import native
from pdserve.engine.kernels.native import q8a16
g = torch.Generator().manual_seed(11)
out = {"library": str(native.library_path())}
H, KVH, D, bs = 9, 3, 64, 16
for dtype in (torch.float32, torch.bfloat16):
    for rows in (1, 2, 32):  # (row, KV head) items at 1 and 2 rows on two threads, whole rows at 32
        lens = torch.randint(1, 700, (rows,), generator=g)
        lens[0] = 700
        width = (int(lens.max()) + bs - 1) // bs
        k, v = (torch.randn(rows * width + 3, bs, KVH, D, generator=g).to(dtype) for _ in range(2))
        tables = torch.randperm(rows * width + 3, generator=g)[:rows * width].reshape(rows, width)
        q = torch.randn(rows, H, D, generator=g)
        o = native.paged_decode_attention(q, k, v, tables, lens)
        ref = []  # per row: softmax(q k^T / 8) v over the row's own keys, fp32
        for r in range(rows):
            keys = tables[r].repeat_interleave(bs) * bs + torch.arange(bs).repeat(width)
            kr, vr = (c.reshape(-1, KVH, D)[keys[:lens[r]]].float().repeat_interleave(H // KVH, 1) for c in (k, v))
            p = torch.softmax(torch.einsum("hd,thd->ht", q[r], kr) / 8, -1)
            ref.append(torch.einsum("ht,thd->hd", p, vr))
        err = float((o - torch.stack(ref)).abs().max())
        out[f"{dtype}-{rows}"] = [o.view(torch.int32).flatten().tolist(), err]
head = q8a16.pack(*native.quantize_q8_0(torch.randn(4096, 576, generator=g) * 0.05))  # the LM head's fetches
for rows in (1, 5, 32):
    out[f"head-{rows}"] = q8a16.matmul(torch.randn(rows, 576, generator=g), *head).view(torch.int32).flatten().tolist()
json.dump(out, sys.stdout)
"""


@pytest.mark.skipif(not native.available() or "avx2" not in isa_mod.isas(), reason="the fetches ahead need AVX2")
def test_the_attention_and_the_lm_head_are_the_same_bits_whichever_cache_they_fetch_into():
    """The decode attention's paths (one row's items, several rows' items, whole rows) and the
    LM head's tiles, built fetching ahead into L1 and into L2: the same bits, each attention the
    softmax attention."""
    runs = {}
    for level in ("l1", "l2"):
        env = dict(os.environ, **{isa_mod.PREFETCH_ENV: level})
        r = subprocess.run([sys.executable, "-c", _ATTENTION], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        runs[level] = json.loads(r.stdout)
    assert runs["l1"].pop("library") != runs["l2"].pop("library")  # two builds
    assert runs["l1"] == runs["l2"]
    assert all(v[1] < 1e-4 for key, v in runs["l2"].items() if not key.startswith("head"))
    assert len(runs["l2"]) == 9
