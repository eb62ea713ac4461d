"""Time to a usable model at the tensor widths real models have, lowmem_hf against transformers and ``bare``.

    python benchmarks/bench_shapes.py [--shapes 1024 llama2-7b llama3-8b llama3-70b] [--cases fp32_to_bf16 bf16_to_bf16]
        [--formats safetensors bin] [--cache warm cold] [--ranks 1 2] [--repeats 3] [--workdir DIR] [--against REV]

``bench_usable.py`` measures one shape, hidden 1024 (16 MB tensors); a 7B model's tensors are 45-180 MB and a 70B
model's up to 940 MB (fp32), and where the time goes depends on that size. Each shape here is a Llama with a real
model's widths and a few layers (vocab 32000), generated once into the workdir:

    1024        hidden 1024, intermediate 4096 (bench_usable's 2 GB checkpoint)
    llama2-7b   hidden 4096, intermediate 11008, 32 heads, 2 layers (2.7 GB fp32)
    llama3-8b   hidden 4096, intermediate 14336, 32 heads / 8 KV heads, 2 layers (2.8 GB fp32)
    llama3-70b  hidden 8192, intermediate 28672, 64 heads / 8 KV heads, 1 layer (5.5 GB fp32)

Cases: ``fp32_to_bf16`` (an fp32 checkpoint loaded as bf16: every byte converted) and ``bf16_to_bf16`` (a bf16
checkpoint loaded as stored); formats: sharded safetensors and its ``.bin`` twin. Every load runs in a fresh child
(``_usable_child.py``, as bench_usable runs it: the model's module imported before the clock), the loaders
alternating within each repeat; ``bare`` (one process) is every tensor read and converted with no model, the
floor both loaders are read against. Printed per row: medians of lowmem_hf's and transformers' return times,
their ratio, the repeats lowmem_hf won, each loader as a multiple of bare, both loaders' time to the end of a first
in-place write of every parameter (where transformers' parameters are views of the files it mapped, as for a
checkpoint loaded in its stored dtype, its return is early and the write pays the reads; there lowmem_hf with
``mmap=True``, which returns such views too, is timed beside it), and lowmem_hf's peak
RssAnon and VmHWM above the post-import baseline per final model byte. ``--against REV`` adds lowmem_hf as of a
git revision, timed in the same rounds, to measure a change against what it replaces. Exit status 1 only if a child
failed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_usable import extract_revision, run  # noqa: E402
from checkpoints import drop_page_cache, llama_dims, make_bin_twin, make_llama_checkpoint, prewarm_page_cache  # noqa: E402
from measure import boost_sampler_priority  # noqa: E402

SHAPES = {
    "1024": None,  # llama_dims(2.0): bench_usable's checkpoint
    "llama2-7b": dict(hidden=4096, inter=11008, layers=2, heads=32, kv_heads=32, vocab=32000),
    "llama3-8b": dict(hidden=4096, inter=14336, layers=2, heads=32, kv_heads=8, vocab=32000),
    "llama3-70b": dict(hidden=8192, inter=28672, layers=1, heads=64, kv_heads=8, vocab=32000),
}
# case -> (stored dtype, loaded dtype)
CASES = {"fp32_to_bf16": (torch.float32, "bfloat16"), "bf16_to_bf16": (torch.bfloat16, "bfloat16")}


def checkpoint(workdir: Path, shape: str, stored: torch.dtype, fmt: str) -> Path:
    """The shape's checkpoint in ``stored`` dtype and format ``fmt``, generated on first use."""
    dims = SHAPES[shape]
    st = make_llama_checkpoint(workdir, 2.0, stored, dims=dims or llama_dims(2.0), name=f"shape-{shape}")
    return st if fmt == "safetensors" else make_bin_twin(st, workdir / (st.name + "-bin"))


def measure(path: Path, dtype: str, ranks: int, cache: str, repeats: int, logdir: Path, tag: str,
            against: str | None = None, views: bool = False) -> dict[str, list[dict]]:
    """Every loader's runs on one checkpoint, alternating within each repeat (in reverse order every other repeat,
    so no loader always runs first); per run, the job's slowest rank. With ``views`` (a safetensors checkpoint
    loaded in its stored dtype, one process) also lowmem_hf with ``mmap=True``, which returns views of the files as
    transformers does (it refuses dim-1 TP slices and ``.bin``)."""
    loaders = (("lowmem", "transformers") + (("lowmem-mmap",) if views else ())
               + ((f"lowmem@{against}",) if against else ()) + (("bare",) if ranks == 1 else ()))
    runs: dict[str, list[dict]] = {loader: [] for loader in loaders}
    for rep in range(repeats):
        for loader in loaders if rep % 2 == 0 else loaders[::-1]:
            drop_page_cache() if cache == "cold" else prewarm_page_cache(path)
            got = run(loader, path, dtype, ranks, logdir, f"{tag}-{rep}")
            slowest = max(got, key=lambda r: r["load_seconds"])
            slowest.update(rss_anon=max(r["rss_anon"] for r in got), vmhwm=max(r["vmhwm"] for r in got))
            runs[loader].append(slowest)
            print(f"  [{tag} {loader:<20} #{rep}] return {slowest['load_seconds']:.2f}s  RssAnon {slowest['rss_anon']:.3f}x  "
                  f"VmHWM {slowest['vmhwm']:.3f}x", flush=True)
    return runs


