"""One rank of a cooperative Hub fetch test (tests/test_exchange.py), as a real process.

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python exchange_rank.py --hub URL --home DIR --repo ID
        --local DIR --out DIR --span BYTES [--kill-after SECONDS]

Loads the repo from the hub with ``tp_plan="auto", fetch="ranges"`` into its own HF cache (one "node" per rank),
checks every local shard against a load of the same folder from disk at the same tp_size, and writes what it saw
to ``OUT/rank<r>.json``. ``--kill-after`` makes the process die abruptly (``os._exit``) that long into the load.
"""

import argparse
import json
import os
import sys
import threading

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hub_server import use_hub  # noqa: E402

import lowmem_hf  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--hub", "--home", "--repo", "--local", "--out"):
        p.add_argument(name, required=True)
    p.add_argument("--span", type=int, required=True)
    p.add_argument("--kill-after", type=float, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.kill_after is not None:
        threading.Timer(args.kill_after, os._exit, (17,)).start()
    load = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained
    with use_hub(args.hub, args.home):
        model, report = load(args.repo, tp_plan="auto", fetch="ranges", fetch_span_bytes=args.span, output_loading_info=True)
    reference = load(args.local, tp_plan="auto")

    def local(t):
        return t.data.to_local() if hasattr(t.data, "to_local") else t.data

    theirs = dict(reference.named_parameters())
    different = [n for n, t in model.named_parameters() if not torch.equal(local(t), local(theirs[n]))]
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"different": different, "requests": report.requests, "fetched": report.bytes_fetched,
                   "received": report.bytes_received, "read": report.bytes_read}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
