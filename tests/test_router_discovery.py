"""Kubernetes pod discovery (router/discovery.py) against a fake API server on loopback that
answers as the real one does: a PodList, then a watch stream of newline-delimited ADDED /
MODIFIED / DELETED / BOOKMARK events ending in an ERROR 410 Gone, then the re-list; 403 Forbidden
Status objects. The client is the official `kubernetes` client (a Configuration or a kubeconfig
pointing at http://127.0.0.1:PORT), so the list, watch, resourceVersion and error paths are its
own; the router under test is the real one, with a fake OpenAI backend and a real KV publisher."""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from chunkcache.kv_events import BlockStored
from chunkcache.kv_publisher import KVEventPublisher
from chunkcache.router.app import add_route_arguments, config_from_args, create_app
from chunkcache.router.backends import BackendSpec
from chunkcache.router.config import RouterConfig
from chunkcache.router.discovery import DiscoveryConfig, PodWatcher, pod_backend
from chunkcache.router.service import Router
from tests.support.kube_api import FORBIDDEN, GONE, NS, SELECTOR, FakeApiServer, kubeconfig, pod, pod_list
from tests.support.server_util import ServerThread, free_port
from tests.test_router_app import MODEL, engine_events, fake_backend, metric, tokenizer_dir, wait_for, words

kubernetes = pytest.importorskip("kubernetes", reason="discovery uses the official kubernetes client")
from kubernetes import client  # noqa: E402

pytestmark = pytest.mark.server
_ = tokenizer_dir  # a fixture of test_router_app, used here too


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    yield server
    server.close()


def fast(**kw: Any) -> DiscoveryConfig:
    return DiscoveryConfig(
        selector=SELECTOR,
        namespace=NS,
        replay_port="kv-replay",
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
        **kw,
    )


def start_watcher(
    host: str, config: DiscoveryConfig
) -> tuple[PodWatcher, queue.Queue[dict[str, BackendSpec]]]:
    sets: queue.Queue[dict[str, BackendSpec]] = queue.Queue()
    watcher = PodWatcher(config, client.ApiClient(client.Configuration(host=host)), NS, sets.put)
    watcher.start()
    return watcher, sets


def next_set(sets: queue.Queue[dict[str, BackendSpec]]) -> set[str]:
    return set(sets.get(timeout=5))


# --- the discovery loop -------------------------------------------------------------------------


