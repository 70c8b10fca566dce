"""CodeReward: code extraction, test formats, pass fraction vs all-or-nothing, isolation gate."""

from __future__ import annotations

import os

import pytest

from vapo_lightning.rewards.base import Sample, SampleError, combine_rewards
from vapo_lightning.rewards.code import CodeReward, extract_code, missing_isolation
from vapo_lightning.sandbox import ALL_LAYERS


def _sample(response, ground_truth, **extra):
    return Sample(
        prompt="p",
        response=response,
        response_ids=[1],
        truncated=False,
        ground_truth=ground_truth,
        extra_info=extra,
    )


@pytest.fixture(scope="module")
def reward():
    cb = CodeReward(num_workers=2, program_timeout_s=5.0)
    yield cb
    cb.close()


def test_extract_code_takes_the_last_python_block():
    text = "Try:\n```python\nx = 1\n```\nBetter:\n```python\nx = 2\n```\nDone."
    assert extract_code(text) == "x = 2\n"
    assert extract_code("```\nprint(1)\n```") == "print(1)\n"
    assert extract_code("def f():\n    return 1") == "def f():\n    return 1"


def test_scores_each_format(reward):
    io_tests = [{"input": "1 2\n", "output": "3\n"}, {"input": "2 2\n", "output": "5\n"}]
    stdin_prog = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    taco = {"inputs": [[1, 2], [2, 2]], "outputs": [[3], [4]], "fn_name": "add"}
    fn_prog = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    mbpp = ["assert add(1, 1) == 2", "assert add(0, 0) == 1"]
    samples = [
        _sample(stdin_prog, io_tests),
        _sample(fn_prog, taco),
        _sample(fn_prog, mbpp, fn_name="add"),
        _sample("no code at all", taco),
        _sample(fn_prog, [{"input": [2, 3], "output": 5}], fn_name="add"),
    ]
    assert reward.score(samples) == [0.5, 1.0, 0.5, 0.0, 1.0]


def test_all_or_nothing():
    cb = CodeReward(num_workers=1, all_or_nothing=True)
    try:
        tests = [{"input": [1], "output": 1}, {"input": [2], "output": 3}]
        scores = cb.score(
            [
                _sample("def f(x):\n    return x", tests, fn_name="f"),
                _sample("def f(x):\n    return 2 * x - 1", tests, fn_name="f"),
            ]
        )
        assert scores == [0.0, 1.0]
    finally:
        cb.close()


def test_correct_means_every_test_passed(reward):
    """With partial credit a program that passes 1 of 12 tests scores > 0, but it is not
    correct: only a full pass counts for accuracy and the positive-example NLL."""
    tests = [{"input": [x], "output": x * x} for x in range(12)]  # only x = 0, 1 pass `return x`
    samples = [
        _sample("def f(x):\n    return x * x", tests, fn_name="f"),
        _sample("def f(x):\n    return x", tests, fn_name="f"),
        _sample("def f(x):\n    return 0", tests, fn_name="f"),  # x = 0 only: 1 of 12
    ]
    scores = reward.score(samples)
    assert scores == [1.0, 2 / 12, 1 / 12]
    assert reward.correct_threshold is not None  # a verifier: no "total reward > 0" fallback
    assert [s > reward.correct_threshold for s in scores] == [True, False, False]


def test_missing_tests_are_errors_not_zeros(reward):
    outcome = combine_rewards([reward], [_sample("x = 1", None)])
    assert outcome.errors == 1


def test_missing_tests_say_why(reward):
    """The warning names the row's ground truth, so the bad row can be found."""
    cb = CodeReward(num_workers=1)
    try:
        with pytest.warns(UserWarning, match=r"no tests.*'\[\]'"):
            outcome = combine_rewards([cb], [_sample("x = 1", [])])
    finally:
        cb.close()
    assert outcome.errors == 1


def test_an_empty_fn_name_means_stdin_tests(reward):
    """`extra_info` with ``fn_name: ""`` (a dataset's empty column) keeps stdin tests stdin."""
    tests = [{"input": "1 2\n", "output": "3\n"}]
    code = "a, b = map(int, input().split())\nprint(a + b)"
    assert reward.score([_sample(code, tests, fn_name="")]) == [1.0]


def test_a_failed_sandbox_is_a_counted_error_not_a_zero(monkeypatch):
    """The sandbox failing before the program ran (setup) or the server failing is not the
    program's fault: an error, counted and shown, never a silent score of 0."""
    import vapo_lightning.rewards.code as code_mod
    from vapo_lightning.sandbox import Result

    class FailingPool:
        layers = tuple(ALL_LAYERS)

        def __init__(self, *a, **k):
            pass

        def evaluate(self, code, tests, fn_name, timeout_s):
            if "setup" in code:
                return Result(0, len(tests), "setup_error", errors=["C OSError: no uid"])
            if "server" in code:
                return Result(0, len(tests), "server_error")
            return Result(len(tests), len(tests), "ok")

        def close(self):
            pass

    monkeypatch.setattr(code_mod, "Pool", FailingPool)
    cb = CodeReward(num_workers=1, max_error_share=None)
    tests = [{"input": [1], "output": 1}]
    samples = [_sample(f"# {c}\ndef f(x): return x", tests, fn_name="f") for c in ("setup", "server", "ok")]
    with pytest.warns(UserWarning) as shown:
        outcome = combine_rewards([cb], samples)
    assert outcome.errors == 2 and outcome.rewards == [0.0, 0.0, 1.0]
    text = " ".join(str(w.message) for w in shown)
    assert "the sandbox failed (setup_error) C OSError: no uid" in text
    assert "server_error" in text
    assert cb.last_stats["error"] == 2.0


