"""``lowmem-hf load``'s output: the repeated loads of a comparison summed up as medians, ratios and multiples of ``bare``.

One load per loader is one sample of a noisy quantity: on a shared or virtualized machine two loads of the same
checkpoint in a row can differ by half (page faults on fresh memory cost what the hypervisor makes them cost). So
the comparison runs ``--repeats`` rounds, each loader once per round in an order that alternates between rounds,
and judges by medians and by the rounds each loader won. ``bare`` (one process only) is the floor: every tensor
of the checkpoint read and converted into fresh memory, with no model, no plan and no checks; how far each loader
is from it is what a loader's own work costs.
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["round_order", "summarize", "comparison_lines", "print_loads"]

_MIB = 1024 * 1024
_MEMORY = ("peak_rss_anon_bytes", "peak_vm_hwm_bytes")


def round_order(loaders: list[str], round_index: int) -> list[str]:
    """The loaders in the order round ``round_index`` runs them: as given in even rounds, reversed in odd ones, so
    that no loader always runs first (after a page-cache warm-up) or last."""
    return list(loaders) if round_index % 2 == 0 else list(reversed(loaders))


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per loader (in first-seen order) from every run: the median time, each run's time, and the highest
    memory peaks of its runs (the peak is a bound, so the worst run is the honest one)."""
    loaders: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        loaders.setdefault(run["loader"], []).append(run)
    summary = []
    for loader, own in loaders.items():
        entry = {**own[0], "seconds": statistics.median(r["seconds"] for r in own), "runs_seconds": [r["seconds"] for r in own]}
        entry.update({key: max(r[key] for r in own) for key in _MEMORY if key in own[0]})
        summary.append(entry)
    return summary


def _wins(ours: list[float], theirs: list[float]) -> int:
    return sum(a < b for a, b in zip(ours, theirs))


def comparison_lines(summary: list[dict[str, Any]]) -> list[str]:
    """The ratio lines under the per-loader lines: lowmem_hf against transformers (medians, rounds won, memory), and
    each loader as a multiple of ``bare`` where it ran."""
    by = {entry["loader"]: entry for entry in summary}
    ours, theirs, bare = by.get("lowmem"), by.get("transformers"), by.get("bare")
    lines = []
    if ours and theirs:
        rounds = len(ours["runs_seconds"])
        ratio = lambda key: ours[key] / theirs[key] if theirs[key] else float("nan")  # noqa: E731
        lines.append(
            f"lowmem_hf / transformers: time {ratio('seconds'):.2f}x (medians of {rounds}, alternating; lowmem_hf "
            f"faster in {_wins(ours['runs_seconds'], theirs['runs_seconds'])} of {rounds}), RssAnon "
            f"{ratio('peak_rss_anon_bytes'):.2f}x, VmHWM {ratio('peak_vm_hwm_bytes'):.2f}x (rchar does not count "
            "transformers' mmap page-ins)"
        )
    if bare and bare["seconds"]:
        multiples = ", ".join(
            f"{name} {by[loader]['seconds'] / bare['seconds']:.2f}x" for loader, name in (("lowmem", "lowmem_hf"), ("transformers", "transformers"))
            if loader in by
        )
        lines.append(
            f"against bare (every tensor read and converted into fresh memory, nothing else: {bare['seconds']:.2f} s): {multiples}"
        )
    return lines


def print_loads(runs: list[dict], *, tag: str, downloaded: int, warmed: bool, initially: float | None) -> None:
    """The human-readable lines of ``lowmem-hf load``: one per loader, then the comparison's ratios."""
    if downloaded:
        print(f"{tag}downloaded {downloaded} weight file(s) into the HF cache before timing, so both loads read them from there")
    if warmed:
        print(f"{tag}the weight files were {initially:.0%} in the page cache: read once before timing, so both loads start warm")
    for r in runs:
        throughput = (r["rchar"] / _MIB) / r["seconds"] if r["seconds"] else 0.0
        read = f"{r['bytes_read'] / _MIB:.1f} MiB read" if r["bytes_read"] is not None else "bytes read: n/a"
        cache = f", page cache {r['page_cache_fraction']:.0%}" if r["page_cache_fraction"] is not None else ""
        each = f" (runs {', '.join(f'{t:.2f}' for t in r['runs_seconds'])})" if len(r["runs_seconds"]) > 1 else ""
        print(
            f"{tag}{r['loader']:>12}: {r['seconds']:.2f} s{each}{cache}, {read}, rchar {r['rchar'] / _MIB:.1f} MiB "
            f"({throughput:.0f} MiB/s), model {r['model_bytes'] / _MIB:.1f} MiB, peak above baseline RssAnon "
            f"{r['peak_rss_anon_bytes'] / _MIB:.1f} MiB / VmHWM {r['peak_vm_hwm_bytes'] / _MIB:.1f} MiB"
        )
        if r["loader"] != "bare":
            print(f"{tag}{'':>12}  missing {r['missing_keys'] or 'none'}, unexpected {r['unexpected_keys'] or 'none'}")
    for line in comparison_lines(runs):
        print(f"{tag}{line}")
    if len(runs) >= 2:
        caches = [r["page_cache_fraction"] for r in runs[:2]]
        if None not in caches and abs(caches[0] - caches[1]) > 0.1:
            print(
                f"{tag}not like for like: the weight files were {caches[0]:.0%} / {caches[1]:.0%} in the page cache "
                "when each load began, so the time ratio compares loads from different cache states"
                + (" (not read into memory before timing: too large)" if not warmed and initially < 0.99 else "")
            )
