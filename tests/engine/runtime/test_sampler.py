"""The sampler alone: greedy argmax, the filtered distribution (temperature, then top-k, then top-p),
draws that stay inside it, and per-request seeds that reproduce whatever shares the batch."""

import math

import pytest
import torch

from specloop.engine.runtime.sampler import Sampler, filtered_probs
from specloop.engine.runtime.sequence import SamplingParams

pytestmark = pytest.mark.timeout(30)

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)


def log_probs(*probs: float) -> torch.Tensor:
    """Logits whose softmax at temperature 1 is `probs`."""
    return torch.tensor(probs).log()


def repeat(row: torch.Tensor, n: int) -> torch.Tensor:
    """One sequence with the same logits at n positions: `[1, n, V]`, so one call draws n times."""
    return row.view(1, 1, -1).expand(1, n, -1).contiguous()


def seeded_sampler(seq_id: int, params: SamplingParams) -> Sampler:
    sampler = Sampler(CPU)
    sampler.register(seq_id, params)
    return sampler


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.tensor([[[0.1, 3.0, -1.0, 2.9, 0.0], [5.0, 4.0, 3.0, 2.0, 1.0], [-2.0, -3.0, -1.0, -4.0, -5.0]],
                           [[0.0, 0.0, 0.0, 0.0, 7.0], [1.0, 2.0, 3.0, 4.0, 3.5], [0.0, -0.5, 0.5, -1.0, 0.25]]])
    out = Sampler(CPU).sample(logits, [0, 1], [GREEDY, GREEDY])
    assert out.dtype == torch.long
    assert out.tolist() == [[1, 0, 2], [4, 3, 2]]


def test_top_k_one_is_greedy_at_any_temperature() -> None:
    # The top token leads by a hair: a real draw at temperature 2 would pick others almost always.
    row = torch.zeros(50)
    row[17] = 0.01
    params = SamplingParams(temperature=2.0, top_k=1)
    assert params.greedy
    out = Sampler(CPU).sample(repeat(row, 300), [0], [params])
    assert out.tolist() == [[17] * 300]


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    row = log_probs(0.2, 0.15, 0.25, 0.2, 0.2)
    params = SamplingParams(temperature=1.0, top_p=1e-6, seed=0)
    out = seeded_sampler(0, params).sample(repeat(row, 500), [0], [params])
    assert out.tolist() == [[2] * 500]


def test_top_k_draws_stay_in_the_k_most_likely_tokens() -> None:
    row = torch.tensor([0.0, 2.0, -1.0, 1.9, 0.5, 1.8, 0.0, -3.0])  # top 3: tokens 1, 3, 5
    params = SamplingParams(temperature=1.0, top_k=3, seed=1)
    out = seeded_sampler(0, params).sample(repeat(row, 2000), [0], [params])
    assert set(out.flatten().tolist()) == {1, 3, 5}


def test_top_p_draws_stay_in_the_nucleus() -> None:
    row = log_probs(0.1, 0.3, 0.2, 0.4)  # by mass: 3 (0.4), 1 (0.3), 2 (0.2), 0 (0.1)
    params = SamplingParams(temperature=1.0, top_p=0.6, seed=2)  # 0.4 < 0.6 <= 0.7: tokens 3 and 1
    out = seeded_sampler(0, params).sample(repeat(row, 2000), [0], [params])
    assert set(out.flatten().tolist()) == {1, 3}


def test_draw_frequencies_follow_the_temperature() -> None:
    # logits [0, 2 ln 2] at T = 2 are [0, ln 2]: probabilities 1/3 and 2/3.
    row = torch.tensor([0.0, 2 * math.log(2)])
    params = SamplingParams(temperature=2.0, seed=3)
    n = 6000
    out = seeded_sampler(0, params).sample(repeat(row, n), [0], [params])
    ones = int(out.sum())
    sigma = math.sqrt(n * (1 / 3) * (2 / 3))
    assert abs(ones - n * 2 / 3) < 5 * sigma
    # At T = 1 the same logits give 1/5 and 4/5: clearly more ones.
    params = SamplingParams(temperature=1.0, seed=3)
    out = seeded_sampler(0, params).sample(repeat(row, n), [0], [params])
    assert abs(int(out.sum()) - n * 4 / 5) < 5 * math.sqrt(n * (1 / 5) * (4 / 5))


def test_filtered_probs_temperature() -> None:
    logits = torch.tensor([0.0, math.log(2)])
    assert torch.allclose(filtered_probs(logits, SamplingParams(temperature=1.0)), torch.tensor([1 / 3, 2 / 3]))
    assert torch.allclose(filtered_probs(logits, SamplingParams(temperature=0.5)), torch.tensor([1 / 5, 4 / 5]))
    assert torch.allclose(filtered_probs(logits, SamplingParams(temperature=2.0)),
                          torch.tensor([1 / (1 + math.sqrt(2)), math.sqrt(2) / (1 + math.sqrt(2))]))


def test_filtered_probs_top_k_renormalises_the_k_best() -> None:
    logits = log_probs(0.1, 0.4, 0.2, 0.3)
    got = filtered_probs(logits, SamplingParams(top_k=2))
    assert torch.allclose(got, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))
    # 0 means no top-k, and k at or past the vocabulary changes nothing.
    for k in (0, 4, 9):
        assert torch.allclose(filtered_probs(logits, SamplingParams(top_k=k)), torch.tensor([0.1, 0.4, 0.2, 0.3]))


