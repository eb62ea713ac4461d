"""A 2-rank HF Trainer job under DeepSpeed ZeRO-3 on CPU, written as such jobs are (TrainingArguments first, so its
HfDeepSpeedConfig exists when the model is loaded). Writes OUT/zero3_train.<rank>.json per rank: losses and a
digest of this rank's trained partitions (a file each: the ranks' stdout lines interleave).

    torchrun --nproc-per-node 2 [-m lowmem_hf run] zero3_trainer.py --model PATH --output-dir OUT [--offload]
"""

import argparse
import hashlib
import json
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed on CPU; without oneCCL it uses gloo (NOTES.md)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, n: int = 64, length: int = 16):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--offload", action="store_true")
    args = parser.parse_args()
    zero = {"stage": 3}
    if args.offload:
        zero["offload_param"] = {"device": "cpu"}
    deepspeed_config = {
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"torch_adam": True, "lr": "auto", "weight_decay": "auto"}},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
    }
    training_args = TrainingArguments(
        output_dir=args.output_dir, deepspeed=deepspeed_config, use_cpu=False, max_steps=5, learning_rate=1e-3,
        per_device_train_batch_size=2, logging_steps=1, seed=0, report_to=[], save_strategy="no", ddp_backend="gloo",
    )
    model = AutoModelForCausalLM.from_pretrained(args.model)
    trainer = Trainer(model=model, args=training_args, train_dataset=Tokens(model.config.vocab_size))
    trainer.train()
    losses = [float(h["loss"]).hex() for h in trainer.state.log_history if "loss" in h]
    digest = hashlib.sha256()
    for name, param in sorted(trainer.model_wrapped.module.named_parameters()):
        digest.update(name.encode() + param.ds_tensor.detach().float().numpy().tobytes())
    rank = int(os.environ["RANK"])
    with open(os.path.join(args.output_dir, f"zero3_train.{rank}.json"), "w") as f:
        json.dump({"rank": rank, "losses": losses, "partitions": digest.hexdigest(), "lowmem_report": hasattr(model, "lowmem_report")}, f)
    # an orderly end, as torchrun scripts end; left to the interpreter's exit, gloo aborts a rank now and then
    # (client_harness._end_process_group has the cause)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
