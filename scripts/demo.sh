#!/usr/bin/env bash
# The main job: set up, serve the default model (SmolLM2-135M-Instruct, chunkcache.model.loader.default_model), show one RAG request cold, warm and as a follow-up, and keep
# serving until Ctrl-C. PORT picks the port (default: a free one); extra args go to `chunkcache serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
PORT=${PORT:-$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
# --exact-follow-ups: a follow-up over the same documents reads a full prefill's KV (computed while
# the server idles), as a RAG chat server would run.
chunkcache serve --port "$PORT" --exact-follow-ups "$@" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT INT TERM
for _ in $(seq 1 120); do
  if python -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health').status_code != 200)" 2>/dev/null; then
    break
  fi
  kill -0 $SERVER 2>/dev/null || { echo "the server exited" >&2; exit 1; }
  sleep 1
done
python examples/rag_demo.py --base-url "http://127.0.0.1:$PORT/v1" --exact-follow-ups
echo
echo "serving on http://127.0.0.1:$PORT/v1 (OpenAI API); Ctrl-C stops it"
wait $SERVER
