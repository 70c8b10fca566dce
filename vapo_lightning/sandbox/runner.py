"""What runs inside the sandbox, after the isolation layers are in place.

The runner only *produces* values; it never sees expected outputs and never judges. It writes
one frame per test to the result pipe, which the host decodes and compares with its own code:

    ``<i> R <json>``           function mode: the return value, encoded as plain JSON
    ``<i> E <json string>``    function mode: the exception type the call raised
    ``<i> O <exit> <json>``    stdin mode: exit status and the captured stdout text
    ``0 1 <base64>``           execute mode: the next bytes of the program's stdout (fd 1)
    ``0 2 <base64>``           execute mode: the next bytes of its stderr (fd 2)
    ``0 C <fd>``               execute mode: that stream passed ``max_output_bytes``; the rest
                               was read and dropped
    ``0 X <exit>``             execute mode: the program's exit status (it has ended)

Execute mode forwards output as it comes, so that what a program printed before its timeout
has reached the server when the server kills the run.

The candidate shares this process (function mode) or is its child (stdin and execute mode),
so it can write forged frames too; that is harmless, because a forged frame is just a claimed
output, and claiming the right output requires computing it (in execute mode the output is
the program's own anyway; the host reads any frame without trusting it).

Also here: `kill_tree`, which kills what a test (or a run) left running.
"""

from __future__ import annotations

import atexit
import binascii
import contextlib
import json
import math
import os
import select
import sys
import time
import types
from collections.abc import Callable

if __package__:
    from . import protocol as P
else:  # imported by server.py run as a script
    import protocol as P


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def plain(x: object, depth: int = 0) -> object:
    """`x` as plain JSON data, by exact type (subclasses and custom objects are refused),
    nested at most `P.MAX_DEPTH` deep."""
    if depth >= P.MAX_DEPTH:
        raise ValueError("nested too deeply")
    t = type(x)
    if x is None or t is bool or t is int or t is str:
        return x
    if t is float:
        if not math.isfinite(x):
            raise ValueError("non-finite float")
        return x
    if t is list or t is tuple:
        return [plain(v, depth + 1) for v in x]
    if t is dict:
        out = {P.json_key(k): plain(v, depth + 1) for k, v in x.items()}
        if len(out) < len(x):  # {1: .., "1": ..}: one JSON object key for two
            raise ValueError("dict keys equal as JSON text")
        return out
    raise TypeError(f"cannot return a {t.__name__}")


def _encode(value: object) -> str:
    """JSON of a returned value (`plain`), ints of any length included: Python's 4,300-digit
    int-to-str guard protects a server from its input, not a program's own answer. The
    recursion limit is raised meanwhile, so that a value `P.MAX_DEPTH` deep is converted
    however deep the program's own limit or stack (`plain` takes two frames a level)."""
    digits, frames = sys.get_int_max_str_digits(), sys.getrecursionlimit()
    sys.set_int_max_str_digits(0)
    sys.setrecursionlimit(frames + 3 * P.MAX_DEPTH)
    try:
        return json.dumps(plain(value), allow_nan=False, ensure_ascii=False)
    finally:
        sys.set_int_max_str_digits(digits)
        sys.setrecursionlimit(frames)


def _utf8(line: str) -> bytes:
    """A frame line as UTF-8, as many bytes as the program's text (JSON's \\u escapes would
    triple non-ASCII text against the output cap); a lone surrogate (only ever inside a JSON
    string) becomes its JSON escape, which the host reads back as the same lone surrogate."""
    return line.encode("utf-8", "backslashreplace")


def _as_module(name: str, path: str | None = None) -> dict:
    """The globals of a fresh module registered in sys.modules as `name`, so that what the
    program defines can be pickled by reference (multiprocessing sends functions that way).
    `path`: where its source was written, for the interpreters that multiprocessing's spawn
    and forkserver start, which import the program again from there."""
    module = types.ModuleType(name)
    module.__builtins__ = __builtins__
    if path is not None:
        module.__file__ = path
    sys.modules[name] = module
    return module.__dict__


def _write_program(code: str, name: str) -> str:
    """Writes the program to `name` in the working directory, which goes last on sys.path (it
    cannot shadow the stdlib), and returns its path."""
    path = os.path.join(os.getcwd(), name)
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(code)
    sys.path.append(os.getcwd())
    return path


def _find_function(namespace: dict, fn_name: str):
    if fn_name in namespace:
        return namespace[fn_name]
    solution = namespace.get("Solution")  # LeetCode-style problems (TACO, LiveCodeBench)
    if isinstance(solution, type):
        return getattr(solution(), fn_name)
    raise NameError(f"no function named {fn_name!r}")


