"""One rank of a cooperative Hub fetch test (tests/test_exchange.py), as a real process.

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python exchange_rank.py --hub URL --home DIR --repo ID
        --local DIR --out DIR --span BYTES [--kill-after SECONDS] [--wave BYTES]

Loads the repo from the hub with ``tp_plan="auto", fetch="ranges"`` into its own HF cache (one "node" per rank),
checks every local shard against a load of the same folder from disk at the same tp_size, and writes what it saw
to ``OUT/rank<r>.json``. ``--kill-after`` makes the process die abruptly (``os._exit``) that long after its first
wave of the exchange began (counted from there, not from start-up, so a loaded machine's slow imports or planning
cannot make it die before the exchange it is meant to break). ``--wave`` sets the wave size (default: the
library's), and the JSON says how many waves ran.
"""

import argparse
import json
import os
import sys
import threading
import time

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
    p.add_argument("--wave", type=int, default=None)
    p.add_argument("--dtype", default=None, help="load as this torch dtype (both loads), e.g. bfloat16")
    args = p.parse_args()
    from lowmem_hf.sources import exchange

    waves, run_wave = [], exchange._Waves._run_wave
    def counted(self, index):
        waves.append(index)
        return run_wave(self, index)

    exchange._Waves._run_wave = counted
    if args.wave is not None:
        exchange.default_wave_bytes = lambda span_bytes, world: args.wave
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.kill_after is not None:
        from lowmem_hf.sources.exchange import CooperativeRanges

        first_wave = CooperativeRanges.before_submodule
        def die():
            # when, for the test: the other ranks must notice within the store timeout of this moment
            with open(os.path.join(args.out, f"rank{rank}.killed_at"), "w") as f:
                f.write(repr(time.time()))
            os._exit(17)

        timer = threading.Timer(args.kill_after, die)

        def before_submodule(self, name):  # the fault: die once the exchange is under way
            if not timer.is_alive():
                timer.start()
            return first_wave(self, name)

        CooperativeRanges.before_submodule = before_submodule
    load = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained
    dtype = getattr(torch, args.dtype) if args.dtype else None
    with use_hub(args.hub, args.home):
        model, report = load(args.repo, tp_plan="auto", fetch="ranges", fetch_span_bytes=args.span, output_loading_info=True,
                             torch_dtype=dtype)
    reference = load(args.local, tp_plan="auto", torch_dtype=dtype)

    def local(t):
        return t.data.to_local() if hasattr(t.data, "to_local") else t.data

    theirs = dict(reference.named_parameters())
    different = [n for n, t in model.named_parameters() if not torch.equal(local(t), local(theirs[n]))]
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"different": different, "requests": report.requests, "fetched": report.bytes_fetched,
                   "received": report.bytes_received, "read": report.bytes_read, "waves": len(waves)}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
