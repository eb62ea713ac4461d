"""One rank of bench_coop.py: load org/coop from the loopback Hub with fetch="ranges" under a gloo group, counting
every process-group store operation and every collective and point-to-point call the load makes.

    RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. HF_ENDPOINT=.. python benchmarks/_coop_child.py
"""

from __future__ import annotations

import collections
import json
import sys
import time

COUNTS: collections.Counter = collections.Counter()
COLLECTIVES = ("all_gather_object", "broadcast_object_list", "all_gather", "all_reduce", "broadcast", "barrier",
               "isend", "irecv", "send", "recv", "new_group", "all_to_all", "scatter_object_list")


class CountingStore:
    """The group's store, counting each call by method (the cooperative fetch's status rounds go through it)."""

    def __init__(self, store):
        self._store = store

    def __getattr__(self, name):
        method = getattr(self._store, name)

        def counted(*args, **kwargs):
            COUNTS[f"store.{name}"] += 1
            return method(*args, **kwargs)

        return counted


def instrument() -> None:
    import torch.distributed as dist

    import lowmem_hf.sources.wave_status as wave_status

    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            COUNTS[f"dist.{_name}"] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    default_store = wave_status.default_store
    wave_status.default_store = lambda: CountingStore(default_store())


def main() -> int:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    import lowmem_hf

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    MODEL_FOR_CAUSAL_LM_MAPPING[LlamaConfig]
    LowMem = lowmem_hf.LowMemAutoModelForCausalLM
    instrument()
    dist.barrier()
    start = time.perf_counter()
    _, report = LowMem.from_pretrained("org/coop", torch_dtype=torch.bfloat16, fetch="ranges", tp_plan="auto",
                                       output_loading_info=True)
    seconds = time.perf_counter() - start
    print("@@RESULT " + json.dumps({"seconds": seconds, "rank": dist.get_rank(), "bytes_received": report.bytes_received,
                                    "bytes_read": report.bytes_read, "counts": dict(COUNTS)}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
