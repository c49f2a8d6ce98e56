"""The `hf` engine's token choice (`sampling.py`) on hand-valued logits.

Logits are written as logs of small numbers so the softmax is readable: `ln([1, 3, 1])` has probabilities
[1/5, 3/5, 1/5]. Reported logprobs are log-softmax(logits / temperature), temperature 1 for greedy rows,
before top-k / top-p and the `min_new_tokens` mask.
"""

import math

import pytest
import torch
from torch.testing import assert_close

from rollflow.engines.base import SamplingParams
from rollflow.engines.sampling import draw_uniforms, filter_top_k_top_p, sample_tokens

LN = math.log


def _logits(*rows):
    """[B, V] logits whose softmax is each row normalized: `_logits([1, 3, 1])` -> probabilities 1/5, 3/5, 1/5."""
    return torch.tensor([[LN(x) if x else float("-inf") for x in row] for row in rows])


def _sample(logits, temperatures=None, greedy=None, **kwargs):
    rows = logits.shape[0]
    temperatures = torch.ones(rows) if temperatures is None else torch.tensor(temperatures)
    greedy = torch.zeros(rows, dtype=torch.bool) if greedy is None else torch.tensor(greedy)
    return sample_tokens(logits, temperatures, greedy, **kwargs)


def test_greedy_picks_the_argmax_and_reports_its_log_softmax():
    # Row 0: exp = [1, 3, 1], sum 5 -> token 1, ln(3/5) = -0.510826.
    # Row 1: exp = [4, 1, 5], sum 10 -> token 2, ln(5/10) = -0.693147.
    logits = _logits([1, 3, 1], [4, 1, 5])
    tokens, logprobs = _sample(logits, greedy=[True, True], all_greedy=True)
    assert tokens.tolist() == [1, 2]
    assert_close(logprobs, torch.tensor([-0.510826, -0.693147]), atol=1e-6, rtol=0)


def test_logprobs_are_of_the_tempered_distribution_and_greedy_rows_of_the_raw_one():
    # logits ln([1, 9]): raw probabilities [1/10, 9/10]. At T = 2 the scaled logits are ln([1, 3]):
    # probabilities [1/4, 3/4], cdf [0.25, 1.0].
    # Row 0, u = 0.1: the first cdf entry above 0.1 is 0.25 -> token 0, ln(1/4) = -1.386294 (raw: -2.302585).
    # Row 1, u = 0.5: above 0.5 first at 1.0 -> token 1, ln(3/4) = -0.287682 (raw: -0.105361).
    # Row 2 is greedy (the engine gives greedy rows temperature 1): token 1, ln(9/10) = -0.105361.
    logits = _logits([1, 9], [1, 9], [1, 9])
    tokens, logprobs = _sample(logits, temperatures=[2.0, 2.0, 1.0], greedy=[False, False, True],
                               uniforms=torch.tensor([0.1, 0.5, 0.99]))
    assert tokens.tolist() == [0, 1, 1]
    assert_close(logprobs, torch.tensor([-1.386294, -0.287682, -0.105361]), atol=1e-6, rtol=0)


def test_top_k_1_draws_the_greedy_token_with_the_unfiltered_logprob():
    # Probabilities [1/6, 3/6, 2/6]: top-k 1 keeps token 1 only, so every draw is the argmax, and its
    # reported logprob is ln(3/6) = -0.693147 (before the filter, which would make it ln 1 = 0).
    logits = _logits([1, 3, 2]).expand(200, 3)
    params = [SamplingParams(top_k=1)] * 200
    tokens, logprobs = _sample(logits, filter_params=params, generator=torch.Generator().manual_seed(0))
    greedy_tokens, greedy_logprobs = _sample(logits, greedy=[True] * 200, all_greedy=True)
    assert tokens.tolist() == [1] * 200 == greedy_tokens.tolist()
    assert_close(logprobs, torch.full((200,), -0.693147), atol=1e-6, rtol=0)
    assert_close(logprobs, greedy_logprobs)


