"""The near-tie rule of greedy comparisons with transformers (tests/greedy.py): a flip between two tokens whose
logprobs differ by less than fp32 noise is agreement, and comparing stops there; a flip the model clearly did
not mean, a token outside the other's top-k, or logprobs that drift apart before the flip fail."""
from __future__ import annotations

import pytest

from tests.greedy import MAX_LOGPROB_GAP, Greedy, check_greedy_close


def run(tokens: list[int], tops: list[dict[int, float]]) -> Greedy:
    return Greedy(tokens, tops)


THEIRS = run([5, 6, 7, 8], [{5: -0.1, 9: -3.0}, {6: -0.2, 1: -2.0}, {7: -0.6931, 3: -0.6932}, {8: -0.3, 2: -1.5}])


def test_equal_tokens_with_close_logprobs_agree_everywhere():
    ours = run([5, 6, 7, 8], [{5: -0.10001, 9: -3.0}, {6: -0.2, 1: -2.0}, {7: -0.6931, 3: -0.6932}, {8: -0.3}])
    assert check_greedy_close(ours, THEIRS) is None


def test_a_near_tie_is_agreement_and_comparing_stops_after_it():
    # at token 2 the two tokens are 1e-4 nats apart on both sides; what follows differs and is not compared
    ours = run([5, 6, 3, 4], [{5: -0.1, 9: -3.0}, {6: -0.2, 1: -2.0}, {3: -0.69305, 7: -0.69315}, {4: -0.01}])
    assert check_greedy_close(ours, THEIRS) == 2


@pytest.mark.parametrize("ours, says", [
    # a real divergence: ours prefers token 3 by a whole nat
    (run([5, 6, 3, 4], [{5: -0.1}, {6: -0.2}, {3: -0.3, 7: -1.3}, {4: -0.01}]), "no near-tie"),
    # the flip is to a token transformers does not even rank in its top-k
    (run([5, 4, 7, 8], [{5: -0.1}, {4: -0.19, 6: -0.2}, {7: -0.7}, {8: -0.3}]), "not in each other's top"),
    # the same tokens, but the distribution drifted before any flip
    (run([5, 6, 7, 8], [{5: -0.1}, {6: -0.2 - 10 * MAX_LOGPROB_GAP}, {7: -0.6931}, {8: -0.3}]), "logprob"),
    # a different length is never agreement
    (run([5, 6, 7], [{5: -0.1}, {6: -0.2}, {7: -0.6931}]), "3"),
])
def test_a_real_divergence_fails(ours, says):
    with pytest.raises(AssertionError, match=says):
        check_greedy_close(ours, THEIRS)
