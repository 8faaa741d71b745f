"""engine.native: the weight-only quantized CPU matmuls (int8, Q4_1, Q8_0) against torch references,
the quantizers, input validation and the compile cache."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.kernels import native
from pdserve.engine.kernels.native import w4a8

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels cannot be built here (no gcc?)")

SHAPES = [(960, 576), (576, 1536), (7, 64), (13, 44)]  # (13, 44): K not a multiple of 8 (int8 only)
MS = [1, 2, 3, 5, 8, 16, 33]


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32 accumulation over K terms: error relative to the output's magnitude."""
    assert y.dtype == torch.float32 and y.shape == ref.shape
    err = (y.double() - ref).abs().max().item()
    assert err <= 1e-4 * max(ref.abs().max().item(), 1e-6), err


def _weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


@pytest.mark.parametrize("n,k", SHAPES)
def test_int8_matches_reference(n, k):
    q, s = native.quantize_int8(_weights(n, k))
    w = native.dequantize_int8(q, s).double()
    for m in MS:
        x = torch.randn(m, k)
        _close(native.int8_matmul(x, q, s), x.double() @ w.T)


@pytest.mark.parametrize("n,k", [s for s in SHAPES if s[1] % 32 == 0])
def test_q4_1_matches_reference(n, k):
    p, d, mn = native.quantize_q4_1(_weights(n, k))
    w = native.dequantize_q4_1(p, d, mn).double()
    for m in MS:
        x = torch.randn(m, k)
        _close(native.q4_1_matmul(x, p, d, mn), x.double() @ w.T)


@pytest.mark.parametrize("n,k", [s for s in SHAPES if s[1] % 32 == 0])
def test_q8_0_matches_reference(n, k):
    q, d = native.quantize_q8_0(_weights(n, k))
    w = native.dequantize_q8_0(q, d).double()
    for m in MS:
        x = torch.randn(m, k)
        _close(native.q8_0_matmul(x, q, d), x.double() @ w.T)
    with pytest.raises(ValueError, match="K % 32 == 0"):
        native.q8_0_matmul(torch.randn(1, k), q, d[:, :-1].contiguous())


