"""Child of bench_usable.py: time one load to a usable model (measure.py protocol).

    python benchmarks/_usable_child.py --loader {lowmem,lowmem-mmap,transformers,bare} --path DIR --dtype bfloat16
        [--package-dir DIR]  # lowmem from DIR/lowmem_rev (another revision, see bench_usable.py --against)
    # under RANK/WORLD_SIZE/MASTER_*: joins a gloo group and loads with tp_plan="auto"

Measured, in this order, from one clock: ``from_pretrained`` returns; the first forward (one sequence of 4
tokens, no grad) returns; every parameter has been written in place once (``mul_(1)``, what a first
optimizer step does to memory: it faults in and, for copy-on-write views of a file, copies every page).
Memory is sampled by the parent over all three. The model's module (``modeling_llama``), each loader's entry
class and, under TP, the process group exist before the clock, for both loaders, and a tiny model of the same class
has run the forward and the write once (``first_forward``).

``bare`` (one process only) is the reference both loaders are read against: the work any load of the request
must do and nothing else, with no model. Every tensor of every file read and converted to ``--dtype`` into
fresh memory, the way transformers' own loop does it (``safe_open`` / ``torch.load(mmap=True)``, then a copy in
the target dtype per tensor on a pool of one thread per core); no config, no model, no key mapping, no forward.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from _child import say, wait_for_parent


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loader", choices=("lowmem", "lowmem-mmap", "transformers", "bare"), required=True)
    ap.add_argument("--path", required=True)
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--package-dir", help="load with the lowmem_hf copy at DIR/lowmem_rev instead of the installed one")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if args.package_dir:  # another revision's lowmem_hf, renamed: the editable install would win over sys.path
        import importlib

        sys.path.insert(0, args.package_dir)
        lowmem_hf = importlib.import_module("lowmem_rev")
    else:
        import lowmem_hf

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        torch.set_num_threads(1)  # the ranks share the cores
        dist.init_process_group("gloo")
    dtype = getattr(torch, args.dtype)
    config = AutoConfig.from_pretrained(args.path)
    MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # import modeling_llama before the clock, for both loaders
    # each loader's entry class resolved before the clock, as `from transformers import AutoModelForCausalLM` is:
    # lowmem_hf's package import is lazy and the first access of a class imports its stages (~0.06 s, once per
    # process; benchmarks/bench_import.py measures it)
    LowMem = lowmem_hf.LowMemAutoModelForCausalLM
    tp = {"tp_plan": "auto"} if distributed else {}
    ids = torch.arange(4).reshape(1, 4) % config.vocab_size
    (torch.ones(1024) * 2).sum().item()
    first_forward(config, dtype)

    def load():
        if args.loader == "transformers":
            return AutoModelForCausalLM.from_pretrained(args.path, dtype=dtype, **tp)
        mmap = {"mmap": True} if args.loader == "lowmem-mmap" else {}
        return LowMem.from_pretrained(args.path, torch_dtype=dtype, **tp, **mmap)

    if args.loader == "bare":
        return bare(args.path, dtype)

    say("READY")
    wait_for_parent("go")
    t0 = time.perf_counter()
    model = load()
    t_load = time.perf_counter()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    t_forward = time.perf_counter()
    with torch.no_grad():
        for p in model.parameters():
            (p.data.to_local() if hasattr(p.data, "to_local") else p.data).mul_(1)
    t_write = time.perf_counter()
    say("LOADED")
    wait_for_parent("go")

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    model_bytes = sum(local(p.data).numel() * p.element_size() for p in model.parameters())
    model_bytes += sum(b.numel() * b.element_size() for b in model.buffers())
    report = getattr(model, "lowmem_report", None)
    result = {
        "load_seconds": t_load - t0,
        "forward_seconds": t_forward - t0,
        "write_seconds": t_write - t0,
        "model_bytes": model_bytes,
        "logits_finite": bool(torch.isfinite(local(logits)).all()),
        "notes": list(report.notes) if report is not None else [],
        "mapped_bytes": getattr(report, "mapped_bytes", None),
    }
    say("RESULT " + json.dumps(result))
    wait_for_parent("exit")
    if distributed:
        dist.destroy_process_group()
    return 0


def first_forward(config, dtype) -> None:
    """Run the measured forward and write once on a tiny model of the same class, before the baseline, for both
    loaders: a process's first forward faults in ~10 MB of libtorch's code (file-backed pages, in VmHWM, not in
    RssAnon). Measured after the baseline, that is 1% of a 1 GB model and 2% of a 0.5 GB rank's shard, charged to
    whichever loader runs, while it is not the load's memory."""
    import torch
    from transformers import AutoModelForCausalLM

    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads  # None: as many as heads
    tiny = type(config).from_dict({
        **config.to_dict(), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "vocab_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 4 if kv_heads == config.num_attention_heads else 2,
        "head_dim": 16,
    })
    model = AutoModelForCausalLM.from_config(tiny, dtype=dtype)
    with torch.no_grad():
        model(input_ids=torch.arange(4).reshape(1, 4)).logits.sum().item()
        for p in model.parameters():
            p.data.mul_(1)
    del model


def bare(path: str, dtype) -> int:
    """Read and convert every tensor of the checkpoint at ``path`` (the ``bare`` reference), then report: the same
    work as ``lowmem-hf load --compare-transformers``' bare row."""
    import glob

    from lowmem_hf.measured_load import read_and_convert

    files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) or sorted(glob.glob(os.path.join(path, "*.bin")))
    say("READY")
    wait_for_parent("go")
    t0 = time.perf_counter()
    nbytes, tensors = read_and_convert(files, dtype)
    t_load = time.perf_counter()
    say("LOADED")
    wait_for_parent("go")
    result = {"load_seconds": t_load - t0, "forward_seconds": None, "write_seconds": None, "model_bytes": nbytes,
              "logits_finite": True, "notes": [], "mapped_bytes": None}
    say("RESULT " + json.dumps(result))
    wait_for_parent("exit")
    del tensors
    return 0

if __name__ == "__main__":
    sys.exit(main())
