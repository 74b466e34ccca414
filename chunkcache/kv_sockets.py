"""What both ends of the KV event sockets agree on besides the payload (`kv_events.py`): the
replay protocol's frames and the rule for which endpoints may be bound without CURVE. The engine's
publisher (`kv_publisher.py`) serves replays and binds; the router (`router/events.py`) asks for
replays and binds its own SUB socket.

Replay, vLLM's current protocol (0.33): a ROUTER socket takes `[identity, b"", start_seq (8 bytes)]`
and answers one `[identity, b"", topic, seq, payload]` per buffered batch with seq >= start, then
the end marker `[identity, b"", b"", -1 (8 bytes, signed), b""]`. vLLM 0.10 answered without the
topic frame (`[identity, b"", seq, payload]`, end `[identity, b"", -1, b""]`); `read_replay_reply`
reads both. Clients use a DEALER socket and send `[b"", start_seq]`, so every reply arrives (a REQ
socket would accept only the first one). A request may add a fourth frame naming the topic to
replay (this project's extension, for the chunk stream); without it the vLLM stream is served.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Seq of the replay end marker: -1 as a signed 8-byte big-endian int.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass
class ReplayReply:
    """One reply frame set read by a replay client (DEALER): a batch, or the end marker."""

    seq: int
    payload: bytes
    topic: bytes | None  # None in vLLM 0.10's layout, which has no topic frame
    end: bool


def read_replay_reply(frames: Sequence[bytes]) -> ReplayReply | None:
    """A replay reply as a DEALER receives it, in either vLLM layout; None if it is neither.

    vLLM 0.33: `[b"", topic, seq, payload]`, end `[b"", b"", END_SEQ, b""]`.
    vLLM 0.10: `[b"", seq, payload]`, end `[b"", END_SEQ, b""]`.
    """
    if len(frames) == 4 and frames[0] == b"" and len(frames[2]) == 8:
        _, topic, seq_bytes, payload = frames
    elif len(frames) == 3 and frames[0] == b"" and len(frames[1]) == 8:
        _, seq_bytes, payload = frames
        topic = None
    else:
        return None
    if seq_bytes == END_SEQ:
        return ReplayReply(-1, b"", topic, True)
    return ReplayReply(int.from_bytes(seq_bytes, "big"), payload, topic, False)


def replay_request(start_seq: int, topic: str | None = None) -> list[bytes]:
    """The frames a DEALER sends to ask for batches from `start_seq` on (vLLM's request; a topic
    frame asks this project's publisher for another stream than vLLM's)."""
    frames = [b"", start_seq.to_bytes(8, "big")]
    if topic is not None:
        frames.append(topic.encode())
    return frames


_WILDCARD_HOSTS = {"*": "127.0.0.1", "0.0.0.0": "127.0.0.1", "[::]": "[::1]", "::": "[::1]"}
_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]", "::1"})


def guarded_bind_endpoint(endpoint: str, *, secured: bool, insecure: bool, flag: str) -> str:
    """The endpoint to bind a KV-event socket on. Without CURVE anyone who reaches such a socket
    reads other clients' prompt token ids (PUB, replay) or forges events (a router's SUB), so a
    wildcard host binds loopback only, and any other non-loopback address is refused, unless
    `insecure` (the command line's `flag`) says that is meant; that case logs a warning.
    ipc:// and inproc:// endpoints are local and kept."""
    if not endpoint.startswith("tcp://") or secured:
        return endpoint
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not sep or host in _LOOPBACK_HOSTS or host.startswith("127."):
        return endpoint
    if insecure:
        logger.warning(
            "KV events: %s is bound on a non-loopback address without CURVE (%s): anyone who can reach "
            "it reads cached prompts' token ids or forges events",
            endpoint,
            flag,
        )
        return endpoint
    if host in _WILDCARD_HOSTS:
        bound = f"tcp://{_WILDCARD_HOSTS[host]}:{port}"
        logger.info("KV events: binding %s on loopback (no CURVE keys; %s binds every address)", bound, flag)
        return bound
    raise ValueError(
        f"KV event endpoint {endpoint} binds a non-loopback address without CURVE: configure CURVE "
        f"keys, bind 127.0.0.1, or pass {flag} to accept unauthenticated access"
    )
