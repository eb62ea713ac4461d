"""``lowmem-hf``: plan a load, measure one against transformers, or run an unchanged script with the switch on.

    lowmem-hf plan MODEL [--tp-size N] [--fsdp-size F] [--json] ...   what every rank will read, download and hold; no tensor read
    lowmem-hf load MODEL [--compare-transformers] [--plot FILE] ...   a measured load in a fresh process (also under torchrun)
    lowmem-hf run SCRIPT [ARGS...]                       every from_pretrained of SCRIPT through lowmem_hf
    lowmem-hf demo [--workdir DIR]                       build a small sharded Llama offline, load it, print the report

MODEL is a local folder or a Hub repo id. Common options: --auto-class C (default AutoModelForCausalLM),
--dtype D, --dtype-policy declared|loaded, --revision R, --fetch files|ranges. Bad input is one line on stderr
and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Callable

from .errors import UsageError
from .settings import launcher_rank

__all__ = ["main", "format_report", "UsageError", "COMMANDS"]

_MIB = 1024 * 1024


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own prints usage over several lines and exits
        command = self.prog.removeprefix("lowmem-hf").strip()
        raise UsageError(f"{command}: {message}" if command else message)


def format_report(report) -> str:
    """A human-readable summary of a ``LoadReport``."""
    rules: dict[str, int] = {}
    for decision in report.dtype_decisions.values():
        key = f"{str(decision.dtype).removeprefix('torch.')} ({decision.rule})"
        rules[key] = rules.get(key, 0) + 1
    lines = [
        f"format          {report.checkpoint_format}, {len(report.files_read)} file(s) read",
        f"bytes read      {report.bytes_read / _MIB:.1f} MiB (headers {report.header_bytes / 1024:.1f} KiB)",
        f"model bytes     {report.model_bytes / _MIB:.1f} MiB",
        f"staging         {report.staging_bytes / _MIB:.1f} MiB at most",
        f"dtype           {report.dtype} (policy {report.dtype_policy!r})",
        "decisions       " + ", ".join(f"{n} x {k}" for k, n in sorted(rules.items())),
        f"missing         {sorted(report.missing_keys) or 'none'}",
        f"unexpected      {sorted(report.unexpected_keys) or 'none'}",
        f"mismatched      {sorted(report.mismatched_keys) or 'none'}",
        f"wall            {report.wall_seconds:.3f} s ("
        + ", ".join(f"{stage} {seconds:.3f}" for stage, seconds in report.stage_seconds.items()) + ")",
        f"peak RssAnon    {report.peak_rss_anon_bytes / _MIB:.1f} MiB (whole process)",
        f"VmHWM           {report.peak_vm_hwm_bytes / _MIB:.1f} MiB (whole process)",
    ]
    lines += [f"note            {n}" for n in report.notes]
    return "\n".join(lines)


# ---- shared options and the request they make -----------------------------------------------------------


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", help="a local folder, a Hub repo id, or an object-store URL (s3://bucket/prefix: credentials and "
        "endpoint from the environment, AWS_ENDPOINT_URL included)",
    )
    p.add_argument("--auto-class", default="AutoModelForCausalLM")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--dtype-policy", default="declared", choices=["declared", "loaded"])
    p.add_argument("--revision")
    p.add_argument("--fetch", default="files", choices=["files", "ranges"])
    p.add_argument("--json", action="store_true", help="print one JSON document")


def _auto_class(name: str):
    import lowmem_hf

    cls = lowmem_hf.AUTO_CLASSES.get("LowMem" + name)
    if cls is None:
        raise UsageError(f"unknown --auto-class {name!r}; choose one of: {', '.join(sorted(c[6:] for c in lowmem_hf.AUTO_CLASSES))}")
    return cls._auto_class


def _prepare(args, *, tp_rank: int, mesh_rank: int | None = None):
    """``prepare`` one rank's load without a process group (``mesh_rank``: of the FSDP/HSDP mesh ``args`` describe);
    bad input becomes a UsageError."""
    from .errors import LowMemError
    from .load import prepare
    from .request import make_request

    if args.tp_size < 1:
        raise UsageError(f"--tp-size must be at least 1, got {args.tp_size}")
    tp = {"tp_plan": "auto", "tp_rank": tp_rank, "tp_size": args.tp_size} if args.tp_size > 1 else {}
    if mesh_rank is not None:
        from .distributed.mesh_rank import MeshRank

        tp = {"device_mesh": MeshRank(rank=mesh_rank, tp_size=args.tp_size, fsdp_size=args.fsdp_size,
                                      dp_replicate_size=args.dp_replicate_size)}
    try:
        return prepare(make_request(
            _auto_class(args.auto_class), args.model, torch_dtype=args.dtype, dtype_policy=args.dtype_policy,
            revision=args.revision, fetch=args.fetch, **tp,
        ))
    except (LowMemError, OSError, ValueError, TypeError, NotImplementedError) as error:
        raise UsageError(" ".join(str(error).split())) from None


# ---- plan ----------------------------------------------------------------------------------------------


def _plan_parser(p: argparse.ArgumentParser) -> None:
    _model_options(p)
    p.add_argument("--fsdp-size", type=int, default=1, help="plan the ranks of a TP x FSDP2 mesh (no group needed)")
    p.add_argument("--dp-replicate-size", type=int, default=1, help="HSDP replicas of that mesh")
    p.add_argument("--rank", type=int, help="plan only this rank of the mesh")


def _plan(args) -> int:
    for name in ("fsdp_size", "dp_replicate_size"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    mesh = args.fsdp_size * args.dp_replicate_size > 1
    world = args.tp_size * args.fsdp_size * args.dp_replicate_size
    if args.rank is not None and not 0 <= args.rank < world:
        raise UsageError(f"--rank {args.rank} is not a rank of a world of {world}; ranks are 0..{world - 1}")
    ranks = range(world) if args.rank is None else [args.rank]
    estimates = [
        _prepare(args, tp_rank=r % args.tp_size, mesh_rank=r if mesh else None).estimate() for r in ranks
    ]
    sizes = {"tp_size": args.tp_size, "fsdp_size": args.fsdp_size, "dp_replicate_size": args.dp_replicate_size}
    if args.json:
        print(json.dumps({"model": args.model, **sizes, "ranks": [e.to_json() for e in estimates]}, indent=2))
        return 0
    print(f"plan for {args.model} ({', '.join(f'{k} {v}' for k, v in sizes.items())}); no tensor was read")
    for e in estimates:
        print(
            f"rank {e.rank}: {len(e.files)} file(s), read {e.bytes_to_read / _MIB:.1f} MiB, download "
            f"{e.bytes_to_download / _MIB:.1f} MiB, final {e.final_bytes / _MIB:.1f} MiB, predicted peak "
            f"{e.predicted_peak_bytes / _MIB:.1f} MiB above baseline"
        )
        print("        dtypes: " + "; ".join(e.dtype_summary))
    return 0


# ---- load ----------------------------------------------------------------------------------------------


def _load_parser(p: argparse.ArgumentParser) -> None:
    _model_options(p)
    p.add_argument(
        "--compare-transformers", action="store_true",
        help="also load with transformers' from_pretrained and with bare (read + convert, no model), measured the same way",
    )
    p.add_argument(
        "--repeats", type=int, default=None,
        help="rounds of loads, the loaders alternating in order between rounds; medians are printed (default: 3 with "
        "--compare-transformers, else 1)",
    )
    p.add_argument("--plot", metavar="FILE", help="draw host memory over the time of each load into a PNG (needs lowmem_hf[plot])")


def _check_plot(args) -> None:
    """``--plot`` needs matplotlib: say so before any load, rather than after minutes of one."""
    if args.plot is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise UsageError(f"--plot needs matplotlib ({error}): pip install 'lowmem_hf[plot]'") from None


def _measured(args, loader: str, files: list[str]) -> dict:
    """One load in a fresh child process, memory sampled from here (see ``lowmem_hf.measured_load``)."""
    from .measured_load import run_child

    argv = [
        sys.executable, "-m", "lowmem_hf.measured_load", args.model, "--loader", loader, "--auto-class", args.auto_class,
        "--dtype", args.dtype, "--dtype-policy", args.dtype_policy, "--fetch", args.fetch, "--tp-size", str(args.tp_size),
    ] + (["--revision", args.revision] if args.revision else []) + (["--files", *files] if loader == "bare" else [])
    with tempfile.TemporaryFile("w+") as stderr:
        result = run_child(argv, stderr=stderr, keep_series=args.plot is not None)
        if not result["ok"]:
            stderr.seek(0)
            tail = stderr.read().strip().splitlines()[-1:] or [result["error"]]
            raise UsageError(f"the {loader} load failed: {tail[0]}")
    child = result["result"]
    return {
        "loader": loader,
        "seconds": child["seconds"],
        "bytes_read": child["bytes_read"],
        "rchar": child["rchar"],
        "model_bytes": child["model_bytes"],
        "peak_rss_anon_bytes": result["peak_rss_anon_above_baseline_kb"] * 1024,
        "peak_vm_hwm_bytes": result["vmhwm_above_baseline_kb"] * 1024,
        "peak_rss_file_bytes": result["peak_rss_file_above_baseline_kb"] * 1024,
        "missing_keys": child["missing_keys"],
        "unexpected_keys": child["unexpected_keys"],
        **({"series": [[t, anon * 1024, hwm * 1024] for t, anon, hwm in result["series"]]} if args.plot else {}),
    }


def _local_weight_files(prepared, *, download: bool) -> tuple[list[str], int]:
    """The weight files this load reads from this machine's disk: a local folder's, or a Hub repo's in the HF cache;
    with ``download``, a Hub repo's missing ones are downloaded first (at the load's commit). Also returns how many
    were downloaded."""
    checkpoint = prepared.checkpoint
    if not checkpoint.repo_id:
        return [f for f in checkpoint.files if os.path.isfile(f)], 0
    paths, fetched = dict(checkpoint.local_paths), 0
    if download:
        from huggingface_hub import hf_hub_download

        for name in checkpoint.files:
            if name not in paths:
                try:
                    paths[name] = hf_hub_download(checkpoint.repo_id, name, revision=checkpoint.commit)
                except OSError as error:  # huggingface_hub's HTTP, offline and not-found errors are OSErrors
                    raise UsageError(
                        f"downloading {name} of {checkpoint.repo_id} at {checkpoint.commit} before the comparison "
                        f"failed: {' '.join(str(error).split())}"
                    ) from None
                fetched += 1
    return [paths[f] for f in checkpoint.files if f in paths and os.path.isfile(paths[f])], fetched


def _warm_page_cache(files: list[str]) -> bool:
    """Read ``files`` once, untimed, so that both loaders of a comparison find them in the page cache; False (and
    nothing read) when they would not fit in the memory available, where reading them would not keep them cached."""
    total = sum(os.path.getsize(f) for f in files)
    try:
        with open("/proc/meminfo") as meminfo:
            available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return False
    if total > available // 2:
        return False
    buf = bytearray(8 * _MIB)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return True


def _plot(args, runs: list[dict], rank: int) -> str:
    """Draw the loads' series into ``--plot`` (under torchrun, each rank into its own file); returns the path."""
    from .measured_load import draw_memory_over_time

    path = args.plot
    if launcher_rank() is not None:
        root, ext = os.path.splitext(path)
        path = f"{root}.rank{rank}{ext}"
    title = f"{os.path.basename(os.path.normpath(args.model))}, --dtype {args.dtype}: host memory during one load"
    draw_memory_over_time(runs, path, title=title)
    return path


