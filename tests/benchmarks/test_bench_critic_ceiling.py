"""benchmarks/bench_critic_ceiling.py: the oracle critic against a Monte-Carlo estimate of each
prefix's value."""

from __future__ import annotations

import random

import pytest

from benchmarks import bench_critic_ceiling as C
from vapo_lightning.tasks import digitwise

PAIRS = [(4, 3), (7, 5), (1, 8), (9, 9)]
REFERENCE = " " + digitwise.solve(PAIRS)  # " a) 4+3=7 b) 7+5=2 c) 1+8=9 d) 9+9=8"


def slipping_policy(rng: random.Random, p: float) -> str:
    """A response whose every step's result is wrong with probability p (the operands right)."""
    sums = [(x + y) % 10 for x, y in PAIRS]
    sums = [(z + rng.randint(1, 9)) % 10 if rng.random() < p else z for z in sums]
    return " " + digitwise.solve(PAIRS, sums)


def test_oracle_values_are_the_prefix_success_probabilities_of_a_slipping_policy():
    """At every character of the reference, 2·P(success | prefix) − 1 estimated from 40 000
    sampled responses agrees with the oracle's closed form."""
    p, rng = 0.2, random.Random(0)
    samples = [slipping_policy(rng, p) for _ in range(40_000)]
    starts = list(range(len(REFERENCE) + 1))
    oracle = C.oracle_values(starts, REFERENCE, REFERENCE, p)
    for start, value in zip(starts, oracle):
        prefix = REFERENCE[:start]
        same = [s for s in samples if s.startswith(prefix)]
        estimate = 2 * sum(s == REFERENCE for s in same) / len(same) - 1
        assert value == pytest.approx(estimate, abs=0.03), (start, prefix)


def test_a_response_is_lost_from_the_token_after_its_first_wrong_character():
    wrong = REFERENCE.replace("b) 7+5=2", "b) 7+5=3")
    at = C.lost_at(wrong, REFERENCE)
    assert wrong[:at] == REFERENCE[:at] and wrong[at] == "3"
    values = C.oracle_values(list(range(len(wrong) + 1)), wrong, REFERENCE, 0.1)
    assert all(v == -1.0 for v in values[at + 1 :])  # the prefix holds the wrong digit
    assert values[at] == pytest.approx(2 * 0.9**3 - 1)  # before it: steps b, c, d to come
    assert C.lost_at(REFERENCE, REFERENCE) is None
    assert C.lost_at(REFERENCE[:-3], REFERENCE) == len(REFERENCE) - 3  # stopped early


def test_step_error_rate_counts_each_response_until_it_is_lost():
    right, wrong_b = REFERENCE, REFERENCE.replace("=2", "=3")
    # right: 4 steps, no error; wrong_b: reaches a and b, errs at b
    assert C.step_error_rate([right, wrong_b], [REFERENCE] * 2) == pytest.approx(1 / 6)


def test_leave_one_out_never_sees_the_sample_it_predicts():
    outcome = [1.0, -1.0, -1.0, 1.0]
    assert C.leave_one_out(outcome, range(4), 0) == pytest.approx(-1 / 3)
    assert C.leave_one_out(outcome, range(4), 1) == pytest.approx(1 / 3)
