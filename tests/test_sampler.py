"""Sampler: truncation masks, penalties, distribution and determinism."""
import math

import pytest
import torch

from pdserve.engine.core.request import Request
from pdserve.engine.sampling.sampler import apply_penalties, sample, truncate
from pdserve.common.sampling_params import SamplingParams


def req(params, prompt=(1, 2), output=(), seed=0):
    r = Request("r", list(prompt), params, max_tokens=100, generator=torch.Generator().manual_seed(seed))
    for t in output:
        r.append_output(t)
    return r


LOGITS = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))


def kept(mask_logits):
    return torch.isfinite(mask_logits).nonzero().flatten().tolist()


def test_top_k_top_p_min_p_masks():
    assert kept(truncate(LOGITS, 2, 1.0, 0.0)) == [0, 1]
    assert kept(truncate(LOGITS, 0, 0.7, 0.0)) == [0, 1]      # 0.4 + 0.3 reaches 0.7
    assert kept(truncate(LOGITS, 0, 0.71, 0.0)) == [0, 1, 2]
    assert kept(truncate(LOGITS, 0, 0.01, 0.0)) == [0]        # the top token always stays
    assert kept(truncate(LOGITS, 0, 1.0, 0.3)) == [0, 1, 2]   # >= 0.3 * 0.4
    assert kept(truncate(LOGITS, 3, 0.5, 0.0)) == [0, 1]


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    r = req(SamplingParams(repetition_penalty=2.0), prompt=(0,), output=(1,))
    out = apply_penalties(logits.clone(), r)
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]
    r = req(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=(3,), output=(2, 2, 0))
    out = apply_penalties(logits.clone(), r)
    assert out.tolist() == [2.0 - 0.75, -2.0, 1.0 - 1.0, 0.5]  # prompt tokens are not penalized


def test_logit_bias_bans_and_forces_tokens_but_logprobs_stay_the_models():
    logits = torch.tensor([[0.0, 5.0, 4.9, 1.0]] * 3)
    reqs = [req(SamplingParams(temperature=0, logit_bias={1: -100.0}, logprobs=1)),  # ban the best
            req(SamplingParams(temperature=0, logit_bias={3: 100.0})),               # force the 4th
            req(SamplingParams(temperature=0))]
    tokens, lps = sample(logits, reqs)
    assert tokens == [2, 3, 1]
    assert lps[0].top[0][0] == 1  # the model's own distribution, as OpenAI reports it
    banned = req(SamplingParams(temperature=1.0, logit_bias={0: -100.0, 1: -100.0, 2: -100.0}), seed=7)
    assert {sample(logits[:1], [banned])[0][0] for _ in range(50)} == {3}


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 5.0, 4.9, 4.8]])  # token 1 is EOS, 2 a stop token id
    def pick(outputs):
        r = Request("r", [7], SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2]), max_tokens=10,
                    eos_token_id=1)
        for t in outputs:
            r.append_output(t)
        return sample(logits, [r])[0][0]
    assert pick([]) == 3 and pick([3]) == 3  # neither EOS nor the stop id while below 2 tokens
    assert pick([3, 3]) == 1


def test_greedy_and_penalized_greedy():
    logits = torch.tensor([[0.0, 5.0, 4.9], [0.0, 5.0, 4.9]])
    reqs = [req(SamplingParams(temperature=0)), req(SamplingParams(temperature=0, repetition_penalty=1.5), prompt=(1,))]
    tokens, _ = sample(logits, reqs)
    assert tokens == [1, 2]


def test_sampling_follows_the_distribution():
    params = SamplingParams(temperature=1.0)
    r = req(params, seed=123)
    counts = torch.zeros(5)
    n = 4000
    for _ in range(n):
        counts[sample(LOGITS.unsqueeze(0), [r])[0][0]] += 1
    expected = LOGITS.exp() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.0, (counts.tolist(), chi2)  # 4 dof: p < 0.001 above ~18.5


def test_sampling_never_picks_a_masked_token():
    """Inverse-CDF sampling over a distribution with zero-probability entries (truncated by
    top_k, or -inf logits at either end) only ever returns tokens of positive probability."""
    logits = torch.tensor([float("-inf"), 0.5, float("-inf"), 0.2, 3.0, float("-inf")])
    r = req(SamplingParams(temperature=1.0, top_k=2), seed=5)
    picked = {sample(logits.unsqueeze(0), [r])[0][0] for _ in range(500)}
    assert picked == {1, 4}


def test_seeded_rows_independent_of_batch():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    mk = lambda: [req(SamplingParams(temperature=0.9, seed=s), seed=s) for s in (7, 8, 9)]
    batch = sample(logits, mk())[0]
    single = [sample(logits[i:i + 1], [mk()[i]])[0][0] for i in range(3)]
    assert batch == single


def test_low_temperature_is_near_greedy():
    r = req(SamplingParams(temperature=0.01), seed=1)
    assert all(sample(LOGITS.unsqueeze(0), [r])[0][0] == 0 for _ in range(50))
    assert math.isclose(float(torch.logsumexp(LOGITS, 0)), 0.0, abs_tol=1e-6)


