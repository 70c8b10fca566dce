"""The reward plug-in API: error policies, weights, and the built-in format, overlong and
SandboxFusion rewards."""

import json
import math
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from vapo_lightning.rewards import RewardCallback, RewardError, Sample, combine_rewards
from vapo_lightning.rewards.base import SampleError, check_callbacks
from vapo_lightning.rewards.format import FormatReward
from vapo_lightning.rewards.overlong import OverlongPenalty
from vapo_lightning.rewards.sandbox_fusion import SandboxFusionReward


def sample(response="x", ids=(1, 2), truncated=False, truth=None, source="s", **extra):
    return Sample("p", response, list(ids), truncated, truth, source, extra)


class Fixed(RewardCallback):
    def __init__(self, values, **kwargs):
        super().__init__(**kwargs)
        self.values = values

    def score(self, samples):
        if isinstance(self.values, Exception):
            raise self.values
        if self.values == "hang":
            time.sleep(5)
        return self.values


SAMPLES = [sample(), sample(), sample()]


def test_weighted_sum_of_callbacks():
    out = combine_rewards([Fixed([1, 0, -1]), Fixed([0.5, 0.5, 0.5], weight=2.0)], SAMPLES)
    assert out.rewards == [2.0, 1.0, 0.0] and out.errors == 0
    assert out.per_callback == {"Fixed": [1, 0, -1], "Fixed#2": [0.5, 0.5, 0.5]}  # both kept
    for weight in (math.nan, math.inf):
        with pytest.raises(ValueError, match="weight must be finite"):
            Fixed([1], weight=weight)


@pytest.mark.parametrize(
    "values,errors",
    [
        (ValueError("boom"), 3),
        ([1.0, float("nan"), 1.0], 1),
        ([1.0, None, "x"], 2),
        ([1.0], 3),
        ({0: 1.0, 1: 0.0, 2: 1.0}, 3),  # list() of it is its keys, 0 1 2: not scores
        ("hang", 3),
    ],
    ids=["raises", "nan", "none-and-junk", "wrong-length", "a-dict", "hangs"],
)
def test_failing_rewards_get_the_defined_value_and_are_counted(values, errors):
    cb = Fixed(values, error_value=-0.5, timeout_s=0.5)
    out = combine_rewards([cb], SAMPLES)
    assert out.errors == errors
    assert sum(r == -0.5 for r in out.rewards) == errors
    assert all(math.isfinite(r) for r in out.rewards)


@pytest.mark.parametrize("values", [ValueError("boom"), [1.0, float("nan"), 1.0], [1.0], {0: 1.0, 1: 0.0, 2: 1.0}])
def test_failing_rewards_abort_when_configured(values):
    with pytest.raises(RewardError, match="reward callback Fixed"):
        combine_rewards([Fixed(values, on_error="abort")], SAMPLES)


def test_no_reward_callback_is_an_error():
    with pytest.raises(RewardError, match="no reward callback"):
        combine_rewards([], SAMPLES)


def test_a_reward_class_listed_twice_is_warned(recwarn):
    check_callbacks([Fixed([1.0]), FormatReward(), OverlongPenalty(max_length=8, cache_length=2)])
    assert not [w for w in recwarn if "listed" in str(w.message)]
    with pytest.warns(UserWarning, match=r"Fixed is listed 2 times, so its reward is added 2 times"):
        check_callbacks([Fixed([1.0]), FormatReward(), Fixed([0.5])])


class Hang(RewardCallback):
    """Blocks until `release` is set (released by the test, so no thread outlives it)."""

    release = threading.Event()

    def score(self, samples):
        Hang.release.wait()
        return [1.0] * len(samples)


