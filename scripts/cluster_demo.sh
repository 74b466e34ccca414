#!/usr/bin/env bash
# A cache-aware cluster on one machine, end to end (docs/router.md "A cluster on one machine"):
# N `chunkcache serve` replicas publishing KV events, a redis-server holding the router's shared
# index, and `chunkcache route --model` in front, all on free loopback ports. A RAG workload whose
# documents recur in new orders goes through it twice, on fresh replicas each time: with the
# round_robin policy, then with cache_aware. Per request: the replica that served it, the prompt
# tokens served from cache and the TTFT; then a summary of both. Everything started is stopped on exit.
#
# usage: scripts/cluster_demo.sh [--replicas N] [--threads K] [--model M] [--dtype D] [--rounds R]
#                                [--topics T] [--logs DIR] [-- extra `chunkcache serve` options]
# --threads: each replica's (default: the cores this script may use, by affinity and cgroup quota,
# divided among the replicas, at least 1).
# e.g.   scripts/cluster_demo.sh --model smollm2 --dtype float32
# PYTHON (default: python3) is the interpreter that has chunkcache installed.
set -euo pipefail

REPLICAS=2 THREADS="" MODEL="" DTYPE=auto ROUNDS=4 TOPICS=4 LOGS=""
SERVE_EXTRA=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --replicas) REPLICAS=$2; shift 2 ;;
        --threads) THREADS=$2; shift 2 ;;
        --model) MODEL=$2; shift 2 ;;
        --dtype) DTYPE=$2; shift 2 ;;
        --rounds) ROUNDS=$2; shift 2 ;;
        --topics) TOPICS=$2; shift 2 ;;
        --logs) LOGS=$2; shift 2 ;;
        --) shift; SERVE_EXTRA=("$@"); break ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "cluster_demo.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ "$REPLICAS" =~ ^[1-9][0-9]*$ ]] || { echo "cluster_demo.sh: --replicas must be a positive integer" >&2; exit 2; }
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
command -v redis-server >/dev/null || { echo "cluster_demo.sh: redis-server not found (apt-get install redis-server)" >&2; exit 2; }
# Each replica its share of the cores: engines that each take every core slow each other (two on
# 2 cores measured up to 10x slower than alone; docs/operations.md "Memory and threads").
if [[ -z "$THREADS" ]]; then
    THREADS=$("$PY" -c "import sys
from chunkcache.threads import default_threads
print(max(1, default_threads()[0] // int(sys.argv[1])))" "$REPLICAS")
fi
[[ "$THREADS" =~ ^[1-9][0-9]*$ ]] || { echo "cluster_demo.sh: --threads must be a positive integer" >&2; exit 2; }

WORK=$(mktemp -d -t chunkcache-cluster-XXXXXX)
LOGS=${LOGS:-$WORK/logs}
mkdir -p "$LOGS"
PIDS=()
stop_all() {  # the processes this script started, by their ids, newest first
    local i
    for (( i=${#PIDS[@]}-1; i>=0; i-- )); do kill "${PIDS[i]}" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    PIDS=()
}
trap 'stop_all; rm -rf "$WORK"' EXIT
trap 'exit 130' INT TERM

# A free loopback port, below the kernel's ephemeral range (ip_local_port_range, from 32768 by
# default) so that no outgoing connection of a process already started takes it before the server
# it is meant for binds it (port 0 hands out ephemeral ports: that race failed a CI run), and never
# one handed out before in this run (recorded in $WORK/ports until the processes bind them).
free_port() {
    "$PY" - "$WORK/ports" <<'PY'
import os, random, socket, sys
path = sys.argv[1]
used = set(open(path).read().split()) if os.path.exists(path) else set()
for _ in range(1000):
    port = random.randint(20000, 32000)
    if str(port) in used:
        continue
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
    with open(path, "a") as f:
        f.write(f"{port}\n")
    print(port)
    break
else:
    sys.exit("no free port in 20000-32000")
PY
}
wait_healthy() {  # URL NAME PID
    local deadline=$(( SECONDS + 900 ))
    until "$PY" -c "import httpx, sys; sys.exit(httpx.get('$1/health', timeout=2).status_code != 200)" 2>/dev/null; do
        kill -0 "$3" 2>/dev/null || { echo "$2 exited during start-up; its log:" >&2; tail -20 "$LOGS/$2.log" >&2; exit 1; }
        (( SECONDS < deadline )) || { echo "$2 not healthy after 900 s" >&2; exit 1; }
        sleep 1
    done
}

# The model: resolved as `serve` resolves it; its served name is the chunk keys' model name.
MODEL_ARGS=()
[[ -n "$MODEL" ]] && MODEL_ARGS=(--model "$MODEL")
NAME=$("$PY" -c "
import sys
from chunkcache.errors import ModelLoadError
from chunkcache.model import catalog
from chunkcache.model.source import default_model_name, resolve_model_path
try:
    print(default_model_name(resolve_model_path(sys.argv[1] or catalog.DEFAULT_MODEL)))
except ModelLoadError as e:
    sys.exit(f'cluster_demo.sh: {e}')
" "$MODEL")

REDIS_PORT=$(free_port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no >"$LOGS/redis.log" 2>&1 &
PIDS+=($!)
REDIS_PIDS=("${PIDS[@]}")
echo "redis-server on 127.0.0.1:$REDIS_PORT (the router's index); logs in $LOGS"

run_policy() {  # POLICY DB: fresh replicas and a router, the workload, then all stopped but Redis
    local policy=$1 db=$2 events specs=() names=() i port replay url
    events="tcp://127.0.0.1:$(free_port)"
    for (( i=0; i<REPLICAS; i++ )); do
        port=$(free_port) replay="tcp://127.0.0.1:$(free_port)" url="http://127.0.0.1:$port"
        "$PY" -m chunkcache.cli serve "${MODEL_ARGS[@]}" --dtype "$DTYPE" --host 127.0.0.1 --port "$port" \
            --kv-events-endpoint "$events" --kv-events-topic "kv@r$i@$NAME" \
            --kv-events-replay-endpoint "$replay" --threads "$THREADS" "${SERVE_EXTRA[@]}" >"$LOGS/$policy-r$i.log" 2>&1 &
        PIDS+=($!)
        specs+=("r$i@$url==$replay") names+=("$url=r$i")
        echo "[$policy] replica r$i: $url, $THREADS threads (pid $!)"
    done
    for (( i=0; i<REPLICAS; i++ )); do
        wait_healthy "${names[i]%=*}" "$policy-r$i" "${PIDS[$(( ${#PIDS[@]} - REPLICAS + i ))]}"
    done
    port=$(free_port)
    "$PY" -m chunkcache.cli route "${MODEL_ARGS[@]}" --policy "$policy" --port "$port" \
        --backends "$(IFS=,; echo "${specs[*]}")" --index "redis://127.0.0.1:$REDIS_PORT/$db" \
        --events-bind "$events" --events-topic-filter kv@ --event-workers 2 --health-interval 2 \
        >"$LOGS/$policy-router.log" 2>&1 &
    PIDS+=($!)
    echo "[$policy] router: http://127.0.0.1:$port (pid $!)"
    wait_healthy "http://127.0.0.1:$port" "$policy-router" "$!"
    "$PY" "$HERE/cluster_workload.py" send --router "http://127.0.0.1:$port" --label "$policy" \
        --names "$(IFS=,; echo "${names[*]}")" --rounds "$ROUNDS" --topics "$TOPICS" --out "$WORK/$policy.json"
    # Stop this policy's replicas and router (Redis stays: the next policy uses another db).
    for (( i=${#PIDS[@]}-1; i>=${#REDIS_PIDS[@]}; i-- )); do kill "${PIDS[i]}" 2>/dev/null || true; done
    for (( i=${#REDIS_PIDS[@]}; i<${#PIDS[@]}; i++ )); do wait "${PIDS[i]}" 2>/dev/null || true; done
    PIDS=("${REDIS_PIDS[@]}")
}

run_policy round_robin 0
run_policy cache_aware 1
"$PY" "$HERE/cluster_workload.py" summary "$WORK/round_robin.json" "$WORK/cache_aware.json"