def test_the_c_sampler_draws_the_inverse_cdf_token_of_each_uniform():
    """native.sample_rows returns, for each uniform, the token whose CDF interval holds it
    (uniforms at interval midpoints, so rounding cannot move them), over long rows that span
    many of its 64-token blocks, with -inf entries, at a temperature."""
    from pdserve.engine.kernels import native

    g = torch.Generator().manual_seed(3)
    V, T = 1000, 0.7
    logits = torch.randn(2, V, generator=g)
    logits[:, ::7] = float("-inf")
    rows, uniforms, expected = [], [], []
    for row in range(2):
        p = torch.softmax(logits[row].double() / T, -1)
        cdf = p.cumsum(0)
        for tok in torch.randperm(V, generator=g)[:200].tolist():
            if p[tok] < 1e-4:  # intervals narrower than fp32 rounding of the sums: not a fair test
                continue
            lo = float(cdf[tok] - p[tok])
            rows.append(row)
            uniforms.append((lo + float(cdf[tok])) / 2)
            expected.append(tok)
    assert len(expected) > 100
    assert native.sample_rows(logits, rows, [1 / T] * len(rows), uniforms) == expected


def test_the_c_sampler_never_draws_a_masked_token_and_is_batch_invariant():
    from pdserve.engine.kernels import native

    logits = torch.full((3, 300), float("-inf"))
    logits[0, 299] = 0.0  # the only drawable token sits at the very end
    logits[1, :] = torch.linspace(-5, 5, 300)
    logits[1, 150:] = float("-inf")
    logits[2, 0] = 1.0
    u = [0.0, 0.5, 0.999999]
    assert native.sample_rows(logits, [0, 0, 0], [1.0] * 3, u) == [299] * 3
    drawn = native.sample_rows(logits, [1] * 3, [1.0] * 3, u)
    assert all(t < 150 for t in drawn) and drawn == sorted(drawn)
    assert native.sample_rows(logits, [2], [2.0], [0.7]) == [0]
    batch = native.sample_rows(logits, [1, 0, 2, 1], [1.0, 1.0, 2.0, 0.5], [0.3, 0.9, 0.7, 0.3])
    alone = [native.sample_rows(logits, [r], [t], [x])[0] for r, t, x in
             [(1, 1.0, 0.3), (0, 1.0, 0.9), (2, 2.0, 0.7), (1, 0.5, 0.3)]]
    assert batch == alone


def test_sampled_rows_draw_the_same_tokens_in_c_and_in_torch(monkeypatch):
    """The step's C sampler and the per-row torch path (CUDA logits, no native build) take
    the same token for the same seeded draws, plain, truncated and penalized rows alike."""
    from pdserve.engine.sampling import sampler

    logits = torch.randn(4, 2000, generator=torch.Generator().manual_seed(1)) * 3
    mk = lambda: [req(SamplingParams(temperature=0.8, seed=1), seed=1),  # noqa: E731
                  req(SamplingParams(temperature=1.2, top_k=50, top_p=0.9), seed=2),
                  req(SamplingParams(temperature=0.7, repetition_penalty=1.3), output=(5, 9), seed=3),
                  req(SamplingParams(temperature=0.0), seed=4)]
    reqs_c, reqs_t = mk(), mk()
    c = [sample(logits, reqs_c)[0] for _ in range(50)]
    monkeypatch.setattr(sampler, "_native_sampling", lambda: False)
    t = [sample(logits, reqs_t)[0] for _ in range(50)]
    assert sum(a != b for x, y in zip(c, t) for a, b in zip(x, y)) <= 1  # a uniform on an fp32 boundary, at most


def test_greedy_rows_take_torch_argmaxs_token_in_the_c_call_too(monkeypatch):
    """The C argmax (native/argmax.py) gives torch.argmax's index on every row: the first of
    tied maxima, the first NaN where there is one, +inf, rows all -inf, -0 tied with +0, row
    lengths off the vector width; for any subset of rows, on one thread or two, and through
    `sample` for greedy rows mixed with sampled ones and grammar-masked ones."""
    from pdserve.engine.kernels import native
    from pdserve.engine.kernels.native import argmax
    from pdserve.engine.sampling import sampler

    if not native.available():
        pytest.skip("the native kernels do not build here")
    g = torch.Generator().manual_seed(5)
    for v in (1, 7, 8, 9, 100, 49152):
        x = torch.randn(6, v, generator=g)
        assert argmax.rows(x, list(range(6))) == torch.argmax(x, -1).tolist()
    x = torch.randn(6, 1000, generator=g)
    x[0, 10] = x[0, 500] = 50.0                      # tied maxima: the first
    x[1, 903], x[1, 3] = float("nan"), float("nan")  # NaNs: the first one
    x[2] = float("-inf")                             # nothing finite: index 0
    x[3] = -1.0
    x[3, 7], x[3, 9] = -0.0, 0.0                     # -0 and +0 tie
    x[4, 999] = float("inf")
    x[5, 1] = float("nan")                           # a NaN beats +inf
    x[5, 2] = float("inf")
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert argmax.rows(x, list(range(6))) == torch.argmax(x, -1).tolist()
            assert argmax.rows(x, [5, 0, 3]) == [torch.argmax(x[i]).item() for i in (5, 0, 3)]
    finally:
        torch.set_num_threads(old)
    logits = torch.randn(4, 3000, generator=g)
    mk = lambda: [req(SamplingParams(temperature=0.0), seed=1), req(SamplingParams(temperature=0.9), seed=2),  # noqa: E731
                  req(SamplingParams(temperature=0.0), seed=3), req(SamplingParams(temperature=0.0), seed=4)]
    c = sample(logits, mk())[0]
    monkeypatch.setattr(sampler, "_native_sampling", lambda: False)
    t = sample(logits, mk())[0]
    assert c[0] == t[0] == int(torch.argmax(logits[0])) and c[2:] == t[2:] == torch.argmax(logits[2:], -1).tolist()
