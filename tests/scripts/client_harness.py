"""What the client scripts report to ``tests/test_clients.py``: one ``CLIENT_RESULT {json}`` line per process.

The client scripts next to this file are written as their libraries' authors write them; a few ``note*`` calls
and ``with recorded(): main()`` are the only additions. This module never imports lowmem_hf, so the plain run
(``python script.py``) has no lowmem_hf at all. Under ``lowmem-hf run`` the runner has imported it before the
script starts, and ``recorded()`` then records every ``lowmem_hf.patch.FallbackWarning`` the script triggers.
When the script's body returns, ``recorded()`` also ends its process group (``_end_process_group`` says why).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import warnings

import torch

RESULT_PREFIX = "CLIENT_RESULT "

_result: dict = {"loads": [], "fallbacks": []}


def note_load(what: str, model: torch.nn.Module) -> None:
    """Record a model that a ``from_pretrained`` call made (directly or inside a library), and who loaded it."""
    _result["loads"].append(
        {"what": what, "class": type(model).__name__, "lowmem_report": hasattr(model, "lowmem_report")}
    )


def note(**values) -> None:
    """Record results to compare between the plain and the switched run (JSON-serializable values)."""
    _result.update(values)


def float_hex(values) -> list[str]:
    """Exact spellings of floats: equal strings mean bit-identical values."""
    return [float(v).hex() for v in values]


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order: equal digests mean bit-identical tensors."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@contextlib.contextmanager
def recorded():
    """Run the script's main body; on exit print this process's result line (also when the body raised)."""
    patch = sys.modules.get("lowmem_hf.patch")  # present only when the runner imported lowmem_hf
    fallback = getattr(patch, "FallbackWarning", None)
    _result["switched"] = patch is not None
    _result["rank"] = int(os.environ.get("RANK", "0"))
    try:
        with warnings.catch_warnings(record=True) as caught:
            if fallback is not None:
                warnings.simplefilter("always", fallback)  # every fallback, even a second one from the same line
            yield
        _end_process_group()
    finally:
        for w in caught:
            if fallback is not None and issubclass(w.category, fallback):
                _result["fallbacks"].append(str(w.message))
            else:  # shown as it would have been without the recording
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        _emit()


def _end_process_group() -> None:
    """``barrier()`` + ``destroy_process_group()`` once the body returned, as torch's docs ask a script to end.

    transformers' examples (run_clm) and TRL's scripts leave the group to the interpreter's exit. With gloo that
    aborts a rank in about 1 of 10 two-rank runs, plain or switched alike (run_clm_like.py: 6 of 53 plain runs,
    1 of 30 switched; with this teardown 0 of 40 plain). A gloo worker thread frees its last finished
    ``AsyncAllgatherWork`` while the interpreter is finalizing; freeing its tensors takes the GIL, the finalizing
    interpreter ends that thread, and the forced unwind through a noexcept destructor is ``std::terminate``
    ("terminate called without an active exception"; core dump: ``ProcessGroupGloo::runLoop`` >
    ``~AsyncAllgatherWork`` > ``gil_scoped_acquire`` > ``pthread_exit``). torch's PR #179291 proposed this
    teardown at exit and was abandoned. Tearing the group down while the interpreter is alive joins those threads
    first. A body that raised leaves the group alone: a barrier with a failed peer would hang.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _emit() -> None:
    # One write(2) of one short line: under torchrun both ranks share the pipe, and writes below PIPE_BUF
    # (4096 bytes) do not interleave.
    line = (RESULT_PREFIX + json.dumps(_result, sort_keys=True) + "\n").encode()
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line)
