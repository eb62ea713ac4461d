"""Print the stack a tox env runs on, so the CI log names the versions each stack tested."""

import importlib.metadata
import sys

PACKAGES = ("torch", "transformers", "huggingface-hub", "safetensors", "accelerate", "trl", "peft", "datasets", "deepspeed")


def main() -> None:
    env = sys.argv[1] if len(sys.argv) > 1 else "?"
    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    print(f"[stack {env}] python {sys.version.split()[0]}; " + ", ".join(found), flush=True)


if __name__ == "__main__":
    main()