def _refuse_store_comparison(args) -> None:
    """``--compare-transformers`` of an object-store URL (``resolve_store.is_store_url``): transformers cannot load it."""
    if args.compare_transformers and "://" in args.model and not args.model.startswith("file://"):
        raise UsageError(
            f"--compare-transformers: transformers cannot load {args.model} (an object-store URL); copy the checkpoint "
            "to a local folder and compare there, or run benchmarks/bench_s3.py"
        )


def _load(args) -> int:
    _check_plot(args)
    if args.tp_size > 1 and launcher_rank() is None:
        raise UsageError(f"--tp-size {args.tp_size} loads one rank per process: run under torchrun --nproc-per-node {args.tp_size}")
    repeats = args.repeats if args.repeats is not None else (3 if args.compare_transformers else 1)
    if repeats < 1:
        raise UsageError(f"--repeats must be at least 1, got {repeats}")
    rank = launcher_rank() or 0
    _refuse_store_comparison(args)
    prepared = _prepare(args, tp_rank=rank % args.tp_size)  # bad input fails here, in one line, before any child runs
    from .comparison import print_loads, round_order, summarize
    from .measured_load import bare_files_supported
    from .sources.local import cached_fraction

    # A comparison is only worth its ratio if both loads start from the same state: a Hub repo's files downloaded
    # by the first load would be found in the HF cache by the second, and the first load of files not in the page
    # cache would warm them for the second (measured: 2.70x instead of 1.04x on a 2 GB checkpoint).
    compare_files = args.compare_transformers and args.fetch == "files"  # fetch="ranges" downloads no file
    files, downloaded = _local_weight_files(prepared, download=compare_files)
    initially = cached_fraction(files) if files else None
    warmed = args.compare_transformers and initially is not None and initially < 0.99 and _warm_page_cache(files)
    loaders = ["lowmem"]
    if args.compare_transformers:
        # bare reads the weight files directly: one process, local files, the formats it knows
        loaders += ["transformers"] + (["bare"] if args.tp_size == 1 and bare_files_supported(files) else [])
    runs = []
    for round_index in range(repeats):
        for loader in round_order(loaders, round_index):
            fraction = cached_fraction(files) if files else None
            runs.append({**_measured(args, loader, files), "page_cache_fraction": fraction, "round": round_index})
    plotted = _plot(args, [r for r in runs if r["round"] == 0 and r["loader"] != "bare"], rank) if args.plot else None
    runs = summarize(runs)
    if args.json:
        print(json.dumps({
            "model": args.model, "rank": rank, "downloaded_files": downloaded, "page_cache_fraction": initially,
            "warmed_page_cache": warmed, "loads": runs, **({"plot": plotted} if plotted else {}),
        }, indent=2))
        return 0
    tag = f"[rank {rank}] " if launcher_rank() is not None else ""
    print_loads(runs, tag=tag, downloaded=downloaded, warmed=warmed, initially=initially)
    if plotted:
        print(f"{tag}memory over time drawn into {plotted}")
    return 0


