"""One rank of a ZeRO-3 job: load each CASE with transformers and with lowmem_hf under the same DeepSpeed config,
compare this rank's partitions and buffers, and write what it found to OUT.<rank>.json.

    torchrun --nproc-per-node 2 zero3_partitions.py OUT CASE [CASE ...]     CASE = path[:bf16][:offload][:dcp-tp][:seqcls]

``dcp-tp``: lowmem_hf loads, instead of ``path`` itself, a ``dcp.save`` of ``path`` loaded with transformers' own
tensor parallelism over the same ranks (chunks cut along dim 0 or dim 1, which no ZeRO-3 partition follows);
transformers' reference still loads ``path``.
``seqcls``: both load it as a sequence classifier, whose head the checkpoint lacks (initialized, seeded alike).
``hub-ranges`` / ``hub-files``: lowmem_hf loads the repo ``org/<basename of path>`` from the loopback Hub at
``$ZERO3_HUB`` (each rank its own empty HF cache: one node each) with that ``fetch=``.
``s3``: lowmem_hf loads ``$ZERO3_S3/<basename of path>`` from an S3 server (endpoint and credentials in the env).
"""

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed on CPU, gloo without oneCCL (NOTES.md)

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification  # noqa: E402
from transformers.integrations import HfDeepSpeedConfig  # noqa: E402

import lowmem_hf  # noqa: E402


def ds_config(options: set[str]) -> dict:
    zero = {"stage": 3}
    if "offload" in options:
        zero["offload_param"] = {"device": "cpu"}
    config = {"zero_optimization": zero, "train_micro_batch_size_per_gpu": 1, "train_batch_size": dist.get_world_size()}
    if "bf16" in options:
        config["bf16"] = {"enabled": True}
    return config


def valid(param) -> torch.Tensor:
    """The elements of this rank's partition that hold the tensor (the last rank's tail is padding)."""
    size = param.ds_tensor.numel()
    return param.ds_tensor.view(-1)[: max(0, min(size, param.ds_numel - dist.get_rank() * size))]


def tp_dcp(path: str, out: str) -> str:
    """A sharded training checkpoint of ``path`` written by a TP job over this group (before ZeRO-3 is enabled)."""
    from torch.distributed import checkpoint as dcp

    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
    dcp.save(model.state_dict(), checkpoint_id=out)
    dist.barrier()
    return out


def compare(path: str, options: set[str], source: str) -> dict:
    keep_alive = HfDeepSpeedConfig(ds_config(options))  # noqa: F841 - transformers holds it by a weak reference
    if "seqcls" in options:  # the classification head is missing: initialized by transformers' ZeRO-3 finishing step
        torch.manual_seed(0)
        ref = AutoModelForSequenceClassification.from_pretrained(path, num_labels=3)
        torch.manual_seed(0)
        got, report = lowmem_hf.LowMemAutoModelForSequenceClassification.from_pretrained(path, num_labels=3, output_loading_info=True)
        return _compared(path, options, ref, got, report)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(0)
    load = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained
    fetch = next((o.removeprefix("hub-") for o in options if o.startswith("hub-")), None)
    if "s3" in options:
        got, report = load(f"{os.environ['ZERO3_S3']}/{os.path.basename(path)}", output_loading_info=True)
    elif fetch is not None:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from hub_server import use_hub

        with use_hub(os.environ["ZERO3_HUB"], f"{source}-{fetch}-home{dist.get_rank()}"):
            got, report = load(f"org/{os.path.basename(path)}", fetch=fetch, output_loading_info=True)
    else:
        got, report = load(source, config=path, output_loading_info=True)
    return _compared(path, options, ref, got, report)


def _compared(path: str, options: set[str], ref, got, report) -> dict:
    differ = []
    ours = dict(got.named_parameters(remove_duplicate=False))
    for name, param in ref.named_parameters(remove_duplicate=False):
        mine = ours[name]
        if not hasattr(mine, "ds_tensor") or tuple(mine.ds_shape) != tuple(param.ds_shape):
            differ.append(f"{name}: not partitioned like transformers'")
        elif valid(mine).dtype != valid(param).dtype or not torch.equal(valid(mine), valid(param)):
            differ.append(f"{name}: partition differs")
    for name, buf in ref.named_buffers():
        mine = dict(got.named_buffers())[name]
        if mine.dtype != buf.dtype or not torch.equal(mine, buf):
            differ.append(f"buffer {name} differs")
    tied_ref = {n for n, _ in ref.named_parameters(remove_duplicate=False)} - {n for n, _ in ref.named_parameters()}
    tied_got = {n for n, _ in got.named_parameters(remove_duplicate=False)} - {n for n, _ in got.named_parameters()}
    # the partitions this rank read (a tied parameter is read once, under the name the checkpoint has)
    partition_elements = sum(spec.stop - spec.start for name, spec in report.shards.items() if name in report.dtype_decisions)
    return {
        "case": f"{os.path.basename(path)}:{'+'.join(sorted(options))}",
        "differ": differ,
        "tied_same": tied_ref == tied_got,
        "partition_dtype": str(valid(next(got.parameters())).dtype),
        "bytes_read": report.bytes_read,
        "header_bytes": report.header_bytes,
        "partition_elements": partition_elements,
        "buffer_bytes": sum(b.numel() * b.element_size() for b in got.buffers()),
        "model_bytes": report.model_bytes,
        "missing_keys": sorted(report.missing_keys),
        "lowmem_partitioned": all(hasattr(p, "ds_tensor") and p.shape == (0,) for p in got.parameters()),
    }


def main(out: str, cases: list[str]) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    results, sources = [], {}
    for case in cases:  # every TP-written checkpoint first: a TP load refuses to run while ZeRO-3 is enabled
        path, *options = case.split(":")
        if "dcp-tp" in options:
            sources[case] = tp_dcp(path, f"{out}-{os.path.basename(path)}-dcp")
    for case in cases:
        path, *options = case.split(":")
        results.append(compare(path, set(options), sources.get(case, path)))
    with open(f"{out}.{dist.get_rank()}.json", "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()  # before the interpreter's exit: see client_harness._end_process_group


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