def test_top_p_below_the_top_probability_keeps_only_the_top_token():
    # Probabilities [0.1, 0.7, 0.2]; sorted 0.7, 0.2, 0.1 with mass before each 0, 0.7, 0.9.
    # top_p 0.5 drops the tokens whose mass before exceeds 0.5: only token 1 stays; ln 0.7 = -0.356675.
    logits = _logits([1, 7, 2]).expand(200, 3)
    params = [SamplingParams(top_p=0.5)] * 200
    tokens, logprobs = _sample(logits, filter_params=params, generator=torch.Generator().manual_seed(0))
    assert tokens.tolist() == [1] * 200
    assert_close(logprobs, torch.full((200,), -0.356675), atol=1e-6, rtol=0)


def test_top_p_keeps_the_token_that_crosses_it():
    # Same probabilities; top_p 0.8: mass before token 2 is 0.7 <= 0.8 (kept, it crosses 0.8), before
    # token 0 it is 0.9 > 0.8 (dropped). Filtered probabilities [0, 7/9, 2/9], cdf [0, 0.777778, 1].
    filtered = filter_top_k_top_p(_logits([1, 7, 2]), [SamplingParams(top_p=0.8)])
    assert_close(filtered, torch.tensor([[float("-inf"), LN(7), LN(2)]]))
    # Inverse CDF: u = 0 -> the first cdf entry above 0 is token 1 (token 0 has no mass, never drawn);
    # u = 0.5 -> token 1; u = 0.8 -> 0.777778 is not above it -> token 2.
    tokens, _ = _sample(_logits([1, 7, 2]).expand(3, 3), filter_params=[SamplingParams(top_p=0.8)] * 3,
                        uniforms=torch.tensor([0.0, 0.5, 0.8]))
    assert tokens.tolist() == [1, 1, 2]


def test_top_k_keeps_ties_with_the_kth_logit():
    # Logits [1, 3, 2, 3]: the 2 largest are 3, 3 -> keep the values >= 3; the 3 largest end at 2.
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0]] * 2)
    filtered = filter_top_k_top_p(logits, [SamplingParams(top_k=2), SamplingParams(top_k=3)])
    inf = float("-inf")
    assert_close(filtered, torch.tensor([[inf, 3.0, inf, 3.0], [inf, 3.0, 2.0, 3.0]]))
    no_filter = [SamplingParams(), SamplingParams()]
    assert filter_top_k_top_p(logits, no_filter) is logits  # nothing to filter: not even copied


def test_masked_tokens_are_never_drawn():
    # Probabilities [0.1, 0.2, 0.3, 0.4]; top-k 2 keeps tokens 2 and 3 (filtered: 3/7, 4/7).
    logits = _logits([1, 2, 3, 4]).expand(2000, 4)
    tokens, _ = _sample(logits, filter_params=[SamplingParams(top_k=2)] * 2000,
                        generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=4).tolist()
    assert counts[:2] == [0, 0]
    assert abs(counts[3] / 2000 - 4 / 7) < 0.05  # 0.571; the standard error of 2000 draws is 0.011


def test_stop_ids_of_blocked_rows_are_never_chosen_but_logprobs_stay_unmasked():
    # Logits [0, 1, 5]: log-sum-exp = ln(1 + e + e^5) = ln(1 + 2.718282 + 148.413159) = ln 152.131441
    # = 5.024745. Stop ids: rows 0, 1, 3 have stop id 2; row 2 has none (all -1 padding).
    # Row 0, greedy and blocked: token 2 banned -> argmax of [0, 1] = token 1, logprob 1 - 5.024745.
    # Row 1, greedy, not blocked: token 2, logprob 5 - 5.024745 = -0.024745.
    # Row 2, greedy and blocked, but without stop ids: token 2, -0.024745.
    # Row 3, sampled and blocked, u = 0: the first token with mass, token 0, logprob 0 - 5.024745.
    logits = torch.tensor([[0.0, 1.0, 5.0]]).expand(4, 3)
    stop_ids = torch.tensor([[2, -1], [2, -1], [-1, -1], [2, -1]])
    tokens, logprobs = _sample(logits, greedy=[True, True, True, False], stop_ids=stop_ids,
                               stop_blocked=torch.tensor([True, False, True, True]),
                               uniforms=torch.tensor([0.5, 0.5, 0.5, 0.0]))
    assert tokens.tolist() == [1, 2, 2, 0]
    assert_close(logprobs, torch.tensor([-4.024745, -0.024745, -0.024745, -5.024745]), atol=1e-6, rtol=0)
    # Drawn many times, a blocked row never stops even though the stop id holds 97.6% of the mass.
    many = torch.tensor([[0.0, 1.0, 5.0]]).expand(1000, 3)
    drawn, _ = _sample(many, stop_ids=torch.tensor([[2]]).expand(1000, 1),
                       stop_blocked=torch.ones(1000, dtype=torch.bool), generator=torch.Generator().manual_seed(0))
    assert 2 not in drawn.tolist()
    with pytest.raises(ValueError, match="go together"):
        _sample(logits, stop_ids=stop_ids)