def row(runs: dict[str, list[dict]]) -> str:
    """One table row's measured cells: medians, ratios, wins, multiples of bare, the first write, lowmem_hf's memory."""
    med = {loader: statistics.median(r["load_seconds"] for r in rs) for loader, rs in runs.items()}
    write = {loader: statistics.median(r["write_seconds"] for r in rs) for loader, rs in runs.items() if loader != "bare"}
    won = sum(a["load_seconds"] <= b["load_seconds"] for a, b in zip(runs["lowmem"], runs["transformers"]))
    bare = med.get("bare")
    floors = f"{med['lowmem'] / bare:.2f}x | {med['transformers'] / bare:.2f}x" if bare else "- | -"
    previous = next((loader for loader in runs if loader.startswith("lowmem@")), None)
    if previous:  # the change measured against what it replaces, in the same run
        won_previous = sum(a["load_seconds"] < b["load_seconds"] for a, b in zip(runs["lowmem"], runs[previous]))
        floors += f" | {med['lowmem'] / med[previous]:.2f}x ({won_previous}/{len(runs['lowmem'])})"
    views = (f"{med['lowmem-mmap']:.2f} s = {med['lowmem-mmap'] / med['transformers']:.2f}x"
             if "lowmem-mmap" in runs else "-")
    rss = statistics.median(r["rss_anon"] for r in runs["lowmem"])
    hwm = statistics.median(r["vmhwm"] for r in runs["lowmem"])
    tf_rss = statistics.median(r["rss_anon"] for r in runs["transformers"])
    return (f"{med['lowmem']:.2f} s | {med['transformers']:.2f} s | **{med['lowmem'] / med['transformers']:.2f}x** | "
            f"{won}/{len(runs['lowmem'])} | {views} | {floors} | {write['lowmem']:.2f} s / {write['transformers']:.2f} s = "
            f"{write['lowmem'] / write['transformers']:.2f}x | {rss:.3f}x ({rss / tf_rss:.2f}x tf) | {hwm:.3f}x")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--formats", nargs="+", choices=("safetensors", "bin"), default=["safetensors", "bin"])
    ap.add_argument("--cache", nargs="+", choices=("warm", "cold"), default=["warm", "cold"])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default=str(HERE / "_work"))
    ap.add_argument("--against", metavar="REV", help="also time lowmem_hf as of this git revision (lowmem@REV)")
    args = ap.parse_args(argv)

    workdir = Path(args.workdir).resolve()
    logdir = workdir / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    caches = list(args.cache)
    if "cold" in caches and not drop_page_cache():
        print("[shapes] cannot drop the page cache here (needs root): cold rows skipped", flush=True)
        caches.remove("cold")
    print(f"[shapes] sampler {boost_sampler_priority()}", flush=True)
    against = extract_revision(args.against, workdir) if args.against else None

    table = []
    for shape in args.shapes:
        for case in args.cases:
            stored, dtype = CASES[case]
            for fmt in args.formats:
                path = checkpoint(workdir, shape, stored, fmt)
                for cache in caches:
                    for ranks in args.ranks:
                        tag = f"{shape} {case} {fmt} {cache} {ranks}r"
                        runs = measure(path, dtype, ranks, cache, args.repeats, logdir, tag.replace(" ", "-"), against,
                                       views=(fmt == "safetensors" and ranks == 1
                                              and str(stored).removeprefix("torch.") == dtype))
                        table.append(f"| {shape} | {case} | {fmt} | {cache} | {ranks} | {row(runs)} |")

    print(f"\nmedians of {args.repeats}, loaders alternating; ratio = lowmem_hf / transformers; won = repeats lowmem_hf "
          "returned no later; mmap=True = lowmem_hf returning views of the files, as transformers does in the stored dtype; x bare = return time / bare's (one process); first write = from the start of the load to the "
          "end of a first in-place write of every parameter; memory = lowmem_hf's peak above the "
          "post-import baseline per model byte (RssAnon also against transformers')")
    print("| shape | case | format | cache | ranks | lowmem_hf | transformers | ratio | won | mmap=True / transformers | lowmem_hf x bare | "
          "transformers x bare | " + (f"lowmem_hf x lowmem@{against} (won) | " if against else "")
          + "first write, lowmem_hf / transformers | RssAnon | VmHWM |")
    print("| --- " * (16 if against else 15) + "|")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
