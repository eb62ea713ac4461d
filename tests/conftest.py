import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session", autouse=True)
def hermetic_hf_home(tmp_path_factory):
    """Keep huggingface_hub / transformers from touching the user's cache or the network."""
    home = tmp_path_factory.mktemp("hf_home")
    saved = {k: os.environ.get(k) for k in ("HF_HOME", "HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY")}
    os.environ.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    yield home
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def make_checkpoint(checkpoint_root):
    """Factory: ``make_checkpoint("llama", "sharded", dtype=torch.float32) -> folder`` (cached per session)."""
    from checkpoints import make_checkpoint as make

    def factory(case_name, fmt, **kwargs):
        return make(checkpoint_root, case_name, fmt, **kwargs)

    return factory
