"""The fork server's wire formats, between the host, the server, its helpers and its sandboxes.

Host and server (the server's stdin / stdout): a frame is a 4-byte big-endian length and that
many bytes of JSON. A request ``{"code", "inputs", "fn_name", "timeout_s", "limits"}`` is one
frame (function mode with a `fn_name`, stdin mode without); an execution request (a tool call:
one run of the program, its output returned) is ``{"mode": "execute", "code",
"max_output_bytes", "timeout_s", "limits"}`` (`request_mode`). The reply is a frame holding a
JSON header, then ``header["raw_len"]`` raw bytes of the result pipe (the host decodes them;
`runner` lists the frames each mode writes there). The request ``{"op": "spares"}`` is
answered with ``{"spare_sids": [...]}``: the session ids of the idle spares, once the spares a
run leaves to fork after its reply are forked. The server hands a run's request frame on, as
received, to its sandbox's request pipe.

Server to zygote (a SOCK_SEQPACKET pair): one message per sandbox to fork, the tmpfs size in
MiB (``=i``) then ``host_dir\\0cgroup\\0...`` (host_dir empty when the sandbox gets a private
/tmp), with the sandbox's ends of its three pipes (control, result, request) attached; the
zygote answers with its pid (``=i``), or minus an errno. Server to mount namespace holder (a
pipe): the pid (``=i``) of each run's sandbox when its run starts, 0 when it has ended.

Sandbox to server, one line each on the control pipe: ``P <pid>`` (C: P2's pid), ``L <JSON
list>`` (P2: the layers in effect, sent just before the program runs) and ``X <error>`` (a
setup error).

Stdlib only, no sibling imports: the server runs as a script (``python -I -S``).
"""

from __future__ import annotations

import json
import os
import struct

DEFAULT_LIMITS = {
    "memory_mb": 2048,
    "file_mb": 16,
    "open_files": 128,
    "processes": 32,
    "pids": 256,
    "tmp_mb": 64,
    "stdout_bytes": 1 << 20,
    "output_bytes": 8 << 20,
}
"""A request's ``limits`` when the host gives none (the probe run, the first spares)."""


def json_key(key: object) -> str:
    """A dict key as JSON writes it (1 -> "1", True -> "true", None -> "null"): how a returned
    dict's keys travel, and how the host reads an expected dict's (MBPP's ``{1: 'a'}``; the
    importers write expected values through JSON already). Other keys: TypeError."""
    t = type(key)
    if t is str:
        return key
    if t is bool or key is None:
        return json.dumps(key)
    if t is int:
        return str(key)
    if t is float and key == key and abs(key) != float("inf"):
        return repr(key)
    raise TypeError(f"cannot return a dict key of type {t.__name__}")


MAX_DEPTH = 1000
"""How deeply a returned value may nest (lists, tuples and dicts in one another): as deep as
CPython's own comparison of two values reaches under its default recursion limit (1000).
The runner refuses deeper values; the host reads no frame deeper than its test's expected
value allows (`compare.decode`)."""

TUPLE, DICT = "__tuple__", "__dict__"
"""The tags of a function-mode test's arguments on their way into the sandbox (`encode_args`):
JSON has no tuple, and its object keys are text only."""


def _tagged(x: object) -> object:
    if isinstance(x, tuple):
        return {TUPLE: [_tagged(v) for v in x]}
    if isinstance(x, dict):
        return {DICT: [[_tagged(k), _tagged(v)] for k, v in x.items()]}
    if isinstance(x, list):
        return [_tagged(v) for v in x]
    return x


def encode_args(args: list, allow_nan: bool = True) -> str:
    """A test's arguments as JSON that keeps what plain JSON loses: a tuple travels as
    ``{"__tuple__": [items]}``, every dict as ``{"__dict__": [[key, value], ...]}`` (its keys
    keep their types: ints, tuples). `decode_args` gives back equal values of the same
    types, so that the function receives what an assert would pass it. Other objects (a set,
    bytes): TypeError."""
    return json.dumps(_tagged(args), allow_nan=allow_nan)


def _untagged(obj: dict) -> object:
    if TUPLE in obj:
        return tuple(obj[TUPLE])
    if DICT in obj:
        return dict(obj[DICT])
    return obj  # (never written by `encode_args`)


def decode_args(text: str) -> list:
    """`encode_args`'s arguments back, in the sandbox."""
    return json.loads(text, object_hook=_untagged)


MODES = ("function", "stdin", "execute")


def request_mode(req: dict) -> str:
    """The mode of a run request: its ``mode`` when it names one, else function mode with a
    `fn_name` and stdin mode without. ValueError for anything else (the server answers
    ``server_error``, before any sandbox is used)."""
    mode = req.get("mode") or ("stdin" if req.get("fn_name") is None else "function")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}")
    if mode == "execute":
        cap = req.get("max_output_bytes")
        if type(cap) is not int or cap < 0:
            raise ValueError("max_output_bytes must be an int >= 0")
    return mode


def frame(blob: bytes) -> bytes:
    return struct.pack(">I", len(blob)) + blob


def read_exact(fd: int, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def read_frame(fd: int) -> bytes:
    """One frame's content; EOFError when the writer closed the stream first."""
    (n,) = struct.unpack(">I", read_exact(fd, 4))
    return read_exact(fd, n)


def spare_message(tmp_mb: int, host_dir: str | None, cgroups: list[str]) -> bytes:
    return struct.pack("=i", int(tmp_mb)) + "\0".join([host_dir or "", *cgroups]).encode()


def parse_spare_message(msg: bytes) -> tuple[int, str | None, list[str]]:
    """``(tmp_mb, host_dir or None, cgroups)`` of a `spare_message`."""
    (tmp_mb,) = struct.unpack("=i", msg[:4])
    host_dir, *cgroups = msg[4:].decode().split("\0")
    return tmp_mb, host_dir or None, cgroups


def pack_pid(pid: int) -> bytes:
    return struct.pack("=i", pid)


def unpack_pid(data: bytes) -> int:
    return struct.unpack("=i", data)[0]


def write_error(fd: int, what: str) -> None:
    """An ``X`` line on the control pipe (at most 500 bytes)."""
    os.write(fd, f"X {what}\n".encode()[:500])


def parse_ctl(ctl: bytes) -> dict:
    """The sandbox's control lines: ``L`` its layers, ``T`` when its program started
    (`time.monotonic`; None if it never did), ``X`` set-up errors."""
    layers, errors, started = [], [], None
    for line in ctl.decode("utf-8", "replace").splitlines():
        if line.startswith("L "):
            layers = json.loads(line[2:])
        elif line.startswith("T "):
            started = float(line[2:])
        elif line.startswith("X "):
            errors.append(line[2:])
    return {"layers": layers, "setup_errors": errors, "started": started}


def pid_line(ctl: bytes) -> bytes | None:
    """C's report: ``P <pid of P2>`` or ``X <error>``, once a whole line of it arrived."""
    for line in ctl.split(b"\n")[:-1]:
        if line.startswith((b"P ", b"X C ")):
            return line
    return None
