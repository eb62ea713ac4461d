"""LoRA fine-tuning with PEFT, as PEFT's docs write it: train, save the adapter, load it back both ways.

    python peft_lora.py --base CKPT --adapter-dir OUT [--steps 4]

1. ``AutoModelForCausalLM.from_pretrained(base)`` + ``get_peft_model(model, LoraConfig(...))``, a plain torch
   training loop, ``model.save_pretrained(adapter_dir)``;
2. ``AutoPeftModelForCausalLM.from_pretrained(adapter_dir)`` (PEFT loads the base from the adapter's
   ``base_model_name_or_path``);
3. ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir)``.

Prints one ``CLIENT_RESULT`` line (``client_harness``): losses as ``float.hex``, digests of the saved adapter and
of the logits of the trained and of both reloaded models.
"""

import argparse
import os

import torch
from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel, TaskType, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

import client_harness

TEXTS = [
    "the cat sat on the mat",
    "a dog ran under the big tree and then sleeps",
    "the quick red fox jumps over the lazy dog",
    "a small bird flew near the old house",
]


def logits_of(model, batch) -> str:
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return client_harness.digest({"logits": logits})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True)
    parser.add_argument("--adapter-dir", required=True)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    set_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)

    model = AutoModelForCausalLM.from_pretrained(args.base)
    client_harness.note_load("AutoModelForCausalLM (base to train)", model)
    peft_config = LoraConfig(task_type=TaskType.CAUSAL_LM, r=8, lora_alpha=16, lora_dropout=0.05)
    model = get_peft_model(model, peft_config)
    model.print_trainable_parameters()

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    losses = []
    for _ in range(args.steps):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    trained_logits = logits_of(model, batch)
    model.save_pretrained(args.adapter_dir)

    auto_peft = AutoPeftModelForCausalLM.from_pretrained(args.adapter_dir)
    client_harness.note_load("AutoPeftModelForCausalLM (its base)", auto_peft.get_base_model())

    base = AutoModelForCausalLM.from_pretrained(args.base)
    client_harness.note_load("AutoModelForCausalLM (base for PeftModel)", base)
    peft_model = PeftModel.from_pretrained(base, args.adapter_dir)

    client_harness.note(
        losses=client_harness.float_hex(losses),
        adapter_weights=client_harness.digest(load_file(os.path.join(args.adapter_dir, "adapter_model.safetensors"))),
        trained_logits=trained_logits,
        reloaded_logits={"auto_peft": logits_of(auto_peft, batch), "peft_model": logits_of(peft_model, batch)},
    )


if __name__ == "__main__":
    with client_harness.recorded():
        main()
