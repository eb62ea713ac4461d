"""Fine-tune with tensor parallelism, save a sharded checkpoint mid-run, resume it at another tp_size, save for the Hub.

    # 2 TP ranks: train --steps, writing a sharded checkpoint (no gather) after --save-at steps
    torchrun --nproc-per-node 2 examples/finetune_tp_resume.py --model PATH --checkpoint CKPT --steps 4 --save-at 2
    # resume from CKPT in one process (tp_size 1; or torchrun with another size), train on, save the Hub layout
    python examples/finetune_tp_resume.py --model CKPT --steps 2 --output-dir OUT

Each rank reads only its part of the checkpoint, whatever tp_size wrote it; ``lowmem_hf.save_pretrained`` writes
the final model one tensor at a time, and ``AutoModelForCausalLM.from_pretrained(OUT)`` loads it in one process.
Only model weights are checkpointed (restart the optimizer, or save its state with DCP alongside). The data is a
fixed set of random token ids (labels = inputs): no tokenizer, no network.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import lowmem_hf


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a save_pretrained folder or a sharded checkpoint to resume")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save-at", type=int, default=None, help="write --checkpoint after this many steps")
    p.add_argument("--checkpoint", default=None, help="sharded checkpoint directory written mid-run")
    p.add_argument("--output-dir", default=None, help="final model in the Hub layout")
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args(argv)

    tp = {"tp_plan": "auto"} if "WORLD_SIZE" in os.environ else {}  # under torchrun: one TP group of all ranks
    model = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32, **tp)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)
    data = torch.randint(0, model.config.vocab_size, (args.steps, 4, 16), generator=torch.Generator().manual_seed(0))
    rank = dist.get_rank() if dist.is_initialized() else 0
    for step, ids in enumerate(data, start=1):
        loss = model(input_ids=ids, labels=ids).loss  # every TP rank sees the same batch
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")
        if step == args.save_at and args.checkpoint:
            lowmem_hf.save_pretrained(model, args.checkpoint, distributed_checkpoint=True)  # all ranks, no gather
    if args.output_dir:
        lowmem_hf.save_pretrained(model, args.output_dir)  # all ranks; rank 0 writes
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
