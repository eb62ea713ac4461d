"""Greedy generation through ``pipeline("text-generation", model=<path>)``, as transformers' docs write it.

    python pipeline_generate.py --model CKPT [--max-new-tokens 8]

The pipeline loads the model and tokenizer from the path itself. Prints one ``CLIENT_RESULT`` line
(``client_harness``): the pipeline's generated token ids and texts, ``model.generate`` ids, and a digest of the
logits on the prompts.
"""

import argparse

import torch
from transformers import pipeline

import client_harness

PROMPTS = ["the cat sat on", "a quick red fox"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args()

    generator = pipeline("text-generation", model=args.model)
    client_harness.note_load("pipeline('text-generation')", generator.model)

    token_ids = [
        out[0]["generated_token_ids"]
        for out in (
            generator(p, max_new_tokens=args.max_new_tokens, do_sample=False, return_tensors=True) for p in PROMPTS
        )
    ]
    texts = [
        out[0]["generated_text"]
        for out in (generator(p, max_new_tokens=args.max_new_tokens, do_sample=False) for p in PROMPTS)
    ]

    model, tokenizer = generator.model, generator.tokenizer
    generated, logits = [], {}
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            inputs = tokenizer(prompt, return_tensors="pt")
            n = args.max_new_tokens
            out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            generated.append(out[0].tolist())
            logits[f"prompt{i}"] = model(**inputs).logits

    client_harness.note(
        pipeline_token_ids=token_ids,
        pipeline_texts=texts,
        generate_token_ids=generated,
        logits=client_harness.digest(logits),
    )


if __name__ == "__main__":
    with client_harness.recorded():
        main()
