"""`VerlReward`: verl's reward files and custom reward functions, run unchanged in killable
worker processes (tests/rewards/verl_reward_score holds files written the way verl writes them)."""

import time
from pathlib import Path

import pytest

from vapo_lightning.rewards import Sample, combine_rewards
from vapo_lightning.rewards.verl import VerlReward

VERL_FILES = Path(__file__).parent / "verl_reward_score"


def sample(response, truth, source="s", **extra):
    return Sample("p", response, [1], False, truth, source, extra)


@pytest.fixture
def rewards():
    made = []

    def make(*args, **kwargs):
        made.append(VerlReward(*args, **kwargs))
        return made[-1]

    yield make
    for cb in made:
        cb.close()


@pytest.mark.parametrize(
    "file,right,wrong,truth,scores",
    [
        ("gsm8k", "so #### 42", "so #### 41", "42", [1.0, 0.0]),
        ("math_reward", "so \\boxed{3}", "so \\boxed{4}", "3", [1.0, 0.0]),
        ("math_dapo", "Answer: 3", "Answer: 4", "3", [1.0, -1.0]),  # a dict with "score"
        ("math_verify", "so \\boxed{1/2}", "so \\boxed{1/3}", "\\frac{1}{2}", [1.0, 0.0]),
    ],
)
def test_verl_reward_files_score_unchanged(rewards, file, right, wrong, truth, scores):
    cb = rewards(str(VERL_FILES / f"{file}.py"))
    out = combine_rewards([cb], [sample(right, truth), sample(wrong, truth)])
    assert out.errors == 0 and out.per_callback[cb.name] == scores


def test_a_numeric_ground_truth_is_passed_as_verl_data_holds_it(rewards):
    """JSON's 72 or 72.0 (our data keeps numbers) reached gsm8k.py's string comparison as a
    number: every right answer scored 0, without an error. verl's whole reward_model entry
    is a counted error that says what to point data.answer_field at."""
    cb = rewards(str(VERL_FILES / "gsm8k.py"))
    truths = ["72", 72, 72.0, {"style": "rule", "ground_truth": "72"}, float("nan")]
    out = combine_rewards([cb], [sample("so #### 72", t) for t in truths])
    assert out.per_callback[cb.name][:3] == [1.0, 1.0, 1.0]
    assert out.errors == 2
    got = cb.score([sample("so #### 72", truths[3]), sample("so #### 72", 72)])
    assert got[0].kind == "ground truth" and got[1] == 1.0
    assert "point data.answer_field at the answer" in str(got[0])
    mv = rewards(str(VERL_FILES / "math_verify.py"))
    assert mv.score([sample("so \\boxed{0.00001}", 1e-05)]) == [1.0]


def test_verl_folder_dispatches_by_data_source_like_default_compute_score(rewards):
    cb = rewards(str(VERL_FILES), sources={"my_math": "math_verify"})
    got = cb.score(
        [
            sample("#### 7", "7", "openai/gsm8k"),
            sample("\\boxed{7}", "7", "lighteval/MATH"),
            sample("Answer: 8", "7", "math_dapo"),
            sample("Answer: 7", "7", "aime2024"),
            sample("\\boxed{0.5}", "\\frac{1}{2}", "my_math"),
            sample("7", "7", "unknown_source"),
        ]
    )
    assert got[:5] == [1.0, 1.0, -1.0, 1.0, 1.0]
    assert isinstance(got[5], Exception) and "data_source='unknown_source'" in str(got[5])


def test_functions_are_called_by_their_signature(rewards, tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(
        "def custom(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return len(data_source) + float(solution_str == ground_truth) + extra_info['bonus']\n"
        "def no_extra(data_source, solution_str, ground_truth):\n"
        "    return float(solution_str == ground_truth)\n"
        "def plain(model_output, ground_truth):\n"
        "    return (model_output == ground_truth, 'a tuple, as some verl files return')\n"
        "def one_arg(x):\n"
        "    return 1.0\n"
    )
    samples = [sample("42", "42", "ab", bonus=0.5), sample("41", "42", "ab", bonus=0.0)]
    assert rewards(str(path), "custom").score(samples) == [3.5, 2.0]
    assert rewards(str(path), "no_extra").score(samples) == [1.0, 0.0]
    assert rewards(str(path), "plain").score(samples) == [1.0, 0.0]
    with pytest.raises(TypeError, match="takes neither"):
        VerlReward(str(path), "one_arg")
    with pytest.raises(AttributeError, match="has no function 'nope'"):
        VerlReward(str(path), function="nope")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        VerlReward(str(tmp_path / "missing.py"))


def test_a_reward_using_signal_alarm_works(rewards, tmp_path):
    path = tmp_path / "alarm.py"
    path.write_text(
        "import signal\n"
        "def compute_score(solution_str, ground_truth):\n"
        "    signal.signal(signal.SIGALRM, lambda *_: None)\n"
        "    signal.alarm(30)\n"
        "    try:\n"
        "        return float(solution_str == ground_truth)\n"
        "    finally:\n"
        "        signal.alarm(0)\n"
    )
    cb = rewards(str(path))
    out = combine_rewards([cb], [sample("1", "1"), sample("2", "1")])
    assert out.errors == 0 and out.rewards == [1.0, 0.0]


def test_a_hanging_call_is_killed_and_the_others_are_scored(rewards, tmp_path):
    path = tmp_path / "hang.py"
    path.write_text(
        "def compute_score(solution_str, ground_truth):\n"
        "    while solution_str == 'hang':\n"
        "        pass\n"
        "    assert solution_str != 'bare assert'\n"
        "    return float(solution_str == ground_truth)\n"
    )
    cb = rewards(str(path), call_timeout_s=1.0, num_workers=2, max_error_share=None)
    batch = [sample("hang", "1"), sample("1", "1"), sample("bare assert", "1"), sample("2", "1")]
    with pytest.warns(UserWarning) as seen:
        out = combine_rewards([cb], batch)
    assert out.per_callback[cb.name] == [0.0, 1.0, 0.0, 0.0] and out.errors == 2
    assert cb.pool.timeouts == 1
    messages = " ".join(str(w.message) for w in seen)
    assert "call_timeout_s=1.0" in messages and "AssertionError (at hang.py:4)" in messages
    again = combine_rewards([cb], [sample("1", "1"), sample("3", "3")])  # a new worker took over
    assert again.errors == 0 and again.rewards == [1.0, 1.0]


def test_a_batch_that_fails_midway_leaves_no_answer_for_the_next(rewards, tmp_path, monkeypatch):
    """Calls in flight when a batch fails (here: the wait raises) must not answer the next
    batch's calls of the same index: the workers are stopped with the batch."""
    import selectors

    path = tmp_path / "echo.py"
    path.write_text(
        "import time\n"
        "def compute_score(solution_str, ground_truth):\n"
        "    time.sleep(0.3)\n"
        "    return float(solution_str == ground_truth)\n"
    )
    cb = rewards(str(path), num_workers=2)
    assert combine_rewards([cb], [sample("1", "1")]).rewards == [1.0]  # workers started

    def fail(self, timeout=None):
        raise RuntimeError("interrupted")

    with monkeypatch.context() as m:
        m.setattr(selectors.DefaultSelector, "select", fail)
        with pytest.raises(RuntimeError, match="interrupted"):
            cb.pool.map([("s", "1", "2", {}), ("s", "1", "3", {})])  # both 0.0
    time.sleep(1.0)  # the in-flight answers (0.0) would be waiting on the pipes by now
    assert cb.pool.map([("s", "5", "5", {}), ("s", "6", "6", {})]) == [(1.0, None), (1.0, None)]
