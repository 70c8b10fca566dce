"""What one run could learn of, or do to, another run or the host beyond its own end: file
watches and locks on the files all runs share, a sandbox outliving its server, a run's CPU
share under a concurrent one's load."""

from __future__ import annotations

import os
import sys

import pytest

from vapo_lightning.sandbox import Pool

STDLIB = os.path.dirname(os.__file__)

# dnotify on a directory every run imports from, flock on a file every run reads; a POSIX
# record lock on the run's own file (sqlite3 takes those) still works.
WATCH_AND_LOCK = f"""
import errno, fcntl, os
def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
def f():
    d = os.open({STDLIB!r}, os.O_RDONLY)
    shared = os.open({os.__file__!r}, os.O_RDONLY)
    own = os.open("lockfile", os.O_RDWR | os.O_CREAT)
    return {{
        "dnotify": attempt(lambda: fcntl.fcntl(d, fcntl.F_NOTIFY, fcntl.DN_ACCESS)),
        "flock": attempt(lambda: fcntl.flock(shared, fcntl.LOCK_SH | fcntl.LOCK_NB)),
        "lockf": attempt(lambda: fcntl.lockf(own, fcntl.LOCK_EX | fcntl.LOCK_NB)),
        "getfl": attempt(lambda: fcntl.fcntl(own, fcntl.F_GETFL)),
    }}
"""


@pytest.fixture(scope="module")
def pool():
    pool = Pool(size=2)
    yield pool
    pool.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="seccomp is Linux's")
def test_no_directory_watch_or_flock_on_shared_files(pool):
    if "no_fs_watch" not in pool.layers:
        pytest.skip("no seccomp filter on this machine")
    want = {"dnotify": "EPERM", "flock": "EPERM", "lockf": "ok", "getfl": "ok"}
    r = pool.evaluate(WATCH_AND_LOCK, [{"input": [], "output": want}], "f")
    assert r.passed == 1, r
