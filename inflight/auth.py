"""The authentication envelope of the group's messages: an HMAC-SHA256 with a shared secret.

Threat model (see docs/guarantees.md): anyone who can reach the trainer's store (its
TCP port) can read and write every key of it. Without a secret that is enough to announce
and commit weights into a serving engine, or to queue samples the trainer trains on. With
``INFLIGHT_SECRET`` set on the trainer and every engine, each control message, reply, hello,
roster and rollout item is sealed for its key (and the group's incarnation and generation),
every bucket carries a keyed MAC in the (sealed) announce,
so such a client can neither forge nor alter nor replay one; it can still delete or
overwrite keys (denial of service), and it can read them (weights are not secret).
"""

from __future__ import annotations

import hashlib
import hmac
import os

import torch

from inflight.protocol import AuthError

SECRET_ENV = "INFLIGHT_SECRET"
"""Environment variable holding the group's shared secret, on the trainer and on every engine."""
_SEAL = b"IFA1"  # never the start of a msgpack map, so sealed and plain messages are told apart
_MAC_BYTES = 32


def bucket_mac(secret: bytes, context: str, data: torch.Tensor) -> bytes:
    """HMAC-SHA256 of a bucket's bytes (a 1-D uint8 tensor; a device tensor is read through a
    host copy) for ``context`` (its version, index and the group's incarnation). hashlib
    releases the GIL while it hashes, so a worker's MAC check does not hold up decoding."""
    mac = hmac.new(secret, context.encode() + b"\0", hashlib.sha256)
    mac.update(data.cpu().numpy() if data.numel() else b"")
    return mac.digest()


def read_secret() -> bytes | None:
    """The shared secret from ``INFLIGHT_SECRET`` (None when unset or empty: no authentication)."""
    value = os.environ.get(SECRET_ENV, "")
    return value.encode() if value else None


def _mac(secret: bytes, context: str, data: bytes) -> bytes:
    return hmac.new(secret, context.encode() + b"\0" + data, hashlib.sha256).digest()


def seal(data: bytes, secret: bytes | None, context: str) -> bytes:
    """``data`` with an HMAC-SHA256 over it and ``context`` (the store key, with the group's
    incarnation and generation), so a sealed message cannot be forged, altered, or replayed
    under another key or generation. Without a secret, ``data`` unchanged."""
    if secret is None:
        return data
    return _SEAL + _mac(secret, context, data) + data


def unseal(data: bytes, secret: bytes | None, context: str) -> bytes:
    """The message inside a ``seal``; raises ``AuthError`` naming what does not match."""
    data = bytes(data)
    sealed = data[: len(_SEAL)] == _SEAL
    if secret is None:
        if sealed:
            raise AuthError(f"{context}: the message is authenticated (its sender has {SECRET_ENV} set) but "
                            f"{SECRET_ENV} is not set here")
        return data
    if not sealed:
        raise AuthError(f"{context}: unauthenticated message ({SECRET_ENV} is set here; the sender has none, "
                        "or a stray client wrote it)")
    body = data[len(_SEAL) + _MAC_BYTES:]
    if not hmac.compare_digest(data[len(_SEAL): len(_SEAL) + _MAC_BYTES], _mac(secret, context, body)):
        raise AuthError(f"{context}: wrong authentication code (the sender's {SECRET_ENV} differs, or the "
                        "message was forged or altered)")
    return body


