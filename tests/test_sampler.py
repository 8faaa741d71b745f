"""Sampler: truncation masks, penalties, distribution and determinism."""
import math

import torch

from pdserve.engine.request import Request
from pdserve.engine.sampler import _truncate, apply_penalties, sample
from pdserve.engine.sampling_params import SamplingParams


def req(params, prompt=(1, 2), output=(), seed=0):
    r = Request("r", list(prompt), params, max_tokens=100, generator=torch.Generator().manual_seed(seed))
    for t in output:
        r.append_output(t)
    return r


LOGITS = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))


def kept(mask_logits):
    return torch.isfinite(mask_logits).nonzero().flatten().tolist()


def test_top_k_top_p_min_p_masks():
    assert kept(_truncate(LOGITS, 2, 1.0, 0.0)) == [0, 1]
    assert kept(_truncate(LOGITS, 0, 0.7, 0.0)) == [0, 1]      # 0.4 + 0.3 reaches 0.7
    assert kept(_truncate(LOGITS, 0, 0.71, 0.0)) == [0, 1, 2]
    assert kept(_truncate(LOGITS, 0, 0.01, 0.0)) == [0]        # the top token always stays
    assert kept(_truncate(LOGITS, 0, 1.0, 0.3)) == [0, 1, 2]   # >= 0.3 * 0.4
    assert kept(_truncate(LOGITS, 3, 0.5, 0.0)) == [0, 1]


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
