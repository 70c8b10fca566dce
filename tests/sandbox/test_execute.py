"""Execute mode (a code-interpreter tool call): one program, its exit status, stdout and stderr.

The program is the same confined child as a stdin-mode test; these tests check what comes
back (exactly, cut at `max_output_bytes`, decoded with replacement), that a hang or a flood
ends as a result and leaves the pool working, and that nothing of one call reaches the next.
"""

from __future__ import annotations

import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.sandbox.helpers import pool_leftovers
from vapo_lightning.sandbox import Limits, Pool, client, execute
from vapo_lightning.sandbox.client import _read_execution

TOKEN = secrets.token_hex(8)

# mode: (namespaces, landlock, via_userns), as in test_reduced.py
MODES = {
    "full": (True, True, False),
    "via_userns": (True, True, True),
    "no_namespaces": (False, True, False),
    "neither": (False, False, False),
}


@pytest.fixture(scope="module")
def pool():
    p = Pool(size=2)
    yield p
    p.close()


@pytest.fixture(scope="module")
def pools():
    """One size-1 pool per configuration, one at a time (see test_reduced.py)."""
    started: dict[str, Pool] = {}

    def get(mode: str) -> Pool:
        for other in [m for m in started if m != mode]:
            started.pop(other).close()
        if mode not in started:
            namespaces, landlock, via_userns = MODES[mode]
            started[mode] = Pool(size=1, namespaces=namespaces, landlock=landlock, via_userns=via_userns)
        return started[mode]

    yield get
    for p in started.values():
        p.close()


def test_prints_come_back_exactly(pool):
    code = (
        "import sys\nprint('hello', 42)\nprint('  spaces  \\n\\n\\ttab é € 😀', end='')\nsys.stderr.write('warn\\n')\n"
    )
    r = pool.execute(code)
    assert (r.status, r.exit_code, r.truncated) == ("ok", 0, False), r
    assert r.stdout == "hello 42\n  spaces  \n\n\ttab é € 😀"
    assert r.stderr == "warn\n"
    assert r.layers == pool.layers
    assert r.total_ms > 0


def test_uncaught_exception_gives_its_traceback_and_status_error(pool):
    code = "print('before')\ndef f(x):\n    raise ValueError(f'boom {x}')\nf(7)\n"
    r = pool.execute(code)
    assert (r.status, r.exit_code, r.stdout) == ("error", 1, "before\n"), r
    lines = r.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):", r.stderr
    assert lines[-1] == "ValueError: boom 7"
    assert "line 4, in <module>" in r.stderr and "line 3, in f" in r.stderr
    assert "raise ValueError(f'boom {x}')" in r.stderr  # the source line is shown
    assert "runner" not in r.stderr  # the traceback starts at the program's own frames


@pytest.mark.parametrize(
    "code, status, exit_code, stderr",
    [
        ("import sys\nsys.exit(0)", "ok", 0, ""),
        ("import sys\nsys.exit(3)", "error", 3, ""),
        ("import sys\nsys.exit('bye')", "error", 1, "bye\n"),
        ("import os\nos._exit(5)", "error", 5, ""),
        ("import os\nos.kill(os.getpid(), 9)", "error", -9, ""),
    ],
)
def test_exit_status_as_python_gives_it(pool, code, status, exit_code, stderr):
    r = pool.execute(code)
    assert (r.status, r.exit_code, r.stderr) == (status, exit_code, stderr), r


def test_syntax_error_and_empty_stdin(pool):
    r = pool.execute("x = (\n")
    assert (r.status, r.exit_code) == ("error", 1), r
    assert r.stderr.splitlines()[-1].startswith("SyntaxError"), r.stderr
    r = pool.execute("import sys\nprint(repr(sys.stdin.read()))\ninput()\n")
    assert (r.status, r.stdout) == ("error", "''\n"), r
    assert r.stderr.endswith("EOFError: EOF when reading a line\n"), r.stderr


def test_infinite_loop_times_out_and_the_pool_goes_on(pool):
    t0 = time.perf_counter()
    r = pool.execute("print('before', flush=True)\nwhile True:\n    pass\n", timeout_s=1.0)
    elapsed = time.perf_counter() - t0
    assert (r.status, r.exit_code, r.stdout) == ("timeout", None, "before\n"), r
    assert 1.0 <= elapsed < 2.0, elapsed
    for i in range(len(pool.servers)):  # the timed-out server among them (idle queue: FIFO)
        t0 = time.perf_counter()
        r = pool.execute(f"print({i})", timeout_s=5.0)
        assert (r.status, r.stdout) == ("ok", f"{i}\n"), r
        assert time.perf_counter() - t0 < 1.0


