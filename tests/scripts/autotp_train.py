"""DeepSpeed AutoTP training on CPU, written as DeepSpeed's AutoTP examples write it: load with transformers, hand
the model to ``deepspeed.initialize`` with ``"tensor_parallel": {"autotp_size": N}``, train with the engine.
Writes OUT/autotp_train.<rank>.json per rank: the losses, a digest of this rank's trained slices and their
shapes, and what loaded the model (a file each: the ranks' stdout lines interleave).

    torchrun --nproc-per-node 2 [-m lowmem_hf run] autotp_train.py --model PATH --output-dir OUT [--zero-stage 1]

Through the HF Trainer, AutoTP does not run on a CPU-only machine (README, "DeepSpeed"), so this is the engine
API directly.
"""

import argparse
import hashlib
import json
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed on CPU; without oneCCL it uses gloo (NOTES.md)

import deepspeed  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": args.zero_stage},
        "tensor_parallel": {"autotp_size": int(os.environ["WORLD_SIZE"])},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    # every TP rank sees the same batch (DeepSpeed checks it on the first forward)
    ids = torch.randint(0, model.config.vocab_size, (2 * args.steps, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for step in range(args.steps):
        batch = ids[2 * step : 2 * step + 2]
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())

    digest, shapes = hashlib.sha256(), {}
    for name, param in sorted(engine.module.named_parameters()):
        digest.update(name.encode() + param.detach().contiguous().view(torch.uint8).numpy().tobytes())
        shapes[name] = list(param.shape)
    report = getattr(model, "lowmem_report", None)
    rank = int(os.environ["RANK"])
    with open(os.path.join(args.output_dir, f"autotp_train.{rank}.json"), "w") as f:
        json.dump({
            "rank": rank, "losses": [float(x).hex() for x in losses], "slices": digest.hexdigest(), "shapes": shapes,
            "lowmem_report": report is not None, "bytes_read": report.bytes_read if report else None,
            "header_bytes": report.header_bytes if report else None,
        }, f)
    torch.distributed.barrier()  # an orderly end (client_harness._end_process_group has why)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
