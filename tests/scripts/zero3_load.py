"""One rank of a job with DeepSpeed ZeRO-3 enabled the way the HF Trainer enables it (an HfDeepSpeedConfig alive
before from_pretrained): loads MODEL through lowmem_hf directly and through the switch; prints one JSON line."""

import contextlib
import json
import os
import sys
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed on CPU, gloo without oneCCL (NOTES.md)

import deepspeed  # noqa: E402
import torch.distributed  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.integrations import HfDeepSpeedConfig  # noqa: E402

import lowmem_hf  # noqa: E402
from lowmem_hf.patch import FallbackWarning  # noqa: E402


def main(path: str, mode: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1, "train_batch_size": 1}
    if mode == "bare-zero-init":  # Lightning's configure_model without an HfDeepSpeedConfig
        load = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained  # imported before, as a script imports it
        try:
            with deepspeed.zero.Init(config_dict_or_path=config):
                load(path)
            result = {"direct": "loaded"}
        except ValueError as error:
            result = {"direct": str(error)}
        print("ZERO3_RESULT " + json.dumps(result), flush=True)
        return
    if mode == "nothing":  # hidden_size halved: every checkpoint tensor has another shape than its parameter
        keep_alive = HfDeepSpeedConfig(config)  # noqa: F841 - transformers reads it through a weak reference
        result = {}
        model = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(path)  # partitioned: shape (0,) parameters
        result["plain"] = "loaded" if tuple(model.get_input_embeddings().weight.shape) == (0,) else "unpartitioned"
        loads = (("direct", lowmem_hf.LowMemAutoModelForCausalLM), ("switched", AutoModelForCausalLM), ("transformers", AutoModelForCausalLM))
        for how, load_class in loads:
            with lowmem_hf.patch_transformers() if how == "switched" else contextlib.nullcontext(), \
                    warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    model = load_class.from_pretrained(path, hidden_size=32, ignore_mismatched_sizes=True)
                    result[how] = "loaded by lowmem_hf" if hasattr(model, "lowmem_report") else "loaded by transformers"
                except Exception as error:  # noqa: BLE001 - what each loader does is the result
                    result[how] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            result[f"{how}_fallbacks"] = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
        print("ZERO3_RESULT " + json.dumps(result), flush=True)
        return
    if mode == "autotp":
        config["tensor_parallel"] = {"autotp_size": 2}
    keep_alive = HfDeepSpeedConfig(config)  # noqa: F841 - transformers reads it through a weak reference
    result = {}
    try:
        lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(path)
        result["direct"] = "loaded"
    except lowmem_hf.UnsupportedArgumentError as error:
        result["direct"] = error.argument
        result["direct_message"] = str(error)
    if mode == "autotp":  # transformers refuses it as well: nothing to fall back to
        print("ZERO3_RESULT " + json.dumps(result), flush=True)
        return
    with lowmem_hf.patch_transformers(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = AutoModelForCausalLM.from_pretrained(path)
    result["fallbacks"] = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    weight = model.get_input_embeddings().weight
    result["partitioned"] = tuple(weight.shape) == (0,) and hasattr(weight, "ds_tensor")
    result["lowmem_report"] = hasattr(model, "lowmem_report")
    print("ZERO3_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "fallback")
    torch.distributed.destroy_process_group()  # before the interpreter's exit: see client_harness._end_process_group