def test_one_huge_print_is_truncated_not_failed(pool):
    r = pool.execute("print('x' * 10**7)\nprint('done', file=__import__('sys').stderr)")
    assert (r.status, r.exit_code, r.truncated) == ("ok", 0, True), r.status
    assert r.stdout == "x" * 16384  # the first bytes, exactly max_output_bytes of them
    assert r.stderr == "done\n"


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_endless_print_loop_is_truncated_at_the_timeout(pool, stream):
    code = f"import sys\nwhile True:\n    print('spam', file=sys.{stream})\n"
    t0 = time.perf_counter()
    r = pool.execute(code, timeout_s=1.0, max_output_bytes=1000)
    assert time.perf_counter() - t0 < 2.0
    assert (r.status, r.truncated) == ("timeout", True), r.status
    text = getattr(r, stream)
    assert text == ("spam\n" * 200), len(text)  # 1000 bytes
    assert (r.stdout if stream == "stderr" else r.stderr) == ""


def test_nothing_but_truncation_with_a_zero_cap(pool):
    r = pool.execute("print('hidden')", max_output_bytes=0)
    assert (r.status, r.stdout, r.stderr, r.truncated) == ("ok", "", "", True), r
    r = pool.execute("pass", max_output_bytes=0)
    assert (r.status, r.truncated) == ("ok", False), r
    with pytest.raises(ValueError):
        pool.execute("pass", max_output_bytes=-1)


def test_output_beyond_the_whole_run_cap_is_output_limit(pool):
    """The run's own cap (`Limits.output_bytes`) still kills a run whose cut output, base64
    encoded, exceeds it: the one case that is not a truncated result."""
    r = pool.execute("print('x' * 10**6)", limits=Limits(output_bytes=100_000), max_output_bytes=1 << 20)
    assert (r.status, r.exit_code) == ("output_limit", None), r
    assert 0 < len(r.stdout) <= 100_000


def test_multibyte_text_split_across_pipe_reads_comes_back_whole(pool):
    r = pool.execute("print('€' * 40000)", max_output_bytes=1 << 20)  # 120 kB, 3-byte chars
    assert (r.status, r.truncated) == ("ok", False), r.status
    assert r.stdout == "€" * 40000 + "\n"


def test_invalid_utf8_decodes_with_replacement(pool):
    code = "import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe end\\n')\nsys.stderr.buffer.write(b'\\xc3(')\n"
    r = pool.execute(code)
    assert (r.status, r.stdout, r.stderr) == ("ok", "ok \ufffd\ufffd end\n", "\ufffd("), r


def test_no_file_or_state_of_one_call_reaches_the_next(pool):
    writer = (
        f"import builtins\nbuiltins.LEFT = 1\nopen('/tmp/vapo-exec-{TOKEN}', 'w').write('L')\n"
        "open('note', 'w').write('L')\nopen('/dev/shm/note', 'w').write('L')\nprint('written')\n"
    )
    assert pool.execute(writer).stdout == "written\n"
    reader = (
        "import builtins, os\n"
        f"print([os.path.exists(p) for p in ('/tmp/vapo-exec-{TOKEN}', 'note', '/dev/shm/note')],"
        " hasattr(builtins, 'LEFT'))\n"
        f"open('/tmp/vapo-exec-{TOKEN}')\n"
    )
    for _ in range(len(pool.servers) + 1):  # whichever server runs it
        r = pool.execute(reader)
        assert r.stdout == "[False, False, False] False\n", r
        assert (r.status, r.stderr.splitlines()[-1]) == (
            "error",
            f"FileNotFoundError: [Errno 2] No such file or directory: '/tmp/vapo-exec-{TOKEN}'",
        )
    assert not os.path.exists(f"/tmp/vapo-exec-{TOKEN}")


def test_concurrent_executes_from_threads(pool):
    def one(i: int):
        return i, pool.execute(f"import time\ntime.sleep(0.05)\nprint({i} * 7)\n")

    with ThreadPoolExecutor(2 * len(pool.servers)) as workers:
        results = list(workers.map(one, range(12)))
    for i, r in results:
        assert (r.status, r.stdout) == ("ok", f"{i * 7}\n"), (i, r)


