"""``lowmem-hf run SCRIPT [ARGS...]``: run an unchanged script with the switch on.

The script runs as ``__main__`` in this process (so ``torchrun -m lowmem_hf run SCRIPT`` gives every rank the
switch), with ``sys.argv = [SCRIPT, *ARGS]`` and the script's folder first on ``sys.path``, as ``python SCRIPT``
would have it. Each load lowmem_hf does prints one line on stderr, so the log shows who loaded the model.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys

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
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[lowmem_hf] %(message)s"))
    logger = logging.getLogger("lowmem_hf")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # what `python SCRIPT` puts there (not the cwd)
    patch_transformers()
    runpy.run_path(script, run_name="__main__")
