"""``lowmem-hf``: load a checkpoint and print what the load did.

    lowmem-hf demo [--workdir DIR]       build a small sharded Llama offline, load it, print the report
    lowmem-hf load PATH [--dtype bfloat16] [--auto-class AutoModelForCausalLM] [--dtype-policy declared]
    lowmem-hf run SCRIPT [ARGS...]       run an unchanged script with every from_pretrained through lowmem_hf
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

__all__ = ["main", "format_report"]


def format_report(report) -> str:
    """A human-readable summary of a ``LoadReport``."""
    rules: dict[str, int] = {}
    for decision in report.dtype_decisions.values():
        key = f"{str(decision.dtype).removeprefix('torch.')} ({decision.rule})"
        rules[key] = rules.get(key, 0) + 1
    mib = 1024 * 1024
    lines = [
        f"format          {report.checkpoint_format}, {len(report.files_read)} file(s) read",
        f"bytes read      {report.bytes_read / mib:.1f} MiB (headers {report.header_bytes / 1024:.1f} KiB)",
        f"model bytes     {report.model_bytes / mib:.1f} MiB",
        f"staging         {report.staging_bytes / mib:.1f} MiB at most",
        f"dtype           {report.dtype} (policy {report.dtype_policy!r})",
        "decisions       " + ", ".join(f"{n} x {k}" for k, n in sorted(rules.items())),
        f"missing         {sorted(report.missing_keys) or 'none'}",
        f"unexpected      {sorted(report.unexpected_keys) or 'none'}",
        f"mismatched      {sorted(report.mismatched_keys) or 'none'}",
        f"wall            {report.wall_seconds:.3f} s",
        f"peak RssAnon    {report.peak_rss_anon_bytes / mib:.1f} MiB (whole process)",
        f"VmHWM           {report.peak_vm_hwm_bytes / mib:.1f} MiB (whole process)",
    ]
    lines += [f"note            {n}" for n in report.notes]
    return "\n".join(lines)


def _build_demo_checkpoint(folder: str) -> str:
    """A small random Llama (about 30 MB in fp32), saved sharded: the bundled offline default."""
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


def _load(path: str, auto_class: str, dtype: str, policy: str) -> int:
    import lowmem_hf

    cls = lowmem_hf.AUTO_CLASSES.get("LowMem" + auto_class)
    if cls is None:
        print(f"unknown auto class {auto_class!r}; choose one of: {', '.join(sorted(c[6:] for c in lowmem_hf.AUTO_CLASSES))}", file=sys.stderr)
        return 2
    model, report = cls.from_pretrained(path, torch_dtype=dtype, dtype_policy=policy, output_loading_info=True)
    print(f"loaded {type(model).__name__} from {path}")
    print(format_report(report))
    return 0


def _run(argv: list[str]) -> int:
    """``run SCRIPT [ARGS...]``: everything after SCRIPT belongs to the script, so argparse never sees it."""
    if not argv or argv[0].startswith("-"):
        print("lowmem-hf run: usage: lowmem-hf run SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    if not os.path.isfile(argv[0]):
        print(f"lowmem-hf run: error: script {argv[0]!r} does not exist", file=sys.stderr)
        return 2
    from .runner import run_script

    run_script(argv[0], argv[1:])
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        return _run(argv[1:])
    parser = argparse.ArgumentParser(prog="lowmem-hf", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="build a small sharded Llama offline and load it")
    demo.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "lowmem-hf-demo"))
    demo.add_argument("--dtype", default="bfloat16")
    load = sub.add_parser("load", help="load a local checkpoint folder and print the report")
    load.add_argument("path")
    load.add_argument("--auto-class", default="AutoModelForCausalLM")
    load.add_argument("--dtype", default="auto")
    load.add_argument("--dtype-policy", default="declared", choices=["declared", "loaded"])
    sub.add_parser("run", help="run an unchanged script with the switch on: lowmem-hf run SCRIPT [ARGS...]")
    args = parser.parse_args(argv)
    if args.command == "demo":
        path = _build_demo_checkpoint(args.workdir)
        return _load(path, "AutoModelForCausalLM", args.dtype, "declared")
    return _load(args.path, args.auto_class, args.dtype, args.dtype_policy)


if __name__ == "__main__":
    sys.exit(main())