def test_one_hung_reward_neither_starves_the_others_nor_piles_up_threads():
    hung = Hang(timeout_s=0.2, max_error_share=None)
    healthy = Fixed([1.0, 1.0, 1.0], timeout_s=30.0)
    try:
        for _ in range(6):  # more batches than any shared pool would have threads
            out = combine_rewards([hung, healthy], SAMPLES)
            assert out.per_callback["Fixed"] == [1.0, 1.0, 1.0] and out.errors == 3
        stuck = [t for t in threading.enumerate() if t.name == "vapo-reward-Hang"]
        assert len(stuck) == 1 and stuck[0].daemon
    finally:
        Hang.release.set()


class Counting(Fixed):
    """Fixed, counting its samples in `metrics()` as a `score` call ends (as CodeReward)."""

    def __init__(self, values, **kwargs):
        super().__init__(values, **kwargs)
        self.counts = {"n/samples": 0.0, "n/zero": 0.0}

    def score(self, samples):
        out = super().score(samples)
        self.counts = {"n/samples": float(len(samples)), "n/zero": 0.0}
        return out

    def metrics(self):
        return self.counts


@pytest.mark.parametrize("timeout_s", [None, 30.0], ids=["inline", "threaded"])
def test_a_failed_call_logs_zero_counts_not_the_previous_batchs(timeout_s):
    """`RewardOutcome.metrics` sums the callbacks' counts (zeros kept: every rank logs the
    same keys); a call that raised gives its keys with 0: its samples are in `errors`, and its
    `metrics()` still describe the batch before."""
    cb, other = Counting([1.0, 1.0, 1.0], timeout_s=timeout_s), Counting([0.0, 0.0, 0.0])
    out = combine_rewards([cb, other], SAMPLES)
    assert out.metrics == {"n/samples": 6.0, "n/zero": 0.0} and out.errors == 0
    cb.values = ValueError("boom")
    out = combine_rewards([cb, other], SAMPLES)
    assert out.errors == 3 and cb.metrics() == {"n/samples": 3.0, "n/zero": 0.0}  # stale
    assert out.metrics == {"n/samples": 3.0, "n/zero": 0.0}  # the healthy callback's only


@pytest.mark.slow
def test_exit_does_not_wait_for_a_hung_reward():
    script = (
        "import threading\n"
        "from vapo_lightning.rewards import RewardCallback, Sample, combine_rewards\n"
        "class Hang(RewardCallback):\n"
        "    def score(self, samples):\n"
        "        threading.Event().wait()\n"
        "s = [Sample('p', 'r', [1], False)]\n"
        "print(combine_rewards([Hang(timeout_s=0.1)], s).errors)\n"
    )
    # Hangs for ever (and fails on the subprocess timeout) if exit joins the reward thread.
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "1"


def test_failures_warn_once_per_kind_then_stop_the_run(recwarn):
    cb = Fixed(ValueError("bad ground truth format"))  # max_error_share 0.5 over 3 batches
    for _ in range(2):
        assert combine_rewards([cb], SAMPLES).errors == 3
    warned = [str(w.message) for w in recwarn]
    assert len(warned) == 1 and "Fixed failed on 3 of 3 samples" in warned[0]
    assert "bad ground truth format" in warned[0]
    with pytest.raises(RewardError, match=r"more than 50% .* 3 consecutive batches.*bad ground"):
        combine_rewards([cb], SAMPLES)


def test_a_reward_failing_on_few_samples_or_switched_off_keeps_running(recwarn):
    few = Fixed([1.0, None, 1.0])
    off = Fixed(ValueError("boom"), max_error_share=None)
    for _ in range(5):
        combine_rewards([few], SAMPLES)
        combine_rewards([off], SAMPLES)
    assert len(recwarn) == 2  # one per callback and kind


