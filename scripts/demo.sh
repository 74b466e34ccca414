#!/usr/bin/env bash
# The main job: set up, serve the default model (Qwen2.5-Coder-1.5B-Instruct in bfloat16), show one
# RAG request cold, warm and as a follow-up, each answer checked, then the same questions with a full
# prefill, and keep serving until Ctrl-C. PORT picks the port (default: a free one); extra args go to
# `chunkcache serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
PORT=${PORT:-$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
# The demo's model and its reuse options: set here and nowhere else (examples/rag_demo.py sends
# none of its own but for the full-prefill check). bfloat16: what `--dtype auto` picks on CPUs with
# native bf16 matrix instructions, pinned so that the transcript is the same elsewhere.
MODEL_OPTIONS=(--model qwen2.5-coder-1.5b --dtype bfloat16)
# None: the model's own default reuse (chunkcache/model/catalog.py), layout fusion for this model:
# one exact stream per document and a joint stream over up to three of the most relevant ones, combined at
# decode time; a follow-up is one more warm request.
CHUNK_OPTIONS=()
chunkcache serve --port "$PORT" "${MODEL_OPTIONS[@]}" "${CHUNK_OPTIONS[@]}" "$@" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT INT TERM
for _ in $(seq 1 300); do  # the 1.5B model loads in about a minute
  if python -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health').status_code != 200)" 2>/dev/null; then
    break
  fi
  kill -0 $SERVER 2>/dev/null || { echo "the server exited" >&2; exit 1; }
  sleep 1
done
python examples/rag_demo.py --base-url "http://127.0.0.1:$PORT/v1" --full-prefill
echo
echo "serving on http://127.0.0.1:$PORT/v1 (OpenAI API); Ctrl-C stops it"
wait $SERVER
