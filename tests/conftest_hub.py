"""pytest fixtures for the loopback fake Hub (tests/hub_server.py).

Not a conftest by itself (tests/conftest.py is not mine to edit). Either import the fixtures in a test module::

    from conftest_hub import hf_hub, hub_server  # noqa: F401

or make them global with one line in tests/conftest.py::

    from conftest_hub import hf_hub, hub_server  # noqa: F401,E402

No ``pytest_configure`` / environment hook is needed: ``use_hub`` patches ``huggingface_hub.constants`` at run time,
which works whenever huggingface_hub was imported (see hub_server's module docstring).
"""

from __future__ import annotations

import pytest

from hub_server import HubServer, use_hub


@pytest.fixture
def hub_server(tmp_path):
    """A running ``HubServer`` with no repos (add them with ``add_repo``); the process is NOT pointed at it."""
    server = HubServer(tmp_path / "hub_root")
    with server:
        yield server
    assert not server.errors, "the fake Hub hit a bug:\n" + "\n".join(server.errors)


@pytest.fixture
def hf_hub(hub_server, tmp_path):
    """``hub_server``, with this process's huggingface_hub / transformers pointed at it and a fresh, empty HF_HOME
    (``tmp_path / "hf_home"``; the cache is ``.../hf_home/hub``)."""
    with use_hub(hub_server, tmp_path / "hf_home"):
        yield hub_server
