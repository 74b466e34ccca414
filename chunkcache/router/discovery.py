"""Kubernetes pod discovery: the pods matching a label selector are the router's backends.

As llm-d does it (seed 004): list the pods, then watch them from the list's resourceVersion. A pod
is a backend while it is Running, Ready, has an IP and is not being deleted; it stops being one
when it is deleted or stops being ready, and the router then clears its index entries. A watch
that ends (the server's timeout) resumes from the last resourceVersion seen (events and bookmarks);
410 Gone (that version is older than the API server keeps) lists again. Any other failure (API
server unreachable, 401/403, an ERROR event) keeps the last known set, since health checks still
eject a dead pod and dropping every backend because the API server is away would turn a control
plane outage into a serving outage, and retries with exponential backoff, then lists again.

The official client is synchronous, so the loop runs in a thread. Each change hands the whole
discovered set (pod name -> BackendSpec) to `on_change`, which the router runs on its event loop
and reconciles its pool with: a re-list and a watch event are the same operation there, and no
delta can be lost or applied twice.

The `kubernetes` package is imported only when discovery is asked for (the router needs no more).
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkcache.router.backends import BackendSpec

logger = logging.getLogger(__name__)

# llm-d's label for pods that serve inference; deploy/kubernetes/replicas.yaml sets it.
DEFAULT_SELECTOR = "llm-d.ai/inference-serving=true"
_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
RBAC_HINT = (
    "the router's ServiceAccount needs get, list and watch on pods in namespace {namespace} "
    "(deploy/kubernetes/rbac.yaml: Role and RoleBinding chunkcache-router-discovery)"
)


@dataclass(frozen=True)
class DiscoveryConfig:
    selector: str = DEFAULT_SELECTOR
    namespace: str | None = None  # None: the router's own (in a cluster) or the kubeconfig context's
    # Container ports, by name or number: the OpenAI server, the KV event PUB socket (None: the
    # pods connect to the router's --events-bind), the replay socket (None: no replay).
    http_port: str = "http"
    events_port: str | None = None
    replay_port: str | None = None
    kubeconfig: str | None = None  # None: in-cluster config, else the default kubeconfig
    watch_timeout_s: int = 300  # the API server ends a watch after this; it resumes at once
    request_timeout_s: float = 30.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0

    def describe(self, namespace: str | None = None) -> str:
        return f"selector {self.selector!r} in namespace {namespace or self.namespace or '(default)'}"


class PodPortError(ValueError):
    pass


def _port(spec: str, named: Mapping[str, int], pod: str) -> int:
    if spec.isdigit():
        return int(spec)
    if spec not in named:
        raise PodPortError(f"pod {pod} has no container port named {spec!r} (it has {sorted(named)})")
    return named[spec]


def pod_backend(pod: Any, config: DiscoveryConfig) -> BackendSpec | None:
    """The backend a pod (a V1Pod) is, or None while it cannot take requests: not Running, not
    Ready, no IP yet, or being deleted (a deletionTimestamp: it drains, new requests would fail).
    PodPortError when a port named in the config is not among its containers' ports."""
    meta, status, spec = pod.metadata, pod.status, pod.spec
    if meta is None or status is None or spec is None or meta.deletion_timestamp is not None:
        return None
    if status.phase != "Running" or not status.pod_ip:
        return None
    if not any(c.type == "Ready" and c.status == "True" for c in status.conditions or ()):
        return None
    named = {p.name: p.container_port for c in spec.containers or () for p in c.ports or () if p.name}
    host = f"[{status.pod_ip}]" if ":" in status.pod_ip else status.pod_ip
    url = f"http://{host}:{_port(config.http_port, named, meta.name)}"
    events = replay = None
    if config.events_port is not None:
        events = f"tcp://{host}:{_port(config.events_port, named, meta.name)}"
    if config.replay_port is not None:
        replay = f"tcp://{host}:{_port(config.replay_port, named, meta.name)}"
    return BackendSpec(url, meta.name, events, replay)


def connect(config: DiscoveryConfig) -> tuple[Any, str]:
    """(ApiClient, namespace): the kubeconfig when given, else the in-cluster service account,
    else the default kubeconfig. ValueError, in one line, when none of them is there."""
    try:
        from kubernetes import client
        from kubernetes import config as kube_config
    except ImportError:
        raise ValueError("--discover-pods needs the kubernetes client: pip install kubernetes") from None
    configuration = client.Configuration()
    namespace = config.namespace
    try:
        in_cluster = False
        if config.kubeconfig is None:
            try:
                kube_config.load_incluster_config(configuration)
                in_cluster = True
            except kube_config.ConfigException:
                pass  # not in a pod: the default kubeconfig
        if in_cluster:
            if namespace is None and _NAMESPACE_FILE.exists():
                namespace = _NAMESPACE_FILE.read_text().strip()
        else:
            kube_config.load_kube_config(config.kubeconfig, client_configuration=configuration)
            if namespace is None:
                _, active = kube_config.list_kube_config_contexts(config.kubeconfig)
                namespace = (active or {}).get("context", {}).get("namespace")
    except (kube_config.ConfigException, OSError) as e:
        where = config.kubeconfig or "no in-cluster service account, and ~/.kube/config"
        raise ValueError(f"--discover-pods: no Kubernetes configuration ({where}): {e}") from None
    return client.ApiClient(configuration), namespace or "default"


def _status_message(e: Any) -> str:
    """The API server's own words from a Status body (which permission, which selector part)."""
    try:
        message = json.loads(e.body or "{}").get("message")
    except (ValueError, AttributeError):
        return ""
    return f" ({message})" if message else ""


