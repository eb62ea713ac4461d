"""The client libraries the tests run real scripts of (TRL, PEFT, datasets, DeepSpeed), as each stack has them.

tox installs the newest release of each that installs beside a stack's pins. Where none supports the stack's torch
or Python, the client is absent or fails to import, and the tests that need it are skipped with the reason
computed here (what is missing or what the import raised, and the stack), never silently. On a stack that sets
``LOWMEM_REQUIRE_CLIENTS=1`` (the pinned one) a missing client fails instead: there every client is expected.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform

import pytest
import torch


def _stack() -> str:
    return f"Python {platform.python_version()}, torch {torch.__version__}"


def require_client(name: str):
    """The imported client module, or a skip (a failure where clients are required) saying why it is not there."""
    reason = None
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        reason = f"{name} is not installed on this stack ({_stack()}): no release of it installed beside the stack's pins"
    else:
        try:
            return importlib.import_module(name)
        except Exception as e:  # a release that installs but does not support this torch/Python raises anything
            reason = f"{name} {version} does not import on this stack ({_stack()}): {type(e).__name__}: {e}"
    if os.environ.get("LOWMEM_REQUIRE_CLIENTS") == "1":
        pytest.fail(reason)
    pytest.skip(reason)