def test_format_reward():
    cb = FormatReward(good=1.0, bad=-1.0)
    responses = [
        ("2 + 3 = 5. \\boxed{5}", False, 1.0),
        ("\\boxed{\\frac{1}{2}}.", False, 1.0),
        ("\\boxed{5} so maybe \\boxed{6}", False, -1.0),
        ("the answer is 5", False, -1.0),
        ("\\boxed{5} and more text", False, -1.0),
        ("2 + 3 = 5. \\boxed{5}", True, -1.0),
        # closing math delimiters and braces nested to any depth are still the final answer
        ("so $\\boxed{5}$.", False, 1.0),
        ("\\[\\boxed{5}\\]", False, 1.0),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", False, 1.0),
        ("$$\\boxed{x^{2^{3}}}$$", False, 1.0),
        ("\\boxed{\\frac{1}{2}", False, -1.0),  # unclosed
        ("$\\boxed{5}$ and more", False, -1.0),
        ("\\boxed{5}} x", False, -1.0),
    ]
    assert cb.score([sample(r, truncated=t) for r, t, _ in responses]) == [v for *_, v in responses]
    custom = FormatReward(pattern=r"Answer: \d+$", good=1.0, bad=-1.0)
    assert custom.score([sample("Answer: 5"), sample("\\boxed{5}")]) == [1.0, -1.0]


def test_overlong_penalty():
    cb = OverlongPenalty(max_length=20, cache_length=8)
    got = cb.score([sample(ids=range(n)) for n in (5, 12, 16, 20, 25)])
    assert got == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError):
        OverlongPenalty(max_length=10, cache_length=20)


class FakeSandboxFusion(BaseHTTPRequestHandler):
    """A SandboxFusion-shaped /run_code endpoint running trusted test code with python."""

    requests: ClassVar[list[dict]] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeSandboxFusion.requests.append(body)
        if "SANDBOX_DOWN" in body["code"]:  # the service itself failing
            self.reply({"status": "SandboxError", "message": "container failed to start"})
            return
        if "HTTP_500" in body["code"]:  # a proxy's error page, no JSON
            self.send_error(500, "upstream gone")
            return
        proc = subprocess.run(
            [sys.executable, "-c", body["code"]],
            input=body["stdin"],
            capture_output=True,
            text=True,
            timeout=body["run_timeout"],
        )
        result = {
            "status": "Success",
            "run_result": {
                "status": "Finished",
                "return_code": proc.returncode,
                "stdout": proc.stdout,
                "stderr": proc.stderr,
            },
        }
        self.reply(result)

    def reply(self, result):
        data = json.dumps(result).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_sandbox_fusion_client_scores_on_the_host():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeSandboxFusion)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cb = SandboxFusionReward(f"http://127.0.0.1:{server.server_port}", max_concurrency=2)
        tests = [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6"}]
        good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
        half = "a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)"
        crash = "import sys; print(5); sys.exit(1)"
        prefix = "a, b = map(int, input().split())\nprint(a + b)\nprint('extra')"
        got = cb.score([sample(r, truth=tests) for r in (good, half, crash, prefix)] + [sample(good, truth=None)])
        assert got == [1.0, 0.5, 0.0, 0.0, None]
        (down,) = cb.score([sample("# SANDBOX_DOWN\nprint(5)", truth=tests)])
        assert isinstance(down, SampleError) and "container failed to start" in str(down)
        # an HTTP error is this sample's counted error, not an exception that fails the batch
        broken, fine = cb.score([sample("# HTTP_500\nprint(5)", truth=tests), sample(good, truth=tests)])
        assert isinstance(broken, SampleError) and "HTTPError" in str(broken) and fine == 1.0
        assert all("output" not in r and "5\n" not in r["code"] for r in FakeSandboxFusion.requests)
        cb.close()
    finally:
        server.shutdown()


def test_a_failure_on_another_rank_is_shown_too(monkeypatch):
    """In a multi-process run each rank scores its own samples: rank 1's failures warn too."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", 1)
    with pytest.warns(UserWarning, match="failed on 3 of 3 samples"):
        out = combine_rewards([Fixed(ValueError("on rank 1"))], SAMPLES)
    assert out.errors == 3