# ---- run and demo --------------------------------------------------------------------------------------


def _run_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)


def _run(args) -> int:
    if not os.path.isfile(args.script):
        raise UsageError(f"lowmem-hf run: script {args.script!r} does not exist")
    from .runner import run_script

    run_script(args.script, args.args)
    return 0


def _demo_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "lowmem-hf-demo"))
    p.add_argument("--dtype", default="bfloat16")


def _build_demo_checkpoint(folder: str) -> str:
    """A small random Llama (about 30 MB in fp32), saved sharded: the bundled offline default."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.isfile(os.path.join(folder, "model.safetensors.index.json")):
        return folder
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="10MB")
    return folder


def _demo(args) -> int:
    from . import LowMemAutoModelForCausalLM

    path = _build_demo_checkpoint(args.workdir)
    model, report = LowMemAutoModelForCausalLM.from_pretrained(path, torch_dtype=args.dtype, output_loading_info=True)
    print(f"loaded {type(model).__name__} from {path}")
    print(format_report(report))
    return 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "plan": ("what each rank will read, download and hold; reads no tensor", _plan_parser, _plan),
    "load": ("a measured load in a fresh process, optionally against transformers", _load_parser, _load),
    "run": ("run an unchanged script with every from_pretrained through lowmem_hf", _run_parser, _run),
    "demo": ("build a small sharded Llama offline and load it", _demo_parser, _demo),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _Parser(prog="lowmem-hf", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (help_text, build, _) in COMMANDS.items():
        build(sub.add_parser(name, help=help_text))
    try:
        if argv[:1] == ["run"] and len(argv) > 1 and not argv[1].startswith("-"):
            # everything after SCRIPT is the script's, even options lowmem-hf also knows
            args = argparse.Namespace(command="run", script=argv[1], args=argv[2:])
        else:
            args = parser.parse_args(argv)
        return COMMANDS[args.command][2](args)
    except UsageError as error:
        print(f"lowmem-hf: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
