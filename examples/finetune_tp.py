"""Fine-tune a causal LM loaded with tensor parallelism, using the Hugging Face Trainer.

Each rank of a ``torchrun`` job loads its own shard of the model (``tp_plan="auto"``), every rank sees the
same batches, and ``trainer.save_model`` gathers the full tensors back into one ordinary checkpoint::

    torchrun --nproc-per-node 2 examples/finetune_tp.py --model PATH --output-dir OUT [--allow-cpu-tp]

The data is a tiny fixed set of random token ids (labels = input ids), so the script needs no tokenizer
and no network. ``--no-tp`` loads the model whole in one plain process: the reference run::

    python examples/finetune_tp.py --model PATH --output-dir REF --no-tp

On a machine without GPUs, ``--allow-cpu-tp`` is needed: see ``allow_cpu_tp`` below.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="local model folder (save_pretrained output)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--loader", choices=["lowmem", "transformers"], default="lowmem")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--allow-cpu-tp", action="store_true", help="skip accelerate's GPU-only check for TP")
    p.add_argument("--losses-out", help="write the per-step training losses here as JSON (rank 0)")
    p.add_argument("--no-tp", action="store_true", help="load the whole model in one process (reference run)")
    return p.parse_args(argv)


def allow_cpu_tp():
    """Let accelerate run a tensor-parallel model on CPU processes (gloo).

    accelerate's ``ParallelismConfig._validate_accelerator`` accepts a ParallelismConfig only for FSDP2,
    DeepSpeed or multi-*GPU-like* devices, and raises for ``DistributedType.MULTI_CPU``. Nothing else in the
    TP path needs a GPU, so for CPU runs (tests, CI) we skip exactly that one validation. Only do this when asked.
    """
    from accelerate.parallelism_config import ParallelismConfig

    ParallelismConfig._validate_accelerator = lambda self, accelerator: None


def load_model(args):
    dtype = getattr(torch, args.dtype)
    tp = {} if args.no_tp else {"tp_plan": "auto"}
    if args.loader == "lowmem":
        from lowmem_hf import LowMemAutoModelForCausalLM

        return LowMemAutoModelForCausalLM.from_pretrained(args.model, torch_dtype=dtype, **tp)
    return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, **tp)


def make_dataset(vocab_size, n, seq_len, seed):
    """``n`` fixed random sequences, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (n, seq_len), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


class LossRecorder(TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def main(argv=None):
    args = parse_args(argv)
    if args.allow_cpu_tp:
        allow_cpu_tp()

    model = load_model(args)
    dataset = make_dataset(model.config.vocab_size, args.batch_size * args.steps, args.seq_len, args.seed)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        logging_steps=1,
        save_strategy="no",  # mid-training checkpoints of a TP model would need save_only_model=True
        report_to=[],
        seed=args.seed,
        train_sampling_strategy="sequential",  # same batches in the TP and the reference run
        use_cpu=not torch.cuda.is_available(),
    )
    recorder = LossRecorder()
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, callbacks=[recorder])
    trainer.train()
    trainer.save_model(args.output_dir)  # every rank: the TP shards are gathered collectively

    if trainer.is_world_process_zero():
        print("losses:", recorder.losses)
        if args.losses_out:
            with open(args.losses_out, "w") as f:
                json.dump(recorder.losses, f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
