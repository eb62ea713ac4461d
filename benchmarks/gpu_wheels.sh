#!/usr/bin/env bash
# The wheels gpu_check.py needs on the GPU machine, which has no registry and an older stack (Python 3.12,
# torch 2.11, transformers 5.17, huggingface_hub 1.33): lowmem_hf's own floor (pyproject.toml, at the versions
# constraints.txt pins) plus what that floor needs at import and is newer than the machine's. Pure-Python and
# abi3/cp312 manylinux wheels only, no dependencies resolved (torch, numpy stay the machine's), under 64 MiB so
# they travel with the working tree (`run`'s carry of benchmarks/_gpu_wheels).
#
#     bash benchmarks/gpu_wheels.sh [DIR]        # default benchmarks/_gpu_wheels
#     python benchmarks/gpu_check.py --wheels benchmarks/_gpu_wheels ...   # installs them into a temp folder first
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here/_gpu_wheels}"
mkdir -p "$out"
pin() { grep -i "^$1==" "$here/../constraints.txt" | head -1; }
# transformers 5.23 checks tokenizers, regex and huggingface-hub versions at import; huggingface-hub 2.4 imports
# httpx2 (+ httpcore2, anyio, idna, truststore), click and hf-xet.
PIP_CONSTRAINT= python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --abi cp312 --abi abi3 --abi none -d "$out" \
    "$(pin transformers)" "$(pin huggingface-hub)" "$(pin safetensors)" "$(pin accelerate)" \
    "tokenizers>=0.23.1,<0.24" "regex>=2025.10.22" "hf-xet>=1.6,<2" "httpx2>=2,<3" "httpcore2" \
    "anyio>=4.10" "idna>=3.18" "truststore>=0.10" "click>=8.4.2,<9" "typing-extensions>=4.5"
du -sh "$out"
total=$(du -sb "$out" | cut -f1)
if [ "$total" -gt $((64 * 1024 * 1024)) ]; then echo "$out is $total bytes, over the 64 MiB a run carries" >&2; exit 1; fi
ls "$out"
