"""The load report: what a load read, held and decided, built from the stream's counters, the plan, the byte source
and the prepared load once the model is finished; and the notes that say what a caller would not guess.

``LoadReport`` itself is in ``types.py``: it crosses stages (the CLI prints it, ``save`` and the logs read it).
"""

from __future__ import annotations

import time
from typing import Any

from .assign import model_nbytes
from .formats import StreamStats
from .settings import proc_status_bytes
from .sources import ByteSource
from .types import DtypeDecision, LoadReport

__all__ = ["notes_of", "report_of"]


def notes_of(prepared: Any, stats: StreamStats) -> tuple[str, ...]:
    """The report's notes: the stream's own, what ranged reads cost beyond the slices, the checkpoint keys that
    duplicate others (never read), and the engine's (a TP load without a process group). ``prepared``: a ``load.PreparedLoad``."""
    if stats.band_extra_bytes:
        stats.notes.append(
            f"fetch='ranges': slices along dim 1 were fetched as whole row bands, one request per band instead of one "
            f"per row; that cost {stats.band_extra_bytes} bytes beyond the slices ({stats.band_extra_bytes / 2**20:.1f} MiB)."
        )
    notes = list(stats.notes) + [
        f"{src} duplicates {dst}; transformers keeps the first, so it was not read" for src, dst in prepared.mapping.duplicates
    ]
    notes += prepared.engine.notes()
    return tuple(notes)


def report_of(
    prepared: Any, model: Any, *, loading_info: Any, decisions: dict[str, DtypeDecision], stats: StreamStats,
    source: ByteSource, workers: int, peak_anon: int, stage_seconds: dict[str, float],
) -> LoadReport:
    """The report of a finished load (``prepared``: its ``load.PreparedLoad``; ``loading_info``: transformers' keys
    missing, unexpected and mismatched; ``workers``: the reader threads the stream ran; ``peak_anon``: the highest
    ``RssAnon`` sampled during the stream). Wall time counts from ``prepare``'s start; header bytes count the ones
    the plan read and the ones the stream read."""
    checkpoint, plan, request = prepared.checkpoint, prepared.plan, prepared.request
    notes = notes_of(prepared, stats)
    return LoadReport(
        missing_keys=frozenset(loading_info.missing_keys),
        unexpected_keys=frozenset(loading_info.unexpected_keys),
        mismatched_keys=frozenset(loading_info.mismatched_keys),
        error_msgs=tuple(loading_info.error_msgs),
        checkpoint_format=checkpoint.format,
        files_read=tuple(stats.files_read),
        bytes_read=stats.bytes_read + checkpoint.header_bytes + stats.header_bytes,
        header_bytes=checkpoint.header_bytes + stats.header_bytes,
        dtype=plan.dtype,
        dtype_policy=request.dtype_policy,
        dtype_decisions=decisions,
        model_bytes=model_nbytes(model),
        staging_bytes=stats.staging_bytes,
        wall_seconds=time.perf_counter() - prepared.started,
        peak_rss_anon_bytes=max(peak_anon, proc_status_bytes("RssAnon")),
        peak_vm_hwm_bytes=proc_status_bytes("VmHWM"),
        notes=notes,
        shards=dict(plan.shards),
        commit=checkpoint.commit,
        mapped_bytes=stats.mapped_bytes,
        gap_bytes=source.gap_bytes_read,
        stage_seconds=stage_seconds,
        reader_workers=workers,
        chunk_bytes=prepared.stream_chunk_bytes,
        page_cache_fraction=prepared.page_cache_fraction,
        requests=source.requests,
        bytes_fetched=source.bytes_fetched,
        bytes_received=source.bytes_received,
    )