def test_a_seeded_generator_gives_a_reproducible_draw():
    logits = torch.zeros(50, 4)  # uniform over 4 tokens: draws differ from row to row
    first, _ = _sample(logits, generator=torch.Generator().manual_seed(7))
    second, _ = _sample(logits, generator=torch.Generator().manual_seed(7))
    other, _ = _sample(logits, generator=torch.Generator().manual_seed(8))
    assert first.tolist() == second.tolist() != other.tolist()
    # One multinomial draw from the generator, of the softmax.
    expected = torch.multinomial(torch.full((50, 4), 0.25), 1, generator=torch.Generator().manual_seed(7))
    assert first.tolist() == expected.squeeze(1).tolist()


def test_draw_uniforms_gives_a_seeded_row_its_own_draws_wherever_it_sits():
    # Row 0 unseeded (engine generator), row 1 seeded with 3; width 4, limits 2 and 3, zeros past them.
    engine = torch.Generator().manual_seed(0)
    uniforms = draw_uniforms([2, 3], [None, torch.Generator().manual_seed(3)], 4, engine)
    assert_close(uniforms[0, :2], torch.rand(2, generator=torch.Generator().manual_seed(0)))
    assert_close(uniforms[1, :3], torch.rand(3, generator=torch.Generator().manual_seed(3)))
    assert uniforms[0, 2:].tolist() == [0.0, 0.0] and uniforms[1, 3:].tolist() == [0.0]
    # Alone, first in the batch, after other rows used the engine generator: the same draws.
    alone = draw_uniforms([3], [torch.Generator().manual_seed(3)], 4, torch.Generator().manual_seed(1))
    assert_close(alone[0], uniforms[1])


def test_non_finite_logits_are_refused():
    with pytest.raises(FloatingPointError, match="not finite"):
        _sample(torch.tensor([[0.0, float("nan")]]), greedy=[True], all_greedy=True)


def test_a_batch_chooses_what_each_row_would_alone():
    # The vectorized step against a loop of one-row calls, with every feature on (inverse CDF: no shared RNG).
    torch.manual_seed(0)
    logits = torch.randn(6, 11) * 3  # [B, V]
    temperatures = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 2.0])
    greedy = torch.tensor([True, False, False, False, False, False])
    params = [SamplingParams(temperature=0), SamplingParams(top_k=3), SamplingParams(top_p=0.6),
              SamplingParams(), SamplingParams(top_k=5, top_p=0.9), SamplingParams(top_k=1)]
    stop_ids = torch.tensor([[0, 4], [4, -1], [-1, -1], [1, 2], [3, -1], [0, -1]])
    blocked = torch.tensor([True, True, False, True, False, True])
    uniforms = torch.tensor([0.3, 0.05, 0.5, 0.95, 0.7, 0.2])
    tokens, logprobs = sample_tokens(logits, temperatures, greedy, filter_params=params, stop_ids=stop_ids,
                                     stop_blocked=blocked, uniforms=uniforms)
    for i in range(6):
        alone = sample_tokens(logits[i:i + 1], temperatures[i:i + 1], greedy[i:i + 1],
                              filter_params=params[i:i + 1], stop_ids=stop_ids[i:i + 1],
                              stop_blocked=blocked[i:i + 1], uniforms=uniforms[i:i + 1])
        assert (int(tokens[i]), float(logprobs[i])) == (int(alone[0]), float(alone[1]))
        # The reported logprob is the tempered log-softmax at the chosen token, whatever filtered it.
        expected = torch.log_softmax(logits[i] / temperatures[i], -1)[tokens[i]]
        assert_close(logprobs[i], expected)
