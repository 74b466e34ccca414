#!/usr/bin/env bash
# Set up (scripts/setup.sh), install redis-server for the router's Redis tests, lint, run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
# SmolLM2 and tiny random checkpoints are all the tests load: no 1.1 GB default model here.
bash scripts/setup.sh smollm2
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  else
    echo "redis-server is not installed and we are not root: the Redis tests will be skipped" >&2
  fi
fi
. .venv/bin/activate
ruff check .
ruff format --check .
# -rs: every skip with its reason (only hardware the CPU lacks should remain); tests/conftest.py
# prints how many ran per marker.
python -m pytest -q -rs -p no:cacheprovider "$@"
