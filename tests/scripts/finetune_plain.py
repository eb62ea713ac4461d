"""A fine-tuning script that knows nothing of lowmem_hf: transformers' API only (a test fixture for the switch).

    python finetune_plain.py --model PATH --output-dir OUT [--steps 3] [--tp --allow-cpu-tp] [--losses-out F]

``lowmem-hf run finetune_plain.py ...`` (or ``torchrun ... -m lowmem_hf run finetune_plain.py ...``) must give
the same losses, with lowmem_hf doing the load.
"""

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments


class LossRecorder(TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tp", action="store_true", help='load with tp_plan="auto" (run under torchrun)')
    p.add_argument("--allow-cpu-tp", action="store_true")
    p.add_argument("--losses-out")
    args = p.parse_args()
    if args.allow_cpu_tp:
        # accelerate refuses a TP ParallelismConfig on CPU processes (a GPU-only check); skip only that check
        from accelerate.parallelism_config import ParallelismConfig

        ParallelismConfig._validate_accelerator = lambda self, accelerator: None

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, **({"tp_plan": "auto"} if args.tp else {}))
    ids = torch.randint(0, model.config.vocab_size, (4 * args.steps, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row.clone()} for row in ids]
    recorder = LossRecorder()
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=4, learning_rate=1e-3,
            logging_steps=1, save_strategy="no", report_to=[], seed=0, train_sampling_strategy="sequential", use_cpu=True,
        ),
        train_dataset=data,
        callbacks=[recorder],
    )
    trainer.train()
    if trainer.is_world_process_zero():
        print("__main__ ok", "losses:", recorder.losses)
        if args.losses_out:
            with open(args.losses_out, "w") as f:
                json.dump(recorder.losses, f)
    if torch.distributed.is_initialized():
        # an orderly end: left to the interpreter's exit, gloo aborts a rank now and then
        # (client_harness._end_process_group has the cause)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