def test_filtered_probs_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    logits = log_probs(0.125, 0.5, 0.125, 0.25)  # sorted: 0.5, 0.25, 0.125, 0.125
    cases = {
        0.3: [0.0, 1.0, 0.0, 0.0],  # 0.5 alone reaches 0.3
        0.6: [0.0, 2 / 3, 0.0, 1 / 3],  # 0.5 < 0.6 <= 0.75
        0.8: None,  # 0.75 < 0.8: a third token is needed; which of the tied 0.125s is unspecified
        1.0: [0.125, 0.5, 0.125, 0.25],
    }
    for p, expected in cases.items():
        got = filtered_probs(logits, SamplingParams(top_p=p))
        assert torch.allclose(got.sum(), torch.tensor(1.0))
        if expected is not None:
            assert torch.allclose(got, torch.tensor(expected)), p
    got = filtered_probs(logits, SamplingParams(top_p=0.8))
    assert torch.allclose(got[[1, 3]], torch.tensor([0.5, 0.25]) / 0.875)
    assert sorted(got[[0, 2]].tolist()) == pytest.approx([0.0, 0.125 / 0.875])


def test_filtered_probs_top_p_reached_exactly_stops_there() -> None:
    # Four equal logits give exactly 0.25 each: two tokens reach 0.5, three reach 0.75.
    logits = torch.zeros(4)
    for p, kept in ((0.5, 2), (0.75, 3), (0.76, 4)):
        got = sorted(filtered_probs(logits, SamplingParams(top_p=p)).tolist())
        assert got == pytest.approx([0.0] * (4 - kept) + [1 / kept] * kept), p


def test_filtered_probs_applies_top_k_before_top_p() -> None:
    logits = log_probs(0.4, 0.3, 0.2, 0.1)
    # Top-k 3 first: 4/9, 3/9, 2/9. The mass before token 2 is then 7/9 >= 0.75, so it goes.
    # (Top-p first would keep it: 0.4 + 0.3 = 0.7 < 0.75.)
    got = filtered_probs(logits, SamplingParams(top_k=3, top_p=0.75))
    assert torch.allclose(got, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))
    got = filtered_probs(logits, SamplingParams(top_k=3, top_p=0.8))
    assert torch.allclose(got, torch.tensor([4 / 9, 3 / 9, 2 / 9, 0.0]))


def test_filtered_probs_rows_are_independent() -> None:
    logits = torch.stack([log_probs(0.5, 0.3, 0.2), log_probs(0.2, 0.2, 0.6)])
    got = filtered_probs(logits, SamplingParams(top_p=0.55))
    assert torch.allclose(got, torch.tensor([[5 / 8, 3 / 8, 0.0], [0.0, 0.0, 1.0]]))


def test_seeded_request_repeats_its_tokens_whatever_shares_the_batch() -> None:
    vocab, n = 1000, 6
    gen = torch.Generator().manual_seed(0)
    steps = [torch.randn(4, n, vocab, generator=gen) for _ in range(3)]  # three engine steps
    seeded = SamplingParams(temperature=1.0, seed=7)

    alone = seeded_sampler(1, seeded)
    alone_tokens = [alone.sample(s[1:2], [1], [seeded])[0].tolist() for s in steps]

    mixed = Sampler(CPU)
    others = {10: SamplingParams(temperature=1.0, seed=99), 11: SamplingParams(temperature=0.7), 12: GREEDY}
    for seq_id, params in others.items():
        mixed.register(seq_id, params)
    mixed.register(1, seeded)
    ids = [10, 1, 11, 12]
    params = [others[10], seeded, others[11], others[12]]
    mixed_tokens = [mixed.sample(s, ids, params)[1].tolist() for s in steps]

    assert mixed_tokens == alone_tokens
    # The stream moves on from step to step, and a different seed gives a different stream.
    assert alone_tokens[0] != alone_tokens[1]
    other_seed = SamplingParams(temperature=1.0, seed=8)
    assert seeded_sampler(1, other_seed).sample(steps[0][1:2], [1], [other_seed])[0].tolist() != alone_tokens[0]


def test_registering_a_seed_again_restarts_its_stream() -> None:
    logits = torch.randn(1, 8, 500, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(temperature=1.0, seed=5)
    sampler = seeded_sampler(3, params)
    first = sampler.sample(logits, [3], [params]).tolist()
    second = sampler.sample(logits, [3], [params]).tolist()
    assert first != second
    sampler.release(3)
    sampler.register(3, params)
    assert sampler.sample(logits, [3], [params]).tolist() == first


def test_release_forgets_the_seed() -> None:
    logits = torch.zeros(1, 8, 1000)  # uniform: two independent streams agree with chance 1e-24
    params = SamplingParams(temperature=1.0, seed=5)
    reference = seeded_sampler(3, params)
    reference.sample(logits, [3], [params])
    continued = reference.sample(logits, [3], [params]).tolist()
    sampler = seeded_sampler(3, params)
    sampler.sample(logits, [3], [params])
    sampler.release(3)
    # The id now draws from the shared generator, not from where its seeded stream had got to.
    assert sampler.sample(logits, [3], [params]).tolist() != continued


def test_mixed_greedy_and_sampled_rows() -> None:
    n = 400
    row = torch.tensor([0.0, 1.0, 3.0, 2.9, -1.0])  # argmax 2; top 2: tokens 2 and 3
    logits = torch.cat([repeat(row, n), repeat(row.flip(0), n)])  # flipped: argmax 2, top 2: 1 and 2
    sampled = SamplingParams(temperature=1.0, top_k=2, seed=6)
    sampler = Sampler(CPU)
    sampler.register(21, sampled)
    out = sampler.sample(logits, [20, 21], [GREEDY, sampled])
    assert out.shape == (2, n)
    assert out[0].tolist() == [2] * n
    assert set(out[1].tolist()) == {1, 2}


def test_batch_and_parameter_lists_must_agree() -> None:
    with pytest.raises(AssertionError):
        Sampler(CPU).sample(torch.zeros(2, 1, 4), [0], [GREEDY])
