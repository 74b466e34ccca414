"""A fake Kubernetes API server on loopback for the router's pod discovery tests: it answers pod
lists and watches in the API server's own shapes (a PodList; a chunked watch stream, one JSON event
per line; Status objects for errors), so the official client runs its real list, watch,
resourceVersion and error paths against it. The responses are modelled on what a real API server
sends for `GET /api/v1/namespaces/NS/pods?labelSelector=...[&watch=true&resourceVersion=...]`."""

from __future__ import annotations

import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

NS = "serving"
SELECTOR = "llm-d.ai/inference-serving=true"


def pod(
    name: str,
    port: int = 8000,
    phase: str = "Running",
    ready: bool = True,
    rv: str = "1",
    deleting: bool = False,
    events_port: int = 5557,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": NS,
        "uid": f"uid-{name}",
        "resourceVersion": rv,
        "labels": {"llm-d.ai/inference-serving": "true"},
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-11-27T05:00:00Z"
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if phase == "Running":
        status["podIP"] = "127.0.0.1"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "containers": [
                {
                    "name": "serve",
                    "image": "chunkcache",
                    "ports": [
                        {"name": "http", "containerPort": port},
                        {"name": "kv-events", "containerPort": events_port},
                        {"name": "kv-replay", "containerPort": 5558},
                    ],
                }
            ]
        },
        "status": status,
    }


def pod_list(rv: str, *pods: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": rv}, "items": list(pods)}


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


FORBIDDEN = status(
    403,
    "Forbidden",
    f'pods is forbidden: User "system:serviceaccount:{NS}:default" cannot list resource "pods" in API '
    f'group "" in the namespace "{NS}"',
)
GONE = {"type": "ERROR", "object": status(410, "Expired", "too old resource version: 100 (150)")}


class FakeApiServer:
    """GET /api/v1/namespaces/NS/pods: list answers from `lists` (the last one repeats), watches
    stream what the test puts on the watch's queue (None ends the stream); every request is kept."""

    def __init__(self) -> None:
        self.lists: list[tuple[int, dict[str, Any]]] = []
        self.watches: queue.Queue[queue.Queue[dict[str, Any] | None]] = queue.Queue()
        self.requests: list[tuple[float, dict[str, str]]] = []
        self.closed = threading.Event()
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # a watch is a chunked response, one event per line

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                url = urlparse(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                api.requests.append((time.monotonic(), query))
                if url.path != f"/api/v1/namespaces/{NS}/pods" or query.get("labelSelector") != SELECTOR:
                    return self._send(404, status(404, "NotFound", f"no {url.path}"))
                if query.get("watch") != "true":
                    code, body = api.lists.pop(0) if len(api.lists) > 1 else api.lists[0]
                    return self._send(code, body)
                events = api.watches.get(timeout=10)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Connection", "close")
                self.end_headers()
                while not api.closed.is_set():
                    try:
                        event = events.get(timeout=0.1)
                    except queue.Empty:
                        continue
                    if event is None:
                        break
                    line = json.dumps(event).encode() + b"\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def watch(self) -> queue.Queue[dict[str, Any] | None]:
        """The next watch request's event stream."""
        events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.watches.put(events)
        return events

    def list_requests(self) -> list[dict[str, str]]:
        return [q for _, q in self.requests if q.get("watch") != "true"]

    def watch_requests(self) -> list[dict[str, str]]:
        return [q for _, q in self.requests if q.get("watch") == "true"]

    def close(self) -> None:
        self.closed.set()
        self.server.shutdown()
        self.server.server_close()


def kubeconfig(tmp_path: Path, server: str) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": server}}],
                "users": [{"name": "me", "user": {}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "me", "namespace": NS}}],
                "current-context": "fake",
            }
        )
    )
    return str(path)
