import os
import shutil
import sys
import tempfile

# huggingface_hub reads these once, when it is first imported (during collection, by the test modules), so
# they must be in the environment before that: a conftest imports first. Tests that talk to the loopback Hub
# switch the endpoint and offline mode per test with hub_server.use_hub.
_HF_HOME = tempfile.mkdtemp(prefix="lowmem-hf-home-")
os.environ.update(HF_HOME=_HF_HOME, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
assert "huggingface_hub" not in sys.modules, "conftest must set HF_HOME before huggingface_hub is imported"

import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

from conftest_hub import hf_hub, hub_server  # noqa: E402,F401


@pytest.fixture(scope="session", autouse=True)
def hermetic_hf_home():
    """The temporary HF_HOME of this session (set above, at import); removed at the end."""
    yield _HF_HOME
    shutil.rmtree(_HF_HOME, ignore_errors=True)


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
