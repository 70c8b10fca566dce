"""Reduced isolation: namespaces and/or Landlock switched off (as on Ubuntu >= 23.10 runners,
in Docker, or on kernels without Landlock). Verdict tampering and process escapes must still
score 0 and leave nothing running; each layer that a program genuinely needs is skipped for.
Also the unprivileged path (namespaces made from a user namespace), which a root server only
takes when asked (`via_userns=True`): CI runs as root.

Also here: stdin mode kills what one test left running before the next test starts, in every
configuration (with a PID namespace by ``kill(-1)``, without one through a subreaper).
"""

from __future__ import annotations

import os

import pytest

from tests.sandbox.helpers import PROGRAMS, sandbox_processes
from vapo_lightning.sandbox import Pool

# mode: (namespaces, landlock, via_userns)
MODES = {
    "via_userns": (True, True, True),
    "no_namespaces": (False, True, False),
    "no_landlock": (True, False, False),
    "neither": (False, False, False),
}
ALL_MODES = {"full": (True, True, False), **MODES}

TAMPERING = [
    "exit_zero_early",
    "os_exit_zero",
    "atexit_exit",
    "excepthook_exit",
    "fake_markers",
    "always_equal",
    "str_subclass",
    "patched_builtins",
    "frame_walk",
    "stdin_fake_exit",
    "true_for_one",
    "nan_for_anything",
]
ESCAPES = ["fork_bomb", "many_children", "double_fork_daemon", "escaped_session", "sigstop_self"]
PARENT_ATTACKS = ["kill_parent", "stop_parent", "killpg_and_kill_all", "stop_every_process"]
BY_NAME = {p[0]: p for p in PROGRAMS}


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    """One pool per configuration, started on first use."""
    started: dict[str, Pool] = {}
    home = str(tmp_path_factory.mktemp("home"))

    def get(mode: str) -> Pool:
        # One configuration at a time, as on a real machine: without PID namespaces and
        # Landlock scoping, a run can signal every process of the sandbox uid, other pools'
        # idle spares included (a denial of service the isolation gate warns about).
        for other in [m for m in started if m != mode]:
            started.pop(other).close()
        if mode not in started:
            namespaces, landlock, via_userns = ALL_MODES[mode]
            started[mode] = Pool(size=1, namespaces=namespaces, landlock=landlock, via_userns=via_userns)
            started[mode].home = home
        return started[mode]

    get.started = started
    yield get
    for pool in started.values():
        pool.close()


def _check_layers(mode: str, layers: list[str]) -> None:
    namespaces, landlock, via_userns = ALL_MODES[mode]
    if via_userns:  # namespaces, if granted at all, came from a user namespace
        assert "userns" in layers or not {"pidns", "netns", "mountns"} & set(layers), layers
    if not namespaces:
        assert not {"userns", "pidns", "netns", "mountns"} & set(layers), layers
    if not landlock:
        assert not any(layer.startswith("landlock") for layer in layers), layers


def _leftovers(pools) -> list[int]:
    """Sandbox processes still alive, besides the idle spares of every pool started here."""
    spares = set().union(*(p.spare_sessions() for p in pools.started.values()))
    return sandbox_processes(spares)


def _run_hostile(pools, mode: str, name: str) -> None:
    pool = pools(mode)
    _, code, fn_name, tests, timeout_s = BY_NAME[name]
    code = code.replace("@HOME@", repr(pool.home))
    signals_isolated = {"pidns", "landlock_scope"} & set(pool.layers)
    if name in PARENT_ATTACKS and os.geteuid() != 0 and not signals_isolated:
        pytest.skip("signals to the parent need a PID namespace or Landlock scoping")
    result = pool.evaluate(code, tests, fn_name, timeout_s=timeout_s)
    _check_layers(mode, result.layers)
    assert result.total == len(tests)
    assert result.passed == 0, result
    assert _leftovers(pools) == []
    ok = pool.evaluate("def f(x):\n    return x + 1\n", [{"input": [1], "output": 2}], "f")
    assert (ok.passed, ok.status) == (1, "ok"), ok


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", TAMPERING)
def test_tampering_scores_zero_with_reduced_layers(pools, mode, name):
    _run_hostile(pools, mode, name)


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ESCAPES + PARENT_ATTACKS)
def test_escapes_leave_nothing_with_reduced_layers(pools, mode, name):
    _run_hostile(pools, mode, name)


DAEMON_THEN_CHECK = """import os, sys, time
arg = sys.stdin.read().strip()
if arg == "spawn":
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        pid = os.fork()
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        os.write(w, str(pid).encode())
        os._exit(0)
    os.close(w)
    pid = os.read(r, 32).decode()
    os.wait()
    open("daemon.pid", "w").write(pid)
    print("spawned")
else:
    pid = int(open("daemon.pid").read())
    try:
        os.kill(pid, 0)
        print("alive")
    except ProcessLookupError:
        print("dead")
    except PermissionError:  # exists, but in another Landlock domain
        print("alive")
"""


@pytest.mark.parametrize("mode", list(ALL_MODES))
def test_stdin_mode_kills_leftovers_between_tests(pools, mode):
    pool = pools(mode)
    tests = [{"input": "spawn", "output": "spawned"}, {"input": "check", "output": "dead"}]
    result = pool.evaluate(DAEMON_THEN_CHECK, tests, timeout_s=10.0)
    _check_layers(mode, result.layers)
    assert result.per_test == [True, True], result
    assert _leftovers(pools) == []


@pytest.mark.parametrize("mode", list(ALL_MODES))
def test_stdin_mode_checker_sees_a_live_daemon(pools, mode):
    """The check above can fail: within one test, a daemon it started is seen alive."""
    pool = pools(mode)
    code = DAEMON_THEN_CHECK.replace("arg = sys.stdin.read().strip()", 'arg = "spawn"')
    code += '\nos.kill(int(open("daemon.pid").read()), 0)\nprint("alive")\n'
    result = pool.evaluate(code, [{"input": "", "output": "spawned\nalive"}], timeout_s=10.0)
    assert result.passed == 1, result
    assert _leftovers(pools) == []
