"""The math reward: answer extraction, math-verify equivalence on real gold answers (GSM8K test,
MATH-500, AIME 2024, AMC: the full sets from ../shared/data where present, else the samples
committed in tests/data/eval_sets), hostile inputs against the hard time limit."""

from __future__ import annotations

import json
import re
import threading
import time
from fractions import Fraction
from pathlib import Path

import pytest

from vapo_lightning.metrics import answer_shares
from vapo_lightning.rewards.base import Sample, combine_rewards
from vapo_lightning.rewards.math import MathReward, MathVerifier, extract_answer, is_equivalent
from vapo_lightning.rewards.math_answers import answer_forms, number_text

FULL = Path(__file__).resolve().parents[3] / "shared" / "data"
SAMPLES = Path(__file__).resolve().parents[1] / "data" / "eval_sets"  # in every clone
DATA = FULL if (FULL / "math500.json").exists() else SAMPLES
TIMEOUT_S = 3.0
HANG_TIMEOUT_S = 1.0  # for the checks meant to hang: a real check takes milliseconds
SLACK_S = 2.0  # process kill + respawn + a loaded 2-core CI machine


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier(num_workers=2, timeout_s=TIMEOUT_S)
    yield v
    v.close()


def boxed(answer: str) -> str:
    return f"Let me think step by step.\nSo the final answer is $\\boxed{{{answer}}}$."


# ------------------------------------------------------------------ extraction (no workers)


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("so \\boxed{\\frac{1}{2}} and then \\boxed{\\frac{3}{4}}.", "\\frac{3}{4}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        (
            "\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}",
            "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}",
        ),
        ("the answer is \\fbox{42}", "42"),
        ("hence $\\boxed 5$.", "5"),
        ("so \\boxed { 1/2 }.", "1/2"),  # a space before the brace: still the braced box
        ("Working...\nAnswer: $x = 5$\n", "x = 5"),
        ("**Answer:** 7.", "7"),
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
        ("\\boxed{3}\nAnswer: 4\n#### 5", "3"),  # box first, then Answer:, then ####
        ("Answer: 4\n#### 5", "4"),
        ("no answer here", None),
        ("truncated \\boxed{\\frac{1}{2", None),
        ("Answer: \n", None),
        ("**Final Answer:**\n\n$\\frac{1}{2}$", "\\frac{1}{2}"),  # the answer on the line below
        ("Final Answer:\n42\nDone.", "42"),
        ("4 + 18 = 22 pens. The answer is 22.", "22"),  # the last resort
        ("The answer is 3. No wait, the final answer is: $1,250.", "1250"),
        ("the answer is 7\n#### 9", "9"),  # any other form first
        ("I think the answer is twelve.", None),
    ],
)
def test_extract_answer(response, answer):
    assert extract_answer(response) == answer


def test_answer_shares_count_readable_and_boxed_answers():
    responses = ["so \\boxed{12}.", "Answer: 12", "The answer is 12.", "It is 12.", "\\boxed{}"]
    assert [answer_forms(r) for r in responses] == [
        (True, True),
        (True, False),
        (True, False),
        (False, False),
        (False, False),
    ]
    assert answer_shares("val", responses) == {"val/answer_share": 0.6, "val/boxed_share": 0.2}
    assert answer_shares("rollout", []) == {"rollout/answer_share": 0.0, "rollout/boxed_share": 0.0}


def test_extract_answer_is_linear_on_a_2mb_response():
    response = "(" * 1_000_000 + "\\boxed{" * 500_000 + " Answer: " + "x" * 100_000
    start = time.perf_counter()
    extract_answer(response)
    assert time.perf_counter() - start < 1.0


# ------------------------------------------------------------------------- semantics


