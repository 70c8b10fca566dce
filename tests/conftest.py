import os

# Tests never reach a model hub: everything is built from configs and local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

torch.set_num_threads(2)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """The tests' tiny BPE tokenizer (a folder), built once per run; no test writes to it."""
    from tests.helpers import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


# The slow tiers, by file: `pytest -m "not slow and not sandbox and not vllm and not real_model"`
# is the fast loop (tests/README.md); CI runs everything.
TIERS = {
    "sandbox": ("test_sandbox_", "test_code_reward", "test_code_quickstart"),
    "vllm": ("test_vllm_",),
    "real_model": ("test_real_model", "test_real_data", "test_gguf"),
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker, prefixes in TIERS.items():
            if item.path.name.startswith(prefixes):
                item.add_marker(marker)