def test_tests_that_are_not_run_are_counted_and_shown():
    """A row scored on fewer tests than it has says so: `code/tests_skipped` counts them and
    the first such row is named in a warning."""
    cb = CodeReward(num_workers=1)
    tests = [{"input": "1\n", "output": "1\n"}, {"input": 2, "output": 2}]
    try:
        with pytest.warns(UserWarning, match=r"1 of a row's 2 tests .* not run"):
            assert cb.score([_sample("print(input())", tests)]) == [1.0]
        assert cb.last_stats["tests_skipped"] == 1.0 and cb.metrics()["code/tests_skipped"] == 1.0
    finally:
        cb.close()


def test_a_row_whose_tests_are_all_skipped_says_so():
    """Tests that all lack an exact form: a counted error that names them (not "no tests in
    the ground truth"), and `code/tests_skipped` counts them."""
    cb = CodeReward(num_workers=1)
    tests = [{"input": 1, "output": 1}, {"input": 2, "output": 2}]
    try:
        (out,) = cb.score([_sample("print(input())", tests)])
        assert isinstance(out, SampleError)
        assert "none of its 2 tests has an exact input/output form" in str(out)
        assert cb.last_stats["tests_skipped"] == 2.0 and cb.last_stats["no_tests"] == 1.0
    finally:
        cb.close()


def test_a_sandbox_that_cannot_set_up_is_a_counted_error_with_its_reason():
    """Not a silent 0: the sample is a SampleError that says what the sandbox reported."""
    from vapo_lightning.sandbox import Limits

    cb = CodeReward(num_workers=1)
    cb.pool.limits = Limits(open_files=2**40)  # a file limit the kernel refuses
    try:
        (out,) = cb.score([_sample("```python\nprint(input())\n```", [{"input": "1\n", "output": "1\n"}])])
        assert isinstance(out, SampleError) and out.kind == "setup_error"
        assert "the sandbox failed (setup_error) P2 ValueError" in str(out)
        assert cb.last_stats["error"] == 1.0
    finally:
        cb.close()


def test_hostile_response_scores_zero_through_the_callback(reward):
    taco = {"inputs": [[1]], "outputs": [[12345]], "fn_name": "f"}
    resp = "```python\nimport os\ndef f(x):\n    os._exit(0)\n```"
    assert reward.score([_sample(resp, taco)]) == [0.0]


def test_isolation_gate_names_what_is_missing():
    assert missing_isolation(list(ALL_LAYERS), "full", is_root=True) == []
    assert missing_isolation(["rlimits", "clean_env", "session", "subreaper"], "strong", is_root=False) == [
        "filesystem",
        "network",
    ]
    assert "not_root" in missing_isolation(["rlimits"], "basic", is_root=True)
    with pytest.raises(ValueError):
        missing_isolation([], "paranoid", is_root=False)


def test_refuses_to_start_below_the_minimum(monkeypatch):
    import vapo_lightning.rewards.code as code_mod

    class WeakPool:
        layers = ("rlimits", "session", "clean_env")

        def __init__(self, *a, **k):
            self.closed = False

        def close(self):
            self.closed = True

    monkeypatch.setattr(code_mod, "Pool", WeakPool)
    with pytest.raises(RuntimeError, match=r"(?s)Missing:.*network.*user namespaces"):
        CodeReward(min_isolation="strong")
    CodeReward(min_isolation="none").close()


def test_reported_layers_are_known_and_include_the_basics(reward):
    assert set(reward.layers) <= set(ALL_LAYERS)
    assert missing_isolation(reward.layers, "basic", is_root=os.geteuid() == 0) == []


def test_last_stats_count_outcomes_per_batch(reward):
    tests = [{"input": [1], "output": 2}, {"input": [2], "output": 3}]
    samples = [
        _sample("def f(x):\n    return x + 1", tests, fn_name="f"),  # passed
        _sample("def f(x):\n    return 2", tests, fn_name="f"),  # failed (1 of 2)
        _sample("def f(x):\n    while True: pass", tests, fn_name="f"),  # timeout
        _sample("import os\ndef f(x):\n    os._exit(3)", tests, fn_name="f"),  # error (crash)
        _sample("def f(x):\n    return x + 1", None),  # no tests
    ]
    short = CodeReward(num_workers=2, program_timeout_s=1.0, no_tests_value=0.0)
    try:
        assert short.score(samples) == [1.0, 0.5, 0.0, 0.0, 0.0]
        assert short.last_stats == {
            "samples": 5.0,
            "passed": 1.0,
            "failed": 1.0,
            "timeout": 1.0,
            "error": 1.0,
            "no_tests": 1.0,
            "tests_skipped": 0.0,
        }
        assert all(type(v) is float for v in short.last_stats.values())
        short.score(samples[:1])  # reset by each call
        assert short.last_stats["samples"] == 1.0 and short.last_stats["timeout"] == 0.0
    finally:
        short.close()
