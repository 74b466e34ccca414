"""ZMQ CURVE authentication for the KV event and replay sockets, with keys given by file.

Without it, anyone who reaches an event socket can publish into the router's index (fake cache
hits, forged restarts that wipe a pod). Keys are zmq.auth certificate files (`zmq.auth.
create_certificates(dir, name)` writes `name.key`, the public half, and `name.key_secret`):

- the side that binds is the CURVE server: its own secret certificate, and a directory of the
  public keys (`*.key`) allowed to connect; a ZAP handler refuses every other key;
- the side that connects is the client: its own secret certificate and the server's public key.

A ZAP handler is one per ZMQ context, so a side with CURVE uses a context of its own.
The User-Id of an authenticated message is its sender's public key (z85), which
`authorized_keys` maps back to the key file's name: the router uses that to check that a publisher
on its bound socket only speaks for itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


@dataclass(frozen=True)
class CurveKeys:
    """One side's key pair (z85), from a zmq.auth secret certificate file."""

    public: bytes
    secret: bytes

    @classmethod
    def load(cls, path: str | Path) -> CurveKeys:
        public, secret = _load(path)
        if secret is None:
            raise ValueError(f"{path} holds no secret key: give the '.key_secret' certificate file")
        return cls(public, secret)


def load_public_key(path: str | Path) -> bytes:
    public, _ = _load(path)
    return public


def _load(path: str | Path) -> tuple[bytes, bytes | None]:
    if not zmq.has("curve"):
        raise ValueError("this libzmq was built without CURVE support")
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the CURVE certificate {path}: {e}") from None


def authorized_keys(directory: str | Path) -> dict[str, str]:
    """z85 public key (the User-Id of its messages) -> its file's name, for every `*.key` file."""
    found = {load_public_key(p).decode("ascii"): p.stem for p in sorted(Path(directory).glob("*.key"))}
    if not found:
        raise ValueError(f"no public key files (*.key) in {directory}")
    return found


class CurveServer:
    """Authenticates the peers that connect to this side's bound sockets."""

    def __init__(self, context: zmq.Context, keys: CurveKeys, authorized_dir: str | Path) -> None:
        self.keys = keys
        self.owners = authorized_keys(authorized_dir)
        self._auth = ThreadAuthenticator(context)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=str(authorized_dir))

    def secure(self, sock: zmq.Socket) -> None:
        """Call before bind."""
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_server = True

    def close(self) -> None:
        self._auth.stop()


def secure_client(sock: zmq.Socket, keys: CurveKeys, server_public: bytes) -> None:
    """Call before connect."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = server_public
