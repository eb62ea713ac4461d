"""Supervised fine-tuning with TRL, as TRL's docs write it: ``SFTTrainer(model="<path>")`` loads the model itself.

    python sft_trl.py --model CKPT --output-dir OUT [--max-steps 4]

TRL calls ``<Architecture>.from_pretrained(path, device_map=None, trust_remote_code=False)`` (its
``create_model_from_path``); the tokenizer comes from the same folder. Prints one ``CLIENT_RESULT`` line
(``client_harness``): per-step losses and grad norms as ``float.hex``, and a digest of the trained weights.
"""

import argparse

from datasets import Dataset
from trl import SFTConfig, SFTTrainer

import client_harness

TEXTS = [
    "the cat sat on the mat",
    "a dog ran under the big tree",
    "the quick red fox jumps over the lazy dog",
    "a small bird flew near the old house",
    "the sun and then the moon",
    "a young cat sleeps on the blue rug",
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=4)
    args = parser.parse_args()

    dataset = Dataset.from_dict({"text": TEXTS * 4})
    training_args = SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        use_cpu=True,
    )
    trainer = SFTTrainer(model=args.model, args=training_args, train_dataset=dataset)
    client_harness.note_load("SFTTrainer(model=path)", trainer.model)
    trainer.train()

    steps = [h for h in trainer.state.log_history if "loss" in h]
    client_harness.note(
        losses=client_harness.float_hex(h["loss"] for h in steps),
        grad_norms=client_harness.float_hex(h["grad_norm"] for h in steps),
        trained_weights=client_harness.digest(trainer.model.state_dict()),
    )


if __name__ == "__main__":
    with client_harness.recorded():
        main()
