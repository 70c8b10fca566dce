import os
from pathlib import Path

# Tests never reach a model hub: everything is built from configs and local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

# Two threads whatever the machine's cores; under pytest-xdist (`-n N` workers) the workers
# share those two instead of each taking two.
torch.set_num_threads(max(1, 2 // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """The tests' tiny BPE tokenizer (a folder), built once per run; no test writes to it."""
    from tests.helpers import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


# The slow tiers, by folder or file (paths under tests/; a path ending in "/" is a folder, any
# other a file name's start): `pytest -m "not slow and not sandbox and not vllm and not real_model"`
# is the fast loop (tests/README.md); CI runs everything.
TESTS = Path(__file__).resolve().parent
TIERS = {
    "sandbox": ("sandbox/", "rewards/test_code.py", "e2e/test_code_quickstart.py"),
    "vllm": ("engines/test_vllm", "e2e/test_vllm_"),
    "real_model": ("e2e/test_real_model.py", "tasks/test_real_data.py", "models/test_gguf.py"),
}


def tier_markers(path: Path) -> list[str]:
    """The tiers a test file is in, by its path under tests/ (none for a file elsewhere)."""
    if not path.resolve().is_relative_to(TESTS):
        return []
    where = path.resolve().relative_to(TESTS).as_posix()
    return [marker for marker, prefixes in TIERS.items() if where.startswith(prefixes)]


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker in tier_markers(item.path):
            item.add_marker(marker)
