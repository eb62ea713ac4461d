"""Child process of bench_load.py: load one checkpoint once, following measure.py's protocol.

    python benchmarks/_child.py --loader {lowmem,transformers,accelerate} --path DIR --dtype bfloat16

Everything that is not the load itself (imports, resolving the model class, a warm-up tensor)
happens *before* READY so it is part of the baseline the parent records; post-load checks happen
*after* LOADED so they are not part of the measured peak.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
import time
import traceback

from measure import PREFIX, read_proc_status  # sibling module: the harness


def say(msg: str) -> None:
    sys.stdout.write(PREFIX + msg + "\n")
    sys.stdout.flush()


def wait_for_parent(expected: str) -> None:
    line = sys.stdin.readline()
    if line.strip() != expected:
        raise SystemExit(f"protocol error: expected {expected!r} from parent, got {line!r}")


def file_backed_bytes(tensors) -> tuple[int, list[str]]:
    """Bytes of ``tensors`` whose storage lies in a file-backed mapping (e.g. an mmap of a
    safetensors shard), found by looking each storage's address up in /proc/self/maps."""
    maps = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5].strip() if len(parts) > 5 else ""
            maps.append((start, end, path))
    maps.sort()
    starts = [m[0] for m in maps]
    total, paths, seen = 0, set(), set()
    for t in tensors:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in seen or st.nbytes() == 0:
            continue
        seen.add(ptr)
        i = bisect.bisect_right(starts, ptr) - 1
        if i >= 0 and maps[i][0] <= ptr < maps[i][1]:
            path = maps[i][2]
            # Real files only: anonymous memory has no path or a [heap]/[stack]/memfd-like name.
            if path.startswith("/") and not path.startswith("/memfd:") and "(deleted)" not in path:
                total += st.nbytes()
                paths.add(os.path.basename(path))
    return total, sorted(paths)[:20]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loader", choices=("lowmem", "transformers", "accelerate"), required=True)
    ap.add_argument("--path", required=True)
    ap.add_argument("--dtype", required=True, help="torch dtype name, e.g. bfloat16")
    ap.add_argument("--skip-value-check", action="store_true")
    args = ap.parse_args()

    # ---- setup: all of this is in the baseline ---------------------------------------------
    import torch
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    dtype = getattr(torch, args.dtype)
    # transformers imports modeling_<arch> lazily inside from_pretrained; resolve it now so that
    # neither loader is charged for importing the model code.
    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(args.path))]
    if args.loader == "lowmem":
        import lowmem_hf
        from lowmem_hf import LowMemAutoModelForCausalLM

        versions = {"lowmem_hf": getattr(lowmem_hf, "__version__", "?")}

        def load():
            return LowMemAutoModelForCausalLM.from_pretrained(args.path, torch_dtype=dtype)
    elif args.loader == "accelerate":
        # accelerate's documented big-model recipe: an empty (meta) model, then its checkpoint loader.
        import accelerate
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch
        from transformers import AutoModelForCausalLM

        versions = {"accelerate": accelerate.__version__}

        def load():
            with init_empty_weights():
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.path), dtype=dtype)
            model.tie_weights()
            return load_checkpoint_and_dispatch(model, checkpoint=args.path, device_map={"": "cpu"}, dtype=dtype)
    else:
        from transformers import AutoModelForCausalLM

        versions = {}

        def load():
            return AutoModelForCausalLM.from_pretrained(args.path, dtype=dtype)

    versions.update(torch=torch.__version__, transformers=transformers.__version__)
    # Warm-up: first tensor op initialises the allocator / thread pool lazily; keep it out.
    (torch.ones(1024) * 2).sum().item()

    say("READY")
    wait_for_parent("go")

    # ---- the measured part -------------------------------------------------------------------
    t0 = time.perf_counter()
    model = load()
    load_seconds = time.perf_counter() - t0
    st_after = read_proc_status()

    say("LOADED")
    wait_for_parent("go")

    # ---- post-load checks (not measured) -----------------------------------------------------
    params = list(model.parameters())  # unique: tied parameters are listed once
    buffers = list(model.buffers())
    tensors = params + buffers
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    buffer_bytes = sum(b.numel() * b.element_size() for b in buffers)
    meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    meta += [n for n, b in model.named_buffers() if b.device.type == "meta"]
    dtypes: dict[str, int] = {}
    for p in params:
        dtypes[str(p.dtype)] = dtypes.get(str(p.dtype), 0) + 1
    fb_bytes, fb_files = file_backed_bytes([t for t in tensors if t.device.type == "cpu"])

    result = {
        "loader": args.loader,
        "path": args.path,
        "dtype": args.dtype,
        "versions": versions,
        "load_seconds": load_seconds,
        "model_bytes": param_bytes + buffer_bytes,
        "param_bytes": param_bytes,
        "buffer_bytes": buffer_bytes,
        "n_params": len(params),
        "param_dtypes": dtypes,
        "dtype_ok": set(dtypes) == {str(dtype)},
        "meta_tensors": meta[:20],
        "n_meta_tensors": len(meta),
        "rss_file_after_kb": st_after.get("RssFile"),
        "rss_anon_after_kb": st_after.get("RssAnon"),
        "file_backed_param_bytes": fb_bytes,
        "file_backed_files": fb_files,
        "training_mode": model.training,
    }

    # Values must be exactly the checkpoint's values rounded to their dtype.
    fp_file = os.path.join(args.path, "bench_fingerprint.json")
    if not args.skip_value_check and os.path.exists(fp_file) and not meta:
        from checkpoints import fingerprint_matches, tensor_fingerprint

        with open(fp_file) as f:
            expected_all = json.load(f)
        bad, missing, checked = [], [], 0
        named = dict(model.named_parameters())
        for key, p in named.items():
            expected = expected_all.get(str(p.dtype).replace("torch.", ""), {}).get(key)
            if expected is None:
                missing.append(key)
                continue
            checked += 1
            if not fingerprint_matches(tensor_fingerprint(p), expected):
                bad.append(key)
        not_loaded = sorted(set(expected_all.get("float32", {})) - set(named))
        result.update(
            values_checked=checked,
            values_mismatch=bad[:20],
            n_values_mismatch=len(bad),
            params_not_in_checkpoint=missing[:20],
            checkpoint_keys_not_in_model=not_loaded[:20],
            values_ok=checked > 0 and not bad and not missing and not not_loaded,
        )
    # mmap-backed parameters (same-dtype loads) are only resident once touched; the value check
    # above touched every parameter, so this shows what the model costs once actually used.
    st_touched = read_proc_status()
    result["rss_file_after_touch_kb"] = st_touched.get("RssFile")
    result["rss_anon_after_touch_kb"] = st_touched.get("RssAnon")
    say("RESULT " + json.dumps(result))
    wait_for_parent("exit")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(1)