def test_list_watch_and_relist_after_410(api: FakeApiServer) -> None:
    api.lists = [
        (200, pod_list("100", pod("a", 8001), pod("b", 8002, ready=False), pod("p", phase="Pending"))),
        (200, pod_list("200", pod("b", 8002, rv="190"), pod("d", 8004, rv="199"))),
    ]
    first, second, third = api.watch(), api.watch(), api.watch()
    watcher, sets = start_watcher(api.url, fast())
    try:
        got = sets.get(timeout=5)  # the list: only the Running and Ready pod with an IP
        assert got == {"a": BackendSpec("http://127.0.0.1:8001", "a", None, "tcp://127.0.0.1:5558")}
        steps = [
            ({"type": "ADDED", "object": pod("c", 8003, rv="110")}, {"a", "c"}),
            ({"type": "MODIFIED", "object": pod("b", 8002, rv="120")}, {"a", "b", "c"}),
            ({"type": "MODIFIED", "object": pod("a", 8001, ready=False, rv="130")}, {"b", "c"}),
            ({"type": "MODIFIED", "object": pod("c", 8003, deleting=True, rv="140")}, {"b"}),
            ({"type": "MODIFIED", "object": pod("a", 8001, rv="145")}, {"a", "b"}),
            ({"type": "DELETED", "object": pod("a", 8001, rv="150")}, {"b"}),
        ]
        for event, expected in steps:
            first.put(event)
            assert next_set(sets) == expected, event
        # Deleting a pod that was not a backend (c was draining) changes nothing: no new set.
        first.put({"type": "DELETED", "object": pod("c", 8003, deleting=True, rv="155")})
        first.put({"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {"resourceVersion": "160"}}})
        first.put(GONE)
        # 410: the watch cannot resume, so the pods are listed again and watched from the new list.
        assert next_set(sets) == {"b", "d"}
        wait_for(lambda: len(api.watch_requests()) == 2)
        assert api.watch_requests()[0]["resourceVersion"] == "100"
        assert api.watch_requests()[1]["resourceVersion"] == "200"
        assert [q.get("resourceVersion") for q in api.list_requests()] == [None, None]
        # A watch that simply ends (the server's timeout) resumes from the last version seen.
        second.put({"type": "MODIFIED", "object": pod("d", 8004, ready=False, rv="210")})
        assert next_set(sets) == {"b"}
        second.put(None)
        wait_for(lambda: len(api.watch_requests()) == 3)
        assert api.watch_requests()[2]["resourceVersion"] == "210"
        assert api.watch_requests()[2]["allowWatchBookmarks"] == "true"
        assert watcher.lists == 2 and watcher.failures == 0
        third.put({"type": "DELETED", "object": pod("b", 8002, rv="220")})
        assert next_set(sets) == set()
    finally:
        watcher.stop()
    assert sets.empty()


def test_forbidden_is_logged_with_the_rbac_hint_and_retried_with_backoff(
    api: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    api.lists = [(403, FORBIDDEN), (403, FORBIDDEN), (403, FORBIDDEN), (200, pod_list("5", pod("a", 8001)))]
    api.watch()
    with caplog.at_level(logging.ERROR, logger="chunkcache.router.discovery"):
        watcher, sets = start_watcher(api.url, fast())
        try:
            assert next_set(sets) == {"a"}
        finally:
            watcher.stop()
    assert watcher.failures == 3
    errors = [r.getMessage() for r in caplog.records]
    assert len(errors) == 3
    assert all("HTTP 403" in m and "get, list and watch on pods in namespace serving" in m for m in errors)
    assert all("deploy/kubernetes/rbac.yaml" in m and 'cannot list resource "pods"' in m for m in errors)
    times = [t for t, q in api.requests if q.get("watch") != "true"]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1 and gaps[2] >= 0.2  # doubling, capped at 0.2
    assert gaps[2] < 2.0


def test_unreachable_api_server_is_retried(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="chunkcache.router.discovery"):
        watcher, sets = start_watcher(f"http://127.0.0.1:{free_port()}", fast())
        try:
            wait_for(lambda: watcher.failures >= 3, timeout=20)
        finally:
            watcher.stop()
    assert sets.empty()
    assert "RBAC" not in caplog.text and "rbac.yaml" not in caplog.text  # not a permission problem
    assert "keeping the 0 known backends and retrying" in caplog.text


def test_pod_ports_by_name_or_number() -> None:
    from kubernetes.client import ApiClient

    deserialize = ApiClient()._ApiClient__deserialize
    good = deserialize(pod("a", 8001), "V1Pod")
    spec = pod_backend(good, DiscoveryConfig(events_port="7000", replay_port="kv-replay"))
    assert spec == BackendSpec("http://127.0.0.1:8001", "a", "tcp://127.0.0.1:7000", "tcp://127.0.0.1:5558")
    assert pod_backend(good, DiscoveryConfig(events_port="kv-events")).events == "tcp://127.0.0.1:5557"
    # A name the pod lacks is that pod's error (the watcher logs it and skips the pod).
    with pytest.raises(ValueError, match="no container port named 'zmq'"):
        pod_backend(good, DiscoveryConfig(events_port="zmq"))


# --- the router with discovered backends --------------------------------------------------------


def route_config(tokenizer_dir: str, kubeconfig_path: str, *argv: str) -> RouterConfig:
    import argparse

    parser = argparse.ArgumentParser()
    add_route_arguments(parser)
    args = parser.parse_args(
        [
            "--tokenizer",
            tokenizer_dir,
            "--model-name",
            MODEL,
            "--discover-pods",
            "--kubeconfig",
            kubeconfig_path,
        ]
        + ["--pod-selector", SELECTOR, "--health-interval", "0", *argv]
    )
    config = config_from_args(args)
    assert config.discovery is not None and config.discovery.namespace is None  # from the kubeconfig
    fast_backoff = {"backoff_initial_s": 0.05, "backoff_max_s": 0.2}
    return RouterConfig(
        **{**vars(config), "discovery": DiscoveryConfig(**{**vars(config.discovery), **fast_backoff})}
    )


def test_requests_wait_for_a_discovered_pod_and_its_index_entries_go_with_it(
    api: FakeApiServer, tokenizer_dir: str, tmp_path: Path
) -> None:
    backend = ServerThread(fake_backend("r1")).start()
    api.lists = [(200, pod_list("10"))]  # the selector matches nothing yet
    events = api.watch()
    config = route_config(tokenizer_dir, kubeconfig(tmp_path, api.url), "--events-bind", "tcp://127.0.0.1:0")
    body = {"model": MODEL, "prompt": words(48, 100), "max_tokens": 2}
    try:
        with TestClient(create_app(Router(config))) as http:
            router: Router = http.app.state.router
            assert router.discovery is not None and router.discovery.namespace == NS
            assert router.intake is not None and router.intake.bound_endpoint is not None
            wait_for(lambda: router.discovery.lists == 1)
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["code"] == "no_backend" and SELECTOR in error["message"] and NS in error["message"]
            assert http.get("/health").status_code == 503
            assert http.get("/v1/models").status_code == 503
            # A pod's events before it is a backend are refused; once discovered they count.
            pub = KVEventPublisher(router.intake.bound_endpoint, topic=f"kv@r1@{MODEL}", bind=False)
            ids = router.processor.tokenizer.encode(body["prompt"])
            stored: list[BlockStored] = engine_events(ids)
            wait_for(lambda: (pub.publish(stored), router.intake.stats().unknown_topics > 0)[1])
            events.put({"type": "ADDED", "object": pod("r1", backend.port, phase="Pending", ready=False)})
            events.put({"type": "MODIFIED", "object": pod("r1", backend.port)})
            wait_for(lambda: "r1" in router.pool.ids)
            wait_for(
                lambda: (
                    pub.publish(stored),
                    http.post("/score", json=body).json()["scores"]["r1"]["score"] > 0,
                )[1]
            )
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.headers["x-chunkcache-backend"] == "r1"
            assert http.get("/health").json()["backends"] == {"r1": True}
            assert metric(http, "chunkcache_router_discovered_backends") == 1
            # Not ready any more: no backend, its entries cleared, its topic refused again.
            events.put({"type": "MODIFIED", "object": pod("r1", backend.port, ready=False)})
            wait_for(lambda: not router.pool.ids)
            assert router.intake.wait_idle()
            wait_for(lambda: not router.index.dump().blocks)  # the forgetting runs on the pod's worker
            assert router.index.stats().removals == 3  # the prompt's three blocks
            assert "r1" not in (router.intake.allowed_pods or ())
            assert http.post("/v1/completions", json=body).status_code == 503
            pub.close()
    finally:
        backend.stop()


def test_a_discovered_pods_event_socket_is_subscribed_until_it_goes(
    api: FakeApiServer, tokenizer_dir: str, tmp_path: Path
) -> None:
    pub = KVEventPublisher("tcp://127.0.0.1:0", topic=f"kv@r2@{MODEL}")
    events_port = int(pub.endpoint.rsplit(":", 1)[1])
    api.lists = [(200, pod_list("10", pod("r2", free_port(), events_port=events_port)))]
    events = api.watch()
    config = route_config(tokenizer_dir, kubeconfig(tmp_path, api.url), "--pod-events-port", "kv-events")
    body = {"prompt": words(32, 500)}
    try:
        with TestClient(create_app(Router(config))) as http:
            router: Router = http.app.state.router
            assert router.intake is not None
            wait_for(lambda: "r2" in router.pool.ids)
            ids = router.processor.tokenizer.encode(body["prompt"])
            wait_for(
                lambda: (
                    pub.publish(engine_events(ids)),
                    http.post("/score", json=body).json()["scores"]["r2"]["prefix_blocks"] == 2,
                )[1]
            )
            events.put({"type": "DELETED", "object": pod("r2", events_port=events_port)})
            wait_for(lambda: not router.pool.ids)
            assert router.intake.wait_idle()
            wait_for(lambda: not router.index.dump().blocks)
            # Unsubscribed: what it publishes now never reaches the index.
            applied = router.intake.stats().batches
            for _ in range(5):
                pub.publish(engine_events(ids))
                time.sleep(0.05)
            assert router.intake.wait_idle() and router.intake.stats().batches == applied
            assert not router.index.dump().blocks
    finally:
        pub.close()


def test_static_backends_keep_serving_while_discovery_is_denied(
    api: FakeApiServer, tokenizer_dir: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = ServerThread(fake_backend("static")).start()
    api.lists = [(403, FORBIDDEN)]
    config = route_config(tokenizer_dir, kubeconfig(tmp_path, api.url), "--backends", f"static@{backend.url}")
    try:
        logs = caplog.at_level(logging.ERROR, logger="chunkcache.router.discovery")
        with logs, TestClient(create_app(Router(config))) as http:
            router: Router = http.app.state.router
            wait_for(lambda: router.discovery.failures >= 2)
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "w1 w2"})
            assert r.status_code == 200 and r.headers["x-chunkcache-backend"] == "static"
            assert http.get("/health").status_code == 200
            assert metric(http, "chunkcache_router_discovery_failures_total") >= 2
        assert "rbac.yaml" in caplog.text and "keeping the 0 known backends" in caplog.text
    finally:
        backend.stop()


def test_discovery_without_configuration_is_one_clear_line(tmp_path: Path) -> None:
    from chunkcache.router.discovery import connect

    with pytest.raises(ValueError, match="no Kubernetes configuration") as e:
        connect(DiscoveryConfig(kubeconfig=str(tmp_path / "missing")))
    assert "\n" not in str(e.value)
