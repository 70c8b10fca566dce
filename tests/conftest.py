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
