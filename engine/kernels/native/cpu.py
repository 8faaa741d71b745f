"""Which instruction set the native kernels are built for on this CPU: the best it has,
chosen at start from its flags (Linux's /proc/cpuinfo), or a lower one PDSERVE_ISA names (to
compare, or to check the lower path on a CPU that has more). No torch: a pure lookup."""
from __future__ import annotations

import os


def cpu_identity() -> tuple[str, int]:
    """This CPU's (vendor, family) as /proc/cpuinfo lists them (("", 0) where it has none)."""
    vendor, family = "", 0
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id":
                    vendor = value.strip()
                elif key.strip() == "cpu family":
                    family = int(value.strip() or 0)
                elif not line.strip():
                    break  # the first processor's record is enough
    except (OSError, ValueError):
        pass
    return vendor, family


def cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux lists them (empty where /proc/cpuinfo has none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# The instruction sets the kernels can be built for, best first: the CPU flags each needs
# (Linux's names) and its compiler flags. avx512-vnni and avx-vnni change the integer tiles
# (vnni.h: vpdpbusd, bitwise the AVX2 result); avx512-amx adds the bf16 tile matmul (amx.c) on
# which "auto" runs prompt rows (engine/model/quant.py); "portable" is the scalar C every CPU runs.
_AVX2 = ("avx2", "fma")
_AVX512 = (frozenset({*_AVX2, "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}),
           ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"))
ISAS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "avx512-amx": (_AVX512[0] | {"avx512_bf16", "amx_tile", "amx_bf16"},
                   (*_AVX512[1], "-mavx512bf16", "-mamx-tile", "-mamx-bf16")),
    "avx512-vnni": _AVX512,
    "avx-vnni": (frozenset({*_AVX2, "avx_vnni"}), ("-mavx2", "-mfma", "-mavxvnni")),
    "avx2": (frozenset(_AVX2), ("-mavx2", "-mfma")),
    "portable": (frozenset(), ()),
}
ISA_ENV = "PDSERVE_ISA"  # names another instruction set this CPU has (a check, a comparison)
NARROW_ROWS_ENV = "PDSERVE_NARROW_ROWS"  # sets narrow_rows (a check, a comparison)
PREFETCH_ENV = "PDSERVE_PREFETCH"  # "l1" or "l2": sets prefetch_l2 (a check, a comparison)
BF16_VECTORS_ENV = "PDSERVE_BF16_VECTORS"  # "0" or "1": sets bf16_vectors (a comparison, fp32 attention)
# AMD's Zen 4 (family 25 with AVX-512) runs a 512-bit operation as two 256-bit halves: there the
# decode steps' W4A8 tiles over nibble-packed weights in 256-bit vectors were 1.22-1.28x faster
# at 1-4 rows and 1.15-1.19x at 8, level at 16 and 32; over byte weights (prompts) 0.82-0.96x at
# every row count (bench/NOTES.md, twenty-third session)
ZEN4 = ("AuthenticAMD", 25)


class UnknownISA(ValueError):
    """PDSERVE_ISA names an instruction set that is not in ISAS, or one this CPU lacks."""


def isa(flags: set[str] | None = None) -> str:
    """The instruction set the kernels are built for here: the best in ISAS this CPU has, or
    the one PDSERVE_ISA names (which the CPU must have)."""
    flags = cpu_flags() if flags is None else flags
    want = os.environ.get(ISA_ENV, "").strip()
    if not want:
        return isas(flags)[0]
    if want not in ISAS:
        raise UnknownISA(f"{ISA_ENV}={want!r} is not one of {', '.join(ISAS)}")
    if not ISAS[want][0] <= flags:
        raise UnknownISA(f"{ISA_ENV}={want!r}: this CPU lacks {', '.join(sorted(ISAS[want][0] - flags))}")
    return want


def isas(flags: set[str] | None = None) -> list[str]:
    """Every instruction set in ISAS this CPU has, best first."""
    flags = cpu_flags() if flags is None else flags
    return [name for name, (needs, _) in ISAS.items() if needs <= flags]


def narrow_rows(name: str, identity: tuple[str, int] | None = None) -> int:
    """Up to how many rows an AVX-512 build's W4A8 matmuls over nibble-packed weights (the
    decode step's) take 256-bit tiles (vnni.h
    PDSERVE_NARROW_ROWS): 8 on a Zen 4, else 0 (512-bit tiles at every row count), or what
    PDSERVE_NARROW_ROWS says (a whole number)."""
    want = os.environ.get(NARROW_ROWS_ENV, "").strip()
    if want:
        if not want.isdigit():
            raise UnknownISA(f"{NARROW_ROWS_ENV}={want!r} is not a whole number of rows")
        return int(want)
    if not name.startswith("avx512"):
        return 0
    return 8 if (cpu_identity() if identity is None else identity) == ZEN4 else 0


def prefetch_l2(identity: tuple[str, int] | None = None) -> bool:
    """Whether the kernels fetch what they read next into L2 rather than L1 (the PDSERVE_PREFETCH_L2
    define): the paged attention's KV blocks (attention.c; a (row, KV head) item's too) and the LM
    head's weights (q8a16.c). On AMD CPUs, where the attention read 1.4-2.3x faster so and one
    row's LM head 1.4x (a Zen 4, bench/NOTES.md, twenty-fourth session); elsewhere into L1, as
    measured on Intel; or as PDSERVE_PREFETCH says ("l1", "l2")."""
    want = os.environ.get(PREFETCH_ENV, "").strip().lower()
    if want:
        if want not in ("l1", "l2"):
            raise UnknownISA(f"{PREFETCH_ENV}={want!r} is not l1 or l2")
        return want == "l2"
    return (cpu_identity() if identity is None else identity)[0] == "AuthenticAMD"


def bf16_vectors(name: str, identity: tuple[str, int] | None = None) -> bool:
    """Whether the build for `name` targets AVX-512 BF16 beside VNNI, for the long prompt rows'
    attention in bf16 vectors (bf16_attention.c) and every other row's over a bf16 cache
    (attend.h `ATTEND_BF16`, the PDSERVE_BF16_VECTORS define): on an AMD CPU that has it (a Zen 4 runs
    `vdpbf16ps` at twice its fp32 multiply-add rate: 2-3x the fp32 kernel there). Not on an Intel
    Xeon without AMX, whose `vdpbf16ps` ran at half its fp32 rate (bench/NOTES.md, eighteenth
    session); the AMX build has BF16 anyway (its prompt attention runs on tiles). PDSERVE_BF16_VECTORS
    "0" keeps every row's attention in fp32, "1" takes the vectors wherever the CPU has them."""
    want = os.environ.get(BF16_VECTORS_ENV, "").strip()
    if want not in ("", "0", "1"):
        raise UnknownISA(f"{BF16_VECTORS_ENV}={want!r} is not 0 or 1")
    if want == "0" or name != "avx512-vnni" or "avx512_bf16" not in cpu_flags():
        return False
    return want == "1" or (cpu_identity() if identity is None else identity)[0] == "AuthenticAMD"


def build_flags(name: str) -> list[str]:
    """The compiler flags of the build for instruction set `name` on this CPU: its ISAS entry,
    F16C where the CPU has it, AVX-512 BF16 where `bf16_vectors`, and the defines that tune it to
    this CPU (narrow_rows, prefetch_l2) only where they change it."""
    cc, flags = ISAS[name][1], cpu_flags()
    narrow = narrow_rows(name) if name.startswith("avx512") else 0
    return ([*cc] + (["-mf16c"] if cc and "f16c" in flags else [])
            + (["-mavx512bf16", "-DPDSERVE_BF16_VECTORS"] if bf16_vectors(name) else [])
            + ([f"-DPDSERVE_NARROW_ROWS={narrow}"] if narrow else [])
            + (["-DPDSERVE_PREFETCH_L2"] if cc and prefetch_l2() else []))
