"""The host the hostile-program tests attack: a home folder holding a secret file, the secret in
this process's environment and in a process's that stays up, a listener on TCP, UDP and an
abstract Unix socket, and a pool of 2 servers."""

import os
import subprocess

import pytest

from tests.sandbox.helpers import SECRET, Listener
from vapo_lightning.sandbox import Pool


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    secret_file = home / ".secret"
    secret_file.write_text(SECRET)
    secret_file.chmod(0o644)
    os.environ["VAPO_TEST_SECRET"] = SECRET
    # A process whose environment holds the secret, for /proc/<pid>/environ attacks.
    holder = subprocess.Popen(["sleep", "600"], env={"VAPO_TEST_SECRET": SECRET})
    listener = Listener()
    pool = Pool(size=2)
    yield {
        "pool": pool,
        "home": str(home),
        "secret_file": secret_file,
        "listener": listener,
        "holder": holder.pid,
    }
    pool.close()
    listener.close()
    holder.kill()
    holder.wait()
    os.environ.pop("VAPO_TEST_SECRET", None)