@pytest.mark.parametrize(
    ("response", "gold", "expected"),
    [
        (boxed("0.75"), "\\frac{3}{4}", True),
        (boxed("\\dfrac34"), "3/4", True),
        (boxed("33"), "033", True),
        (boxed("033"), "33", True),
        (boxed("34"), "033", False),
        (boxed("\\left[ 1, 2 \\right)"), "[1,2)", True),
        (boxed("(1, 2]"), "[1,2)", False),
        (boxed("\\{3, 2, 1\\}"), "\\{1,2,3\\}", True),
        (boxed("(2, 1)"), "(1,2)", False),
        (boxed("(x+1)^2"), "x^2+2x+1", True),
        (
            boxed("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
            "\\begin{pmatrix}1\\\\2\\end{pmatrix}",
            True,
        ),
        (
            boxed("\\begin{pmatrix} 1 \\\\ 3 \\end{pmatrix}"),
            "\\begin{pmatrix}1\\\\2\\end{pmatrix}",
            False,
        ),
        ("Answer: 18", "Janet sells 16 - 3 - 4 = 9 eggs... 9 * 2 = 18\n#### 18", True),
        ("#### 1,000", "1000", True),
        (boxed("1/3"), "0.3333", False),
        ("I don't know", "5", False),
        ("5 + 7 = 12 pens. The answer is 12.", "12", True),
        ("The answer is 1,250.", "1250", True),
    ],
)
def test_equivalence(verifier, response, gold, expected):
    assert verifier.check_batch([response], [gold]) == [expected]


def test_is_equivalent_public_contract():
    assert is_equivalent("thus \\boxed{\\dfrac{1}{2}}.", "0.5") is True
    assert is_equivalent("thus \\boxed{\\dfrac{1}{3}}.", "0.5") is False
    with pytest.raises(ValueError, match="no answer"):
        is_equivalent("\\boxed{1}", "")


def test_a_small_or_large_float_gold_is_written_out_not_in_scientific_notation(verifier):
    """str(1e-05) is "1e-05", which math-verify reads as e - 5: every response was wrong."""
    assert number_text(1e-05) == "0.00001" and number_text(142.0) == "142"
    assert number_text(2.5e-07) == "0.00000025" and number_text(1e16) == "10000000000000000"
    assert number_text(0.1) == "0.1" and number_text(7) == "7"
    assert verifier.check_batch([boxed("0.00001"), boxed("0.00002")], [1e-05, 1e-05]) == [True, False]


def test_missing_ground_truth_is_none_not_false(verifier):
    assert verifier.check_batch([boxed("1"), boxed("1")], [None, 1.0]) == [None, True]


def test_works_off_the_main_thread(verifier):
    out = []
    thread = threading.Thread(target=lambda: out.extend(verifier.check_batch([boxed("0.5")], ["1/2"])))
    thread.start()
    thread.join(30)
    assert out == [True]


# ------------------------------------------------------------------------- MathReward


def sample(response: str, ground_truth) -> Sample:
    return Sample("q", response, [1, 2], False, ground_truth=ground_truth)


def test_math_reward_scores_and_errors():
    samples = [sample(boxed("\\frac{1}{2}"), "0.5"), sample(boxed("2"), "3"), sample("", None)]
    paper = MathReward(num_workers=1)
    binary = MathReward(correct_reward=1.0, wrong_reward=0.0, num_workers=1)
    try:
        assert paper.score(samples) == [1.0, -1.0, None]
        assert binary.score(samples) == [1.0, 0.0, None]
        outcome = combine_rewards([paper], samples)  # the missing ground truth is counted
        assert outcome.rewards == [1.0, -1.0, -1.0] and outcome.errors == 1  # valued as wrong
    finally:
        paper.close()
        binary.close()


# ------------------------------------------------------------------------- hostile input

HOSTILE = {
    "power tower": boxed("9^{9^{9^{9}}}"),
    "factorial tower": boxed("(10^{10})!!"),
    "10,000 nested parentheses": boxed("(" * 10_000 + "1" + ")" * 10_000),
    "2 MB response": "x = 1 + " * 250_000 + "\\boxed{2}" + " and " * 10,
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_answer_is_false_in_time_and_pool_survives(name):
    # A large answer cap, so that the nested parentheses reach a worker too.
    v = MathVerifier(num_workers=1, timeout_s=HANG_TIMEOUT_S, max_answer_chars=50_000)
    try:
        v.check_batch([boxed("1")], ["1.0"])  # start the worker outside the timing
        start = time.perf_counter()
        assert v.check_batch([HOSTILE[name]], ["3"]) == [False]
        assert time.perf_counter() - start < HANG_TIMEOUT_S + SLACK_S
        assert v.check_batch([boxed("\\frac{1}{2}")], ["0.5"]) == [True]  # still usable
    finally:
        v.close()


def test_a_hanging_check_does_not_hold_up_the_others():
    golds = [str(n) for n in range(40)]
    responses = [boxed(f"{n}.0") for n in range(40)]
    verifier = MathVerifier(num_workers=2, timeout_s=HANG_TIMEOUT_S)
    try:
        verifier.check_batch([boxed("1")] * 2, ["1.0"] * 2)  # start the workers outside the timing
        start = time.perf_counter()
        out = verifier.check_batch([HOSTILE["power tower"], *responses], ["5", *golds])
        assert out == [False] + [True] * 40
        assert time.perf_counter() - start < HANG_TIMEOUT_S + SLACK_S
        assert verifier.stats.timeouts == 1
    finally:
        verifier.close()


def test_checks_that_cannot_complete_are_counted_and_shown_and_valued_as_wrong():
    """Out of time, or a ground truth math-verify cannot parse: the sample scores as a wrong
    answer (a policy gains nothing by stalling the checker), counts in `reward/errors`, and
    the warning names why; the checks around them are unaffected."""
    reward = MathReward(num_workers=1, check_timeout_s=HANG_TIMEOUT_S, max_error_share=None)
    samples = [
        sample(HOSTILE["power tower"], "5"),
        sample(boxed("\\frac{1}{2}"), "}{"),
        sample(boxed("\\frac{1}{2}"), "0.5"),
    ]
    try:
        with pytest.warns(UserWarning) as shown:
            outcome = combine_rewards([reward], samples)
        assert outcome.rewards == [-1.0, -1.0, 1.0] and outcome.errors == 2
        text = " ".join(str(w.message) for w in shown)
        assert "math-verify took over 1 s" in text and "cannot parse the ground truth" in text
        assert "'}{'" in text  # the row's ground truth is named
    finally:
        reward.close()


def test_a_ground_truth_that_is_no_answer_is_an_error_not_a_silent_wrong():
    """verl's ``reward_model`` dict, a list, NaN: their text would match no response, so every
    sample would be silently wrong. Each is an error naming the value; 1.0 and "7" still work."""
    reward = MathReward(num_workers=1, max_error_share=None)
    truths = [{"ground_truth": "42", "style": "rule"}, ["42"], float("nan"), 42.0, "42"]
    try:
        with pytest.warns(UserWarning) as shown:
            outcome = combine_rewards([reward], [sample(boxed("42"), t) for t in truths])
        assert outcome.errors == 3 and outcome.rewards == [-1.0, -1.0, -1.0, 1.0, 1.0]
        text = " ".join(str(w.message) for w in shown)
        assert "the ground truth is a dict, not an answer" in text and "'style': 'rule'" in text
        assert "is a list" in text and "is a float" in text
    finally:
        reward.close()
    with pytest.raises(ValueError, match="string or a number, got dict"):
        is_equivalent(boxed("42"), {"ground_truth": "42"})


def test_a_batch_that_fails_midway_leaves_no_answer_for_the_next(monkeypatch):
    """Checks in flight when a batch fails (here: the wait raises) must not answer the next
    batch's checks of the same index: the workers are stopped with the batch."""
    v = MathVerifier(num_workers=2, timeout_s=TIMEOUT_S)
    try:
        v.check_batch([boxed("\\frac{1}{3}")], ["0.25"])  # start the workers
        wait = v._wait

        def fail(selector):
            raise RuntimeError("interrupted")

        monkeypatch.setattr(v, "_wait", fail)
        with pytest.raises(RuntimeError, match="interrupted"):
            v.check_batch([boxed("\\frac{1}{3}")] * 2, ["0.25", "0.2"])  # both False
        monkeypatch.setattr(v, "_wait", wait)
        time.sleep(1.0)  # the in-flight answers (False) would be waiting on the pipes by now
        assert v.check_batch([boxed("\\frac{1}{2}")] * 2, ["0.5", "1/2"]) == [True, True]
    finally:
        v.close()


# ----------------------------------------------------------- real gold answers (slow)


def load_golds() -> dict[str, list[str]]:
    with open(DATA / "gsm8k_test.jsonl") as f:
        gsm8k = [json.loads(line)["answer"] for line in f]
    return {
        "gsm8k": gsm8k,  # whole solutions ending in "#### N"
        "math500": [row["answer"] for row in json.load(open(DATA / "math500.json"))],
        "aime2024": [str(row["answer"]) for row in json.load(open(DATA / "aime2024.json"))],
        "amc": [row["answer"] for row in json.load(open(DATA / "amc.json"))],  # JSON floats
    }


def final(gold) -> str:
    if isinstance(gold, float):
        return str(int(gold)) if gold.is_integer() else repr(gold)
    return gold.split("####")[-1].strip() if "####" in gold else gold


NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
FRAC = re.compile(r"(-?)\\[dt]?frac\{?(\d+)\}?\{?(\d+)\}?")


def equivalent_forms(source: str, answer: str) -> list[str]:
    """Forms of `answer` a correct model might write."""
    forms = [f" {answer} ", f"$ {answer} $"]
    plain = answer.replace(",", "") if source == "gsm8k" else answer
    if NUMBER.fullmatch(plain):
        value = Fraction(plain)
        if value.denominator == 1:
            forms += [f"{int(value)}.0", f"{int(value)}.00", f"\\frac{{{2 * int(value)}}}{{2}}"]
        if source == "aime2024":
            forms += [str(int(value)).zfill(3), f"0{int(value)}"]
        if source == "gsm8k" and abs(value) >= 1000:
            forms.append(f"{int(value):,}")
        if source == "gsm8k":
            forms.append(f"\\${plain}")
    if m := FRAC.fullmatch(answer):
        sign, p, q = m.groups()
        forms += [
            f"{sign}\\dfrac{{{p}}}{{{q}}}",
            f"{sign}{p}/{q}",
            f"{sign}\\frac{{{2 * int(p)}}}{{{2 * int(q)}}}",
        ]
        if set(_prime_factors(int(q))) <= {2, 5}:  # an exact, terminating decimal
            forms.append(f"{sign}{float(Fraction(int(p), int(q))):.10g}")
    if answer.startswith("\\left(") or answer.startswith("("):
        bare = answer.replace("\\left(", "(").replace("\\right)", ")")
        if bare.endswith(")"):
            forms += [bare, "\\left(" + bare[1:-1] + "\\right)", bare.replace(" ", "")]
    if answer.startswith("\\{") and answer.endswith("\\}") and "," in answer:
        items = answer[2:-2].split(",")
        forms.append("\\{" + ", ".join(reversed(items)) + "\\}")
    return forms


def _prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while n > 1 and p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out + ([n] if n > 1 else [])


def wrong_forms(source: str, answer: str) -> list[str]:
    """Forms of `answer` that are not equivalent to it."""
    plain = answer.replace(",", "") if source == "gsm8k" else answer
    if NUMBER.fullmatch(plain):
        value = Fraction(plain)
        return [str(value + 1), str(-value) if value else "1", str(value * 10 if value else 2)]
    if m := FRAC.fullmatch(answer):
        sign, p, q = m.groups()
        return [
            f"{sign}\\frac{{{int(p) + 1}}}{{{q}}}",
            f"{sign}\\frac{{{q}}}{{{p}}}" if p != q else "2",
        ]
    if re.fullmatch(r"\\left\(.*\\right\)|\(.*\)", answer) and "(-\\infty" not in answer:
        # a tuple or an open interval ([-oo, b) would be (-oo, b) for sympy)
        return ["[" + answer.removeprefix("\\left(").removeprefix("(")]
    return [f"{answer} + 1"] if "\\text" not in answer and "=" not in answer else []


# Gold answers that math-verify cannot judge equivalent to an equivalent spelling we generate,
# with the reason. Kept explicit so the real false-negative rate is visible, not hidden.
KNOWN_FALSE_NEGATIVES: dict[tuple[str, str], str] = {}


@pytest.mark.slow
def test_every_gold_answer_matches_itself_and_equivalent_forms(verifier):
    golds = load_golds()
    responses, truths, labels = [], [], []
    for source, rows in golds.items():
        for gold in rows:
            answer = final(gold)
            for form in [answer, *equivalent_forms(source, answer)]:
                responses.append(boxed(form))
                truths.append(gold)
                labels.append((source, answer, form))
    verdicts = verifier.check_batch(responses, truths)
    misses = [label for label, ok in zip(labels, verdicts) if ok is not True]
    unexplained = [m for m in misses if (m[1], m[2]) not in KNOWN_FALSE_NEGATIVES]
    rate = len(misses) / len(labels)
    print(f"\n{len(labels)} equivalent pairs, {len(misses)} false negatives ({rate:.2%})")
    assert len(labels) > 2 * sum(map(len, golds.values()))  # the forms were generated
    assert unexplained == [], f"{len(unexplained)} unexplained false negatives: {unexplained[:20]}"


@pytest.mark.slow
def test_wrong_answers_are_rejected(verifier):
    golds = load_golds()
    responses, truths, labels = [], [], []
    for source, rows in golds.items():
        for gold in rows:
            answer = final(gold)
            for form in wrong_forms(source, answer):
                responses.append(boxed(form))
                truths.append(gold)
                labels.append((source, answer, form))
    verdicts = verifier.check_batch(responses, truths)
    accepted = [label for label, ok in zip(labels, verdicts) if ok is not False]
    assert len(labels) > sum(map(len, golds.values()))
    assert accepted == [], f"{len(accepted)} wrong answers accepted: {accepted[:20]}"


def test_a_step_without_reward_contrast_is_said():
    import warnings

    import torch

    from vapo_lightning.metrics import warn_without_reward_signal

    with pytest.warns(UserWarning, match="rollout/zero_spread_groups"):
        warn_without_reward_signal({"rollout/zero_spread_groups": torch.tensor(1.0)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_without_reward_signal({"rollout/zero_spread_groups": torch.tensor(0.75)})