def run_function_mode(code: str, inputs: list[str], fn_name: str, res_fd: int) -> None:
    """Defines the program once, then calls `fn_name` on each test's (freshly decoded) args."""
    try:
        _as_module("__main__")  # not the server's script: a spawned child would run it
        namespace = _as_module("solution", _write_program(code, "solution.py"))
        exec(compile(code, "<solution>", "exec"), namespace)
        fn = _find_function(namespace, fn_name)
    except BaseException as err:  # the candidate's error, reported as every test's error
        frame = json.dumps(type(err).__name__)
        _write_all(res_fd, "".join(f"{i} E {frame}\n" for i in range(len(inputs))).encode())
        return
    for i, raw in enumerate(inputs):
        try:
            args = P.decode_args(raw)
            line = _utf8(f"{i} R {_encode(fn(*args))}\n")
        except BaseException as err:  # includes SystemExit: one test's failure, not the run's
            line = f"{i} E {json.dumps(type(err).__name__)}\n".encode()
        _write_all(res_fd, line)


def _run_program(code: str, path: str, stdin_path: str, stdout_path: str) -> None:
    """Child of the runner: fd 0/1 are the test's files; runs the program as __main__ and
    ends as `python main.py` would (`_finalize`)."""
    fd = os.open(stdin_path, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    # Appended to, so that what the program writes through /dev/stdout (a second open file
    # of its own) follows what it printed, as it would in a pipe.
    fd = os.open(stdout_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.close(fd)
    atexit._clear()  # (the server's own, if any: not the program's to run)
    status = 0
    try:
        exec(compile(code, "<solution>", "exec"), _as_module("__main__", path))
    except SystemExit as err:
        status = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    except BaseException:
        status = 1
    os._exit(_finalize(status) & 0xFF)


def _finalize(status: int) -> int:
    """Ends the program as the interpreter's own shutdown does (`Py_FinalizeEx`): waits for
    its non-daemon threads, runs its atexit functions, then flushes stdout and stderr unless
    the program closed them. Returns its exit status: `status`, or 120 when a flush failed.
    (The stack-size idiom of competitive programming runs its `main` in a thread; fast-output
    templates print their buffer from an atexit function.)"""
    if "threading" in sys.modules:
        with contextlib.suppress(BaseException):
            sys.modules["threading"]._shutdown()
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None and not stream.closed:
                stream.flush()
        except BaseException:
            status = 120
    return status


def children_of(pid: int) -> list[int]:
    """Live and zombie children of `pid` (all its threads), from /proc."""
    try:
        kids = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                kids += [int(x) for x in f.read().split()]
        return kids
    except FileNotFoundError:  # gone, or a kernel without CONFIG_PROC_CHILDREN
        if not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"):
            return _scan_children(pid)
        return []
    except (OSError, ValueError):
        return []


def _scan_children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rindex(b")") + 2 :].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def _reap_zombies() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_tree(root: int, keep: frozenset[int] | set[int] = frozenset()) -> None:
    """SIGKILLs and reaps every descendant of `root` (this process, a child subreaper or pid 1
    of its namespace), except the children in `keep` and their descendants.

    Each round walks the whole tree, stopping every process first (a stopped process cannot
    fork, so a fork bomb cannot outgrow us), then kills them all; orphans are re-parented to
    us, so the next round finds whatever was forked meanwhile.
    """
    for _ in range(1000):
        _reap_zombies()
        found: list[int] = []
        frontier = [k for k in children_of(root) if k not in keep]
        while frontier and len(found) < 100000:
            pid = frontier.pop()
            found.append(pid)
            with contextlib.suppress(OSError):
                os.kill(pid, 19)  # SIGSTOP
            frontier += children_of(pid)
        if not found:
            return
        for pid in found:
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        if root == os.getpid():
            time.sleep(0.0002)


def kill_descendants() -> None:
    """`kill_tree` of this process (which must be a child subreaper or pid 1)."""
    kill_tree(os.getpid())


def run_stdin_mode(
    code: str,
    inputs: list[str],
    res_fd: int,
    max_stdout: int,
    own_pid_namespace: bool,
    confine: Callable[[], None] | None = None,
) -> None:
    """Runs the program once per test in a fresh child; reports its exit status and stdout.

    Whatever one test leaves running is killed and reaped before the next test starts: with
    our own PID namespace by ``kill(-1)``, otherwise through `kill_descendants` (the caller
    must have made this process a child subreaper; pid 1 of a namespace is one anyway). `confine` runs in each child before the program (e.g.
    Landlock, applied there so that this process may still read /proc).
    """
    path = _write_program(code, "main.py")
    for i, text in enumerate(inputs):
        stdin_path, stdout_path = f"stdin-{i}", f"stdout-{i}"
        with open(stdin_path, "w", encoding="utf-8") as f:
            f.write(text)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(res_fd)
                if confine is not None:
                    confine()
            except BaseException:
                os._exit(126)  # could not confine: the program does not run
            _run_program(code, path, stdin_path, stdout_path)
        _, status = os.waitpid(pid, 0)
        if own_pid_namespace:  # kill what test i left behind (daemons); spares us, pid 1
            with contextlib.suppress(OSError):
                os.kill(-1, 9)
        kill_descendants()  # reaps them too (a zombie still counts against RLIMIT_NPROC)
        exit_code = os.waitstatus_to_exitcode(status)
        try:
            with open(stdout_path, "rb") as f:
                out = f.read(max_stdout + 1)
        except OSError:
            out = b""
        for path in (stdin_path, stdout_path):
            with contextlib.suppress(OSError):
                os.unlink(path)
        if len(out) > max_stdout:
            exit_code, out = -999, b""  # over the byte cap: reported as a failure
        # Invalid UTF-8 travels as lone surrogates (json escapes them), which no text the
        # host expects can equal: the host fails such output instead of reading U+FFFD.
        text_out = json.dumps(out.decode("utf-8", "surrogateescape"), ensure_ascii=False)
        _write_all(res_fd, _utf8(f"{i} O {exit_code} {text_out}\n"))


def run_execute_mode(
    code: str,
    res_fd: int,
    max_output_bytes: int,
    own_pid_namespace: bool,
    confine: Callable[[], None] | None = None,
) -> None:
    """Runs the program once as __main__ in a fresh child, stdin empty, like one stdin-mode
    test; forwards the first `max_output_bytes` of its stdout and of its stderr as they come
    (the rest is read and dropped, so that a flood cannot block it), then its exit status.

    The run ends when the child exits, not when its pipes close (a daemon it left may hold
    them): what it left running is killed as in stdin mode, then the pipes are drained."""
    path = _write_program(code, "main.py")
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        try:
            for fd in (res_fd, out_r, err_r):
                os.close(fd)
            if confine is not None:
                confine()
        except BaseException as err:  # the program does not run
            with contextlib.suppress(OSError):
                os.write(err_w, f"sandbox: could not confine the program: {err!r}\n".encode())
            os._exit(126)
        _execute_program(code, path, out_w, err_w)
    os.close(out_w)
    os.close(err_w)
    streams = {
        out_r: _Capped(1, max_output_bytes, res_fd),
        err_r: _Capped(2, max_output_bytes, res_fd),
    }
    exited = os.pidfd_open(pid)
    poller = select.poll()
    for fd in (out_r, err_r, exited):
        poller.register(fd, select.POLLIN)
    running = True
    while running:
        for fd, _ in poller.poll():
            if fd == exited:
                running = False
            elif not streams[fd].read(fd):
                poller.unregister(fd)
    _, status = os.waitpid(pid, 0)
    os.close(exited)
    if own_pid_namespace:  # what the program left running (daemons); spares us, pid 1
        with contextlib.suppress(OSError):
            os.kill(-1, 9)
    kill_descendants()
    for fd, stream in streams.items():  # no writer is left: what is in the pipe, then EOF
        os.set_blocking(fd, False)
        with contextlib.suppress(OSError):
            while stream.read(fd):
                pass
        os.close(fd)
    _write_all(res_fd, f"0 X {os.waitstatus_to_exitcode(status)}\n".encode())


class _Capped:
    """One output stream of an executed program: its first `room` bytes go out as ``0 <fd>
    <base64>`` frames, then one ``0 C <fd>`` frame if more came."""

    def __init__(self, fd_number: int, room: int, res_fd: int) -> None:
        self.fd_number, self.room, self.res_fd, self.cut = fd_number, room, res_fd, False

    def read(self, fd: int) -> bool:
        """Reads one chunk of the pipe `fd` and forwards what fits; False at EOF."""
        chunk = os.read(fd, 65536)
        if not chunk:
            return False
        piece = chunk[: self.room]
        if piece:
            self.room -= len(piece)
            encoded = binascii.b2a_base64(piece, newline=False)
            _write_all(self.res_fd, b"0 %d %s\n" % (self.fd_number, encoded))
        if len(piece) < len(chunk) and not self.cut:
            self.cut = True
            _write_all(self.res_fd, b"0 C %d\n" % self.fd_number)
        return True


def _execute_program(code: str, path: str, out_fd: int, err_fd: int) -> None:
    """Child of the runner in execute mode: fd 0 is /dev/null (`zygote.new_session`), fd 1 and
    2 are the pipes to the runner. Runs the program as __main__ and ends as Python would: an
    uncaught exception's traceback on stderr and status 1, `sys.exit(text)` prints the text,
    then `_finalize`."""
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    atexit._clear()
    status = 0
    try:
        exec(compile(code, path, "exec"), _as_module("__main__", path))
    except SystemExit as err:
        if err.code is None or isinstance(err.code, int):
            status = err.code or 0
        else:
            status = 1
            with contextlib.suppress(BaseException):
                print(err.code, file=sys.stderr)
    except BaseException as err:
        status = 1
        # The traceback from the program's own frames on (not this function's), printed by
        # the program's excepthook as the interpreter would; the source lines come from `path`.
        err.__traceback__ = err.__traceback__.tb_next if err.__traceback__ else None
        with contextlib.suppress(BaseException):
            sys.excepthook(type(err), err, err.__traceback__)
    os._exit(_finalize(status) & 0xFF)