class PodWatcher:
    """The list + watch loop in a daemon thread; `on_change(backends)` gets every new set."""

    def __init__(
        self,
        config: DiscoveryConfig,
        api_client: Any,
        namespace: str,
        on_change: Callable[[dict[str, BackendSpec]], None],
    ) -> None:
        from kubernetes import client

        self.config = config
        self.namespace = namespace
        self.api = client.CoreV1Api(api_client)
        self.on_change = on_change
        self.pods: dict[str, Any] = {}  # name -> V1Pod, every pod the selector matches
        self.backends: dict[str, BackendSpec] = {}  # what on_change got last
        self.lists = 0  # successful lists (the first one, and each after a 410 or a failure)
        self.failures = 0
        self._bad_ports: set[str] = set()  # pods already warned about
        self._stop = threading.Event()
        self._watch: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="pod-discovery", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()  # shuts the socket a blocked read waits on
        if self._thread is not None:
            self._thread.join(timeout)

    def run(self) -> None:
        from kubernetes.client.rest import ApiException

        backoff = self.config.backoff_initial_s
        while not self._stop.is_set():
            try:
                version = self._list()
                backoff = self.config.backoff_initial_s
                while not self._stop.is_set():
                    version = self._watch_from(version)
            except ApiException as e:
                if e.status == 410:
                    logger.info("pod watch expired (410 Gone): listing the pods again")
                    continue
                self._failed(f"HTTP {e.status} {e.reason}{_status_message(e)}", e.status in (401, 403))
            except Exception as e:  # unreachable, TLS, a broken stream: all retried
                if self._stop.is_set():
                    break
                self._failed(f"{type(e).__name__}: {e}", False)
            self._stop.wait(backoff)
            backoff = min(backoff * 2, self.config.backoff_max_s)

    def _failed(self, what: str, denied: bool) -> None:
        self.failures += 1
        hint = "; " + RBAC_HINT.format(namespace=self.namespace) if denied else ""
        logger.error(
            "pod discovery (%s) failed: %s%s; keeping the %d known backends and retrying",
            self.config.describe(self.namespace),
            what,
            hint,
            len(self.backends),
        )

    def _list(self) -> str:
        pods = self.api.list_namespaced_pod(
            self.namespace,
            label_selector=self.config.selector,
            _request_timeout=self.config.request_timeout_s,
        )
        self.lists += 1
        self.pods = {p.metadata.name: p for p in pods.items}
        self._publish()
        if not self.backends:
            logger.warning(
                "no pod matching %s is Running and Ready (%d match): answering 503 until one is",
                self.config.describe(self.namespace),
                len(self.pods),
            )
        return pods.metadata.resource_version

    def _watch_from(self, version: str) -> str:
        """Apply watch events until the stream ends; the resourceVersion to resume from."""
        from kubernetes import watch

        self._watch = w = watch.Watch()
        stream = w.stream(
            self.api.list_namespaced_pod,
            self.namespace,
            label_selector=self.config.selector,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.config.watch_timeout_s,  # also: an ERROR 410 raises, no silent retry
            _request_timeout=(self.config.request_timeout_s, self.config.watch_timeout_s + 30),
        )
        for event in stream:
            if event["type"] in ("ADDED", "MODIFIED"):
                self.pods[event["object"].metadata.name] = event["object"]
            elif event["type"] == "DELETED":
                self.pods.pop(event["object"].metadata.name, None)
            else:
                continue  # BOOKMARK: only a newer resourceVersion, which the Watch keeps
            self._publish()
        return w.resource_version or version

    def _publish(self) -> None:
        backends: dict[str, BackendSpec] = {}
        for name, pod in self.pods.items():
            try:
                spec = pod_backend(pod, self.config)
            except PodPortError as e:
                if name not in self._bad_ports:
                    self._bad_ports.add(name)
                    logger.error("pod discovery: %s; not a backend", e)
                continue
            if spec is not None:
                backends[name] = spec
        if backends == self.backends:
            return
        for name in sorted(backends.keys() - self.backends.keys()):
            logger.info("pod %s is a backend at %s", name, backends[name].url)
        for name in sorted(self.backends.keys() - backends.keys()):
            gone = "deleted" if name not in self.pods else "not ready"
            logger.info("pod %s is no longer a backend: %s", name, gone)
        self.backends = backends
        self.on_change(dict(backends))


def add_discovery_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("pod discovery (Kubernetes; docs/router.md)")
    g.add_argument(
        "--discover-pods",
        action="store_true",
        help="the pods matching --pod-selector are backends while Running and Ready (beside any --backends)",
    )
    g.add_argument("--pod-selector", default=DEFAULT_SELECTOR, help="label selector (default: %(default)s)")
    g.add_argument(
        "--pod-namespace",
        default=None,
        help="default: the router's own namespace in a cluster, else the kubeconfig context's",
    )
    g.add_argument("--pod-http-port", default="http", help="container port name or number of the server")
    g.add_argument(
        "--pod-events-port",
        default=None,
        help="port name or number of a pod's KV event PUB socket, to connect to (default: none, "
        "the pods connect to --events-bind)",
    )
    g.add_argument("--pod-replay-port", default=None, help="port name or number of a pod's replay socket")
    g.add_argument(
        "--kubeconfig",
        default=None,
        help="out of a cluster: the kubeconfig file (default: the in-cluster service account, else ~/.kube/config)",
    )


def discovery_from_args(args: argparse.Namespace) -> DiscoveryConfig | None:
    if not args.discover_pods:
        return None
    return DiscoveryConfig(
        selector=args.pod_selector,
        namespace=args.pod_namespace,
        http_port=args.pod_http_port,
        events_port=args.pod_events_port,
        replay_port=args.pod_replay_port,
        kubeconfig=args.kubeconfig,
    )
