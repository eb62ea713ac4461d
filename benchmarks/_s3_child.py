"""One process of bench_s3.py: load the checkpoint from the S3 server (credentials and AWS_ENDPOINT_URL in the env)
as bf16, following measure.py's protocol (the parent samples this process's memory).

    python benchmarks/_s3_child.py --loader {lowmem,boto3} --url s3://bucket/prefix [--tp] [--download-dir DIR]
        [--package-dir DIR]  # lowmem from DIR/lowmem_rev (another revision: bench_s3.py --against)

``lowmem``: ``from_pretrained("s3://...")``; ``boto3``: the usual recipe, every rank downloads every object with
boto3's transfer manager, then transformers loads the local copy.

Before READY (the baseline): torch, transformers, lowmem_hf, the model's module, the process group, and the
loader's S3 library (s3fs for lowmem_hf, boto3 for the recipe) are imported, as every benchmark imports the
model's module before the clock. Making the client, listing and reading are inside the clock for both.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

from _child import say, wait_for_parent


def _download(url: str, folder: str) -> None:
    import boto3
    from boto3.s3.transfer import TransferConfig

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = boto3.client("s3")  # AWS_ENDPOINT_URL and the credentials from the environment
    config = TransferConfig(max_concurrency=10, multipart_chunksize=8 * 1024 * 1024)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for item in page.get("Contents", []):
            path = os.path.join(folder, item["Key"][len(prefix) + 1 :])
            os.makedirs(os.path.dirname(path), exist_ok=True)
            client.download_file(bucket, item["Key"], path, Config=config)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loader", choices=["lowmem", "boto3"], required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--tp", action="store_true")
    parser.add_argument("--download-dir")
    parser.add_argument("--chunk-bytes", type=int, default=None, help="lowmem_hf's chunk_bytes (default: its own)")
    parser.add_argument("--package-dir", help="load with the lowmem_hf copy at DIR/lowmem_rev instead of the installed one")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    import transformers
    from transformers import LlamaConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if args.package_dir:
        sys.path.insert(0, args.package_dir)
        lowmem_hf = importlib.import_module("lowmem_rev")
    else:
        import lowmem_hf

    torch.set_num_threads(1)
    if args.tp:
        dist.init_process_group("gloo")
    MODEL_FOR_CAUSAL_LM_MAPPING[LlamaConfig]  # the model's module before the clock, for both loaders
    Auto, LowMem = transformers.AutoModelForCausalLM, lowmem_hf.LowMemAutoModelForCausalLM
    if args.loader == "lowmem":
        import s3fs  # noqa: F401
    else:
        import boto3.s3.transfer  # noqa: F401
    tp = {"tp_plan": "auto"} if args.tp else {}
    say("READY")
    wait_for_parent("go")
    start, cpu = time.perf_counter(), os.times()
    counts = {}
    if args.loader == "lowmem":
        chunk = {"chunk_bytes": args.chunk_bytes} if args.chunk_bytes else {}
        model, report = LowMem.from_pretrained(args.url, torch_dtype=torch.bfloat16, output_loading_info=True, **tp, **chunk)
        counts = {"bytes_received": report.bytes_received, "bytes_read": report.bytes_read, "bytes_fetched": report.bytes_fetched,
                  "stage_seconds": report.stage_seconds}
    else:
        _download(args.url, args.download_dir)
        downloaded = time.perf_counter()
        model = Auto.from_pretrained(args.download_dir, dtype=torch.bfloat16, **tp)
        counts = {"stage_seconds": {"download": downloaded - start, "load": time.perf_counter() - downloaded}}
    seconds, cpu = time.perf_counter() - start, [b - a for a, b in zip(cpu, os.times())]
    say("LOADED")
    wait_for_parent("go")
    assert not any(p.device.type == "meta" for p in model.parameters())
    local = sum((p.data.to_local() if hasattr(p.data, "to_local") else p.data).nbytes for p in model.parameters())
    say("RESULT " + json.dumps({"seconds": seconds, "rank": dist.get_rank() if args.tp else 0, "model_bytes": local,
                             "cpu_seconds": cpu[0] + cpu[1], **counts}))
    wait_for_parent("exit")
    if args.tp:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