def test_quantize_q8_0_round_trip_exact():
    """Weights on a Q8_0 grid (q * d, max |q| = 127 in each group) come back to float rounding."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (8, 4, 32), generator=g)
    q[..., 0] = 127
    d = torch.rand(8, 4, 1, generator=g) / 100
    w = (q * d).reshape(8, 128)
    assert torch.allclose(native.dequantize_q8_0(*native.quantize_q8_0(w)), w, rtol=1e-6, atol=0)


def test_lm_head_shape():
    """The largest matrix of a decode step (SmolLM2's LM head), small M only: it is big."""
    w = _weights(49152, 576)
    q, s = native.quantize_int8(w)
    p, d, mn = native.quantize_q4_1(w)
    w8, w4 = native.dequantize_int8(q, s), native.dequantize_q4_1(p, d, mn)
    for m in (1, 2):
        x = torch.randn(m, 576)
        _close(native.int8_matmul(x, q, s), (x @ w8.T).double())
        _close(native.q4_1_matmul(x, p, d, mn), (x @ w4.T).double())


def test_batch_invariant():
    """A row's output is bitwise the same whatever the other rows (the tiles only change which
    rows share a weight load, never a row's summation order)."""
    q, s = native.quantize_int8(_weights(576, 1536))
    p, d, mn = native.quantize_q4_1(_weights(576, 1536))
    q8 = native.quantize_q8_0(_weights(576, 1536))
    x = torch.randn(33, 1536)
    for f, args in ((native.int8_matmul, (q, s)), (native.q4_1_matmul, (p, d, mn)), (native.q8_0_matmul, q8)):
        full = f(x, *args)
        for m in (1, 2, 5, 8, 9, 16):
            assert torch.equal(f(x[:m].contiguous(), *args), full[:m])
        assert torch.equal(f(x[20:21].contiguous(), *args), full[20:21])


def test_quantize_q4_1_round_trip_exact():
    """Weights already on a Q4_1 grid (q * d + m with exactly representable d, m) come back exactly."""
    g = torch.Generator().manual_seed(1)
    n, k = 16, 128
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15  # each group spans the full range, so d and m are recovered
    d = torch.randint(1, 64, (n, k // 32, 1), generator=g).float() / 256
    m = torch.randint(-64, 64, (n, k // 32, 1), generator=g).float() / 128
    w = (q * d + m).reshape(n, k)
    p, d2, m2 = native.quantize_q4_1(w)
    assert p.dtype == torch.uint8 and p.shape == (n, k // 2) and d2.shape == m2.shape == (n, k // 32)
    assert torch.equal(native.dequantize_q4_1(p, d2, m2), w)
    # the documented (GGUF) layout: byte 16g + j holds elements 32g + j (low) and 32g + 16 + j (high)
    assert torch.equal(p[:, 16 + 3] & 15, q[:, 1, 3].to(torch.uint8))
    assert torch.equal(p[:, 16 + 3] >> 4, q[:, 1, 16 + 3].to(torch.uint8))


def test_quantize_int8_error_and_zero_row():
    w = _weights(64, 256)
    w[3] = 0
    q, s = native.quantize_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (64,)
    assert (native.dequantize_int8(q, s) - w).abs().max() <= s.max() / 2 + 1e-7
    assert torch.equal(q[3], torch.zeros(256, dtype=torch.int8))


def test_bad_input_raises():
    q, s = native.quantize_int8(_weights(8, 64))
    p, d, mn = native.quantize_q4_1(_weights(8, 64))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError):
        native.quantize_q4_1(torch.randn(4, 48))  # K not a multiple of 32
    with pytest.raises(ValueError):
        native.quantize_int8(torch.randn(4))
    bad_int8 = [(x.double(), q, s), (x, q.float(), s), (x, q, s.double()), (torch.randn(2, 32), q, s),
                (x.t(), q, s), (x, q, s[:4]), (torch.randn(2, 2, 64), q, s), (x[:, ::2], q[:, ::2], s)]
    for args in bad_int8:
        with pytest.raises(ValueError):
            native.int8_matmul(*args)
    bad_q4 = [(x.half(), p, d, mn), (x, p.to(torch.int8), d, mn), (x, p, d.double(), mn), (x, p, d, mn[:, :1]),
              (torch.randn(2, 128), p, d, mn), (torch.randn(2, 48), p[:, :24], d, mn)]
    for args in bad_q4:
        with pytest.raises(ValueError):
            native.q4_1_matmul(*args)


def test_cache_reuses_library(tmp_path, monkeypatch):
    """First build compiles into $PDSERVE_CACHE_DIR/native, each source to its object and one
    link; a second finds the library and compiles nothing."""
    from pdserve.engine.kernels.native import compile as compile_mod

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    calls = []
    real_popen = compile_mod.subprocess.Popen

    def popen(cmd, *a, **kw):
        if "-o" in cmd:  # a compile or the link (subprocess.run's own Popen asks gcc --version)
            calls.append(cmd)
        return real_popen(cmd, *a, **kw)

    monkeypatch.setattr(compile_mod.subprocess, "Popen", popen)
    path = native.build()
    assert path.parent == tmp_path / "native" and path.exists()
    objects = [c for c in calls if "-c" in c]
    assert len(objects) == len(native.SRC) and len(calls) == len(objects) + 1  # every source, then the link
    assert "-shared" in calls[-1] and all(c[-2] in calls[-1] for c in objects)
    mtime = path.stat().st_mtime_ns
    assert native.build() == path and path.stat().st_mtime_ns == mtime
    assert len(calls) == len(objects) + 1  # no second compile
    assert [f.name for f in path.parent.iterdir()] == [path.name]  # no temp file or object left behind


def test_compile_failure_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C;\n")
    monkeypatch.setattr(native, "SRC", bad)
    with pytest.raises(native.NativeKernelUnavailable, match="error"):
        native.build()
    assert list((tmp_path / "native").iterdir()) == []  # no temp file or object directory left
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(native.NativeKernelUnavailable):
        native.build()


def test_threads_do_not_change_results():
    q, s = native.quantize_int8(_weights(960, 576))
    x = torch.randn(4, 576)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.int8_matmul(x, q, s)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, native.int8_matmul(x, q, s))


def test_scalar_fallback(tmp_path, monkeypatch):
    """The portable path (built where the CPU lacks AVX2) computes the same products."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_flags", lambda: ["-O2", "-fPIC", "-shared", "-fopenmp"])
    # every function load() binds, restored after the test: one left on the scalar build would
    # change the numerics of every later engine in the session
    for name in native.BOUND:
        monkeypatch.setattr(native, name, None)
    monkeypatch.setattr(w4a8, "_fn", None)
    assert native.load().woq_has_avx2() == 0
    for n, k in ((7, 64), (96, 576)):
        w = _weights(n, k)
        q, s = native.quantize_int8(w)
        p, d, mn = native.quantize_q4_1(w)
        x = torch.randn(3, k)
        _close(native.int8_matmul(x, q, s), x.double() @ native.dequantize_int8(q, s).double().T)
        _close(native.q4_1_matmul(x, p, d, mn), x.double() @ native.dequantize_q4_1(p, d, mn).double().T)


@pytest.mark.parametrize("T,I", [(1, 1536), (7, 13), (65, 1536)])
def test_fused_silu_mul_matches_torch(T, I):
    import torch.nn.functional as F

    from pdserve.engine.kernels import native

    g = torch.Generator().manual_seed(T * I)
    gate_up = torch.randn(T, 2 * I, generator=g) * 6
    gate_up[0, 0], gate_up[-1, I - 1] = 120.0, -120.0  # saturating exp in both directions
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(native.silu_mul(gate_up), F.silu(gate) * up, rtol=2e-6, atol=1e-6)
    with pytest.raises(ValueError):
        native.silu_mul(gate_up[:, 1:])  # not contiguous, odd width


def test_fused_rope_matches_the_torch_rotation_and_leaves_v_alone():
    from pdserve.engine.kernels import native
    from pdserve.engine.model.llama import RotaryEmbedding, apply_rope

    rot = RotaryEmbedding(64, 256, 10000.0)
    T, H, KV = 37, 9, 3
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(T, (H + 2 * KV) * 64, generator=g)
    pos = torch.randint(0, 256, (T,), generator=g)
    cos, sin = rot.cos[pos].unsqueeze(1), rot.sin[pos].unsqueeze(1)
    q, k, v = qkv.split((H * 64, KV * 64, KV * 64), dim=-1)
    want_q, want_k = apply_rope(q.reshape(T, H, 64), cos, sin), apply_rope(k.reshape(T, KV, 64), cos, sin)
    out = native.rope_(qkv.clone(), pos, rot.cos, rot.sin, H + KV, 64)
    torch.testing.assert_close(out[:, :H * 64].view(T, H, 64), want_q, rtol=0, atol=2e-6)
    torch.testing.assert_close(out[:, H * 64:(H + KV) * 64].view(T, KV, 64), want_k, rtol=0, atol=2e-6)
    assert torch.equal(out[:, (H + KV) * 64:], v)
    with pytest.raises(ValueError):
        native.rope_(qkv.clone(), torch.full((T,), 256), rot.cos, rot.sin, H + KV, 64)  # past the table


@pytest.mark.parametrize("T,D", [(1, 576), (5, 13), (129, 576)])
def test_fused_add_rms_norm_updates_the_stream_and_matches_torch(T, D):
    """h += delta in place, and the returned norm equals torch's add + rms_norm; a row's
    result is the same alone as in a batch (its sums run in one order); no delta: the norm."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(T * D)
    h, delta, w = torch.randn(T, D, generator=g) * 4, torch.randn(T, D, generator=g), torch.randn(D, generator=g)
    want_h = h + delta
    want = F.rms_norm(want_h, (D,), w, 1e-5)
    got_h = h.clone()
    out = native.add_rms_norm(got_h, delta, w, 1e-5)
    torch.testing.assert_close(got_h, want_h, rtol=0, atol=0)
    torch.testing.assert_close(out, want, rtol=2e-6, atol=2e-6)
    alone = native.add_rms_norm(h[-1:].clone(), delta[-1:], w, 1e-5)
    assert torch.equal(alone, out[-1:])
    kept = want_h.clone()
    torch.testing.assert_close(native.add_rms_norm(kept, None, w, 1e-5), want, rtol=2e-6, atol=2e-6)
    assert torch.equal(kept, want_h)
    with pytest.raises(ValueError):
        native.add_rms_norm(h.clone(), delta[:, :1], w, 1e-5)  # shapes differ


def test_the_engine_gives_the_same_tokens_with_and_without_the_fused_ops(smollm):
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.core.engine import LLMEngine
    from pdserve.common.sampling_params import SamplingParams
    from pdserve.engine.model.weights import load_model
    # fp32 math: the default's int8 activations would turn the two paths' float rounding
    # differences into different tokens (what this compares is the ops, not the numerics)
    loaded, tok = load_model(quantization="exact"), smollm[1]
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a haiku about rivers."}]),
                        add_special_tokens=False)
    outs = {}
    for attention in ("auto", "torch"):
        eng = LLMEngine(loaded, EngineConfig(attention=attention, cache=CacheConfig(kv_cache_memory=16 << 20)), tok)
        assert loaded.model.native_ops == (attention == "auto")
        eng.add_request("r", prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        toks = []
        while eng.has_unfinished_requests():
            for o in eng.step():
                toks += o.new_token_ids
        outs[attention] = toks
        assert eng.blocks.num_used_blocks == 0
    assert outs["auto"] == outs["torch"] and len(outs["auto"]) == 24
