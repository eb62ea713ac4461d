"""``lowmem-hf run SCRIPT [ARGS...]``: run an unchanged script with the switch on.

The script runs as ``__main__`` in this process (so ``torchrun -m lowmem_hf run SCRIPT`` gives every rank the
switch), with ``sys.argv = [SCRIPT, *ARGS]`` and the script's folder first on ``sys.path``, as ``python SCRIPT``
would have it. Each load lowmem_hf does prints one ``[lowmem_hf] lowmem_hf loaded ...`` line on stderr (rank 0), so
the log shows who loaded the model, whatever logging the script configures (``logs.keep_on_stderr``).
"""

from __future__ import annotations

import os
import runpy
import sys

from .logs import keep_on_stderr, show_info
from .patch import patch_transformers

__all__ = ["run_script"]


def run_script(script: str, args: list[str]) -> None:
    """Run ``script`` as ``__main__`` with ``args`` as its ``sys.argv[1:]``, every ``from_pretrained`` through lowmem_hf.

    Raises:
        FileNotFoundError: ``script`` is not a file.
        SystemExit: whatever the script raises.
    """
    if not os.path.isfile(script):
        raise FileNotFoundError(f"lowmem-hf run: script {script!r} does not exist (or is not a file).")
    show_info()
    keep_on_stderr()
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # what `python SCRIPT` puts there (not the cwd)
    patch_transformers()
    runpy.run_path(script, run_name="__main__")