def test_a_daemon_holding_stdout_neither_holds_up_the_call_nor_survives(pool):
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    while True:\n"
        "        print('daemon', flush=True)\n"
        "        time.sleep(0.01)\n"
        "time.sleep(0.1)\n"
        "print('done')\n"
    )
    r = pool.execute(code, timeout_s=20.0)
    assert (r.status, r.exit_code) == ("ok", 0), r
    # the daemon may print once more between the program's exit and its kill: not the end
    assert "\ndone\n" in r.stdout and "daemon\n" in r.stdout
    assert r.total_ms < 5000
    assert pool_leftovers(pool) == []


def test_limits_apply(pool):
    r = pool.execute("open('big', 'wb').write(b'x' * (2 << 20))", limits=Limits(file_mb=1))
    assert r.status == "error" and "File too large" in r.stderr, r
    r = pool.execute("x = bytearray(8 << 30)")
    assert r.status == "error" and r.stderr.endswith("MemoryError\n"), r


def test_module_level_execute_goes_through_the_default_pool(pool, monkeypatch):
    monkeypatch.setattr(client, "_default", pool)
    r = execute("print(6 * 7)", timeout_s=5.0, max_output_bytes=2)
    assert (r.status, r.stdout, r.truncated) == ("ok", "42", True), r


def test_frames_are_read_without_trusting_them():
    raw = (
        b"0 1 aGVsbG8K\n"  # 'hello\n'
        b"0 1 !!!\n"  # not base64: skipped
        b"0 2 ZXJy\n"  # 'err'
        b"1 1 aWdub3JlZA==\n"  # not index 0
        b"0 X \xd9\xa3\n"  # an exit code that is not ASCII digits
        b"0 X 7\n"
        b"0 X 0\n"  # only the first counts
        b"0 1 Y3V0"  # a line the server cut: no newline
    )
    assert _read_execution(raw, 100) == (7, "hello\n", "err", False)
    assert _read_execution(raw, 3) == (7, "hel", "err", True)
    assert _read_execution(b"\x00garbage\n0 C 1\n", 10) == (None, "", "", True)


@pytest.mark.parametrize("mode", list(MODES))
def test_reduced_layers_run_the_same_way(pools, mode):
    """Without namespaces or Landlock the program still runs as the confined child: output,
    tracebacks, timeouts and leftover daemons are handled the same; a file left in /tmp is
    gone for the next call wherever a private /tmp or Landlock is in effect."""
    p = pools(mode)
    r = p.execute("print('hi')\nraise KeyError(1)\n")
    assert (r.status, r.exit_code, r.stdout) == ("error", 1, "hi\n"), r
    assert r.stderr.endswith("KeyError: 1\n")
    if not MODES[mode][0]:
        assert not {"pidns", "mountns", "userns"} & set(r.layers), r.layers
    r = p.execute("print('x', flush=True)\nwhile True:\n    pass\n", timeout_s=0.5)
    assert (r.status, r.stdout) == ("timeout", "x\n"), r
    r = p.execute("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\n")
    assert r.status == "ok", r
    assert pool_leftovers(p) == []
    if not {"private_tmp", "landlock_fs"} & set(p.layers):
        pytest.skip("no private /tmp and no Landlock: /tmp is the host's")
    path = f"/tmp/vapo-exec-{TOKEN}-{mode}"
    p.execute(f"open({path!r}, 'w').write('L')\nopen('note', 'w').write('L')")
    r = p.execute(f"import os\nprint(os.path.exists({path!r}), os.path.exists('note'))")
    assert r.stdout == "False False\n", r
    assert not os.path.exists(path)


def test_an_unknown_mode_is_a_server_error_and_the_server_goes_on(pool):
    request = {"mode": "repl", "code": "print(1)", "timeout_s": 5.0, "limits": Limits().__dict__}
    header, raw = pool.servers[0].run(request)
    assert (header["status"], raw) == ("server_error", b""), header
    header, _ = pool.servers[0].run({**request, "mode": "execute", "max_output_bytes": -1})
    assert header["status"] == "server_error", header
    r = pool.execute("print(1)")
    assert (r.status, r.stdout) == ("ok", "1\n"), r
