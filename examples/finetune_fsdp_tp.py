"""Fine-tune a causal LM sharded by transformers' DistributedConfig (TP x FSDP2, HSDP), with the HF Trainer.

Each rank loads only its own shards (lowmem_hf reads the bytes its DTensor placements own); transformers'
engine applies TP and FSDP2 exactly as ``from_pretrained(distributed_config=...)`` does, and the Trainer
trains it. ``trainer.save_model`` gathers one ordinary checkpoint::

    torchrun --nproc-per-node 4 examples/finetune_fsdp_tp.py --model PATH --output-dir OUT --tp-size 2 --fsdp-size 2 [--allow-cpu-tp]

The data is a tiny fixed set of random token ids (labels = input ids): no tokenizer, no network. The
reference run loads the whole model in one plain process and takes the same global batches (``--dp-size``
times the per-rank batch, as the ``dp_replicate_size * fsdp_size`` data-parallel ranks together see)::

    python examples/finetune_fsdp_tp.py --model PATH --output-dir REF --no-dist --dp-size 2

On CPU (gloo), ``--allow-cpu-tp`` is needed: see ``finetune_tp.allow_cpu_tp``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
from transformers.distributed import DistributedConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_tp import LossRecorder, allow_cpu_tp, make_dataset  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="local model folder (save_pretrained output)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--fsdp-size", type=int, default=2)
    p.add_argument("--dp-replicate-size", type=int, default=1)
    p.add_argument("--loader", choices=["lowmem", "transformers"], default="lowmem")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=4, help="per data-parallel rank")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--allow-cpu-tp", action="store_true", help="skip accelerate's GPU-only check for ParallelismConfig")
    p.add_argument("--losses-out", help="write the per-step training losses here as JSON (rank 0)")
    p.add_argument("--no-dist", action="store_true", help="load the whole model in one process (reference run)")
    p.add_argument("--dp-size", type=int, default=1, help="reference run: data-parallel ranks to stand in for")
    return p.parse_args(argv)


def load_model(args):
    dtype = getattr(torch, args.dtype)
    extra = {}
    if not args.no_dist:
        extra["distributed_config"] = DistributedConfig(
            tp_size=args.tp_size, fsdp_size=args.fsdp_size, dp_replicate_size=args.dp_replicate_size
        )
    if args.loader == "lowmem":
        from lowmem_hf import LowMemAutoModelForCausalLM

        return LowMemAutoModelForCausalLM.from_pretrained(args.model, torch_dtype=dtype, **extra)
    return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, **extra)


def main(argv=None):
    args = parse_args(argv)
    if args.allow_cpu_tp:
        allow_cpu_tp()

    model = load_model(args)
    dp = args.dp_size if args.no_dist else args.dp_replicate_size * args.fsdp_size
    batch = args.batch_size * (args.dp_size if args.no_dist else 1)
    dataset = make_dataset(model.config.vocab_size, args.batch_size * dp * args.steps, args.seq_len, args.seed)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=batch,
        learning_rate=args.lr,
        logging_steps=1,
        save_strategy="no",  # mid-training checkpoints of a sharded model would need save_only_model=True
        report_to=[],
        seed=args.seed,
        train_sampling_strategy="sequential",  # the same global batches in the sharded and the reference run
        use_cpu=not torch.cuda.is_available(),
    )
    recorder = LossRecorder()
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, callbacks=[recorder])
    trainer.train()
    trainer.save_model(args.output_dir)  # every rank: FSDP/TP shards are gathered collectively

    if trainer.is_world_process_zero():
        print("losses:", recorder.losses)
        if args.losses_out:
            with open(args.losses_out, "w") as f:
                json.dump(recorder.losses, f)


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
