"""Sparse updates: an update sent as the elements that changed against a version the engine
already holds, on both sides of the wire.

Each tensor travels as its changes against the base where that is smaller than the tensor itself (any
other tensor travels whole), in one of two codecs (``SparseCodec``); why it pays: docs/design.md.
- ``xor_zstd``: the tensor's bits xor the base's, zstd-compressed (level 1) and decompressed on the host: the
  codec of a gloo (host) data plane;
- ``index``: the flat int32 indices of the elements whose bits changed and their new values (``4 + itemsize``
  bytes each), encoded and rebuilt on the tensors' device, no host round trip: the codec of an NCCL data plane.
The update is otherwise an ordinary one: the same announce, buckets, checksums, MAC, two phases and commit.

Trainer (``DeltaEncoder``): keeps the wire bytes of the last ``keep`` versions it laid out (the cast it
would have sent), and encodes the next version against the one an engine serves. Nothing is read from the
caller's tensors after ``encode`` returns.

Worker (``DeltaDecoder``): keeps the live version's bytes (``InflightConfig.keep_base``;
``StagingPool.base_for``), and rebuilds each tensor as its wire tensors verify: the base copied, the changed
elements written. Each rebuilt tensor's checksum must equal the one the trainer took of the same tensor, so
a wrong base or a bad write is caught on the result, not the delta. A worker that does not hold the announced
base version refuses the update (``wrong_base``), naming what it holds; the trainer then sends it dense.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec
import torch
import zstandard

from inflight.protocol import ALIGN, Changed, ChecksumAlgo, Delta, SparseCodec, UpdateAnnounce
from inflight.transport.bucket import bucket_specs, checksum, dtype_name, plan_tensors, tensor_views, torch_dtype
from inflight.transport.errors import UpdateRejected

INDEX, VALUES, XOR = "@index", "@values", "@xor"
"""Suffixes of a changed tensor's wire tensors (``'<name>@index'``); no parameter name holds an ``@``."""
ZSTD_LEVEL = 1  # level 3 compressed SmolLM2's RL steps no smaller (2.83% both) and took longer
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_NUMEL = 2**31 - 1  # int32 indices


@dataclass(frozen=True)
class Encoded:
    """One version encoded against a base: the wire tensors to send and their ``Delta``."""

    wire: dict[str, torch.Tensor]
    delta: Delta
    dense_bytes: int
    """What the dense update of the same weights lays out (alignment included)."""
    wire_bytes: int
    changed: int
    """Elements that changed against the base, over every tensor."""
    elements: int
    encode_s: float


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of its element size (-0.0 differs from 0.0; NaN equals itself)."""
    return t.view(_BITS[t.element_size()])


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class DeltaEncoder:
    """Trainer side: the wire bytes of the last ``keep`` versions laid out, and each next
    version encoded against the one an engine serves. Shared by a fleet's pushers (one copy
    per version for every engine); thread-safe."""

    def __init__(self, keep: int = 2) -> None:
        if keep < 2:
            raise ValueError(f"DeltaEncoder keep={keep}: the base and the version encoded against it are 2")
        self.keep = keep
        self._versions: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._encoded: dict[tuple[int, int, str], Encoded] = {}  # (version, base, checksum + codec)
        self._lock = threading.Lock()

    def has(self, version: int) -> bool:
        with self._lock:
            return version in self._versions

    def record(self, version: int, named: Mapping[str, torch.Tensor],
               wire: Mapping[str, str]) -> dict[str, torch.Tensor]:
        """The wire bytes of ``version``: each tensor cast to its wire dtype (``wire``), copied
        (the caller may write its tensors once this returns); kept for the next versions."""
        with self._lock:
            if version in self._versions:
                return self._versions[version]
        with torch.no_grad():
            cast = {n: t.detach().to(torch_dtype(wire[n]), copy=True).contiguous() for n, t in named.items()}
        with self._lock:
            self._versions[version] = cast
            while len(self._versions) > self.keep:
                old, _ = self._versions.popitem(last=False)
                self._encoded = {k: e for k, e in self._encoded.items() if old not in k[:2]}
        return cast

    def encode(self, version: int, named: Mapping[str, torch.Tensor], wire: Mapping[str, str], base_version: int,
               algo: ChecksumAlgo, codec: SparseCodec) -> Encoded | None:
        """``version`` against ``base_version``'s bytes in ``codec``; None where this encoder no
        longer holds them, their names or shapes differ, or no tensor is smaller sent sparse
        (send dense)."""
        t0 = time.perf_counter()
        with self._lock:  # before recording ``version``, which may drop the oldest
            base = self._versions.get(base_version)
            done = self._encoded.get((version, base_version, algo + codec))
        new = self.record(version, named, wire)
        if done is not None:
            return done
        if base is None or base_version == version or base.keys() != new.keys() or \
                any((b.shape, b.dtype) != (new[n].shape, new[n].dtype) for n, b in base.items()):
            return None
        out: dict[str, torch.Tensor] = {}
        changed: list[Changed] = []
        counts = [0, 0]
        encode_one = _encode_xor if codec == "xor_zstd" else _encode_index
        for name, t in new.items():
            if not encode_one(name, t, base[name], algo, out, changed, counts):
                out[name] = t
        if not changed:
            return None
        result, result_bytes = plan_tensors((n, tuple(t.shape), wire[n]) for n, t in new.items())
        _, wire_bytes = plan_tensors((n, tuple(t.shape), dtype_name(t.dtype)) for n, t in out.items())
        encoded = Encoded(wire=out, delta=Delta(base_version=base_version, result=result, result_bytes=result_bytes,
                                                changed=tuple(changed)),
                          dense_bytes=result_bytes, wire_bytes=wire_bytes, changed=counts[0], elements=counts[1],
                          encode_s=time.perf_counter() - t0)
        with self._lock:
            self._encoded[(version, base_version, algo + codec)] = encoded
        return encoded

    def versions(self) -> list[int]:
        with self._lock:
            return list(self._versions)

    def wire_of(self, version: int) -> dict[str, torch.Tensor] | None:
        """The recorded wire bytes of ``version`` (what a dense resend reads), or None."""
        with self._lock:
            return self._versions.get(version)


def _encode_index(name: str, new: torch.Tensor, base: torch.Tensor, algo: ChecksumAlgo, out: dict[str, torch.Tensor],
                  changed: list[Changed], counts: list[int]) -> bool:
    """Add ``name``'s index and values to ``out`` if they are smaller than the tensor; count
    its changed and total elements either way."""
    flat = new.reshape(-1)
    index = (_bits(flat) != _bits(base.reshape(-1))).nonzero().reshape(-1)
    counts[0] += index.numel()
    counts[1] += flat.numel()
    sparse = _aligned(index.numel() * 4) + _aligned(index.numel() * new.element_size())
    if flat.numel() > _MAX_NUMEL or sparse >= _aligned(new.numel() * new.element_size()):
        return False
    out[name + INDEX] = index.to(torch.int32)
    out[name + VALUES] = flat[index]
    changed.append(Changed(name=name, index=name + INDEX, values=name + VALUES,
                           digest=checksum(flat.view(torch.uint8), algo)))
    return True


def _encode_xor(name: str, new: torch.Tensor, base: torch.Tensor, algo: ChecksumAlgo, out: dict[str, torch.Tensor],
                changed: list[Changed], counts: list[int]) -> bool:
    """Add ``name``'s xor against the base, zstd-compressed, to ``out`` if it is smaller than
    the tensor; count its changed and total elements either way."""
    flat = new.reshape(-1)
    xor = (_bits(flat) ^ _bits(base.reshape(-1))).cpu()
    counts[0] += int(torch.count_nonzero(xor))
    counts[1] += flat.numel()
    frame = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(xor.numpy())  # the GIL is released while it runs
    if _aligned(len(frame)) >= _aligned(new.numel() * new.element_size()):
        return False
    out[name + XOR] = torch.frombuffer(bytearray(frame), dtype=torch.uint8).to(new.device)
    changed.append(Changed(name=name, values=name + XOR, digest=checksum(flat.view(torch.uint8), algo),
                           codec="xor_zstd"))
    return True


def result_announce(a: UpdateAnnounce) -> UpdateAnnounce:
    """The dense announce of the weights a sparse update ``a`` rebuilds: what staging holds,
    what the engine's schema checks and what the commit reads."""
    assert a.delta is not None
    d = a.delta
    return msgspec.structs.replace(a, tensors=d.result, total_bytes=d.result_bytes,
                                   buckets=bucket_specs(d.result_bytes, a.bucket_bytes), delta=None)


class DeltaDecoder:
    """Worker side: rebuilds a sparse update's tensors in ``result`` (a flat buffer laid out
    by ``result_announce``) from its wire tensors in ``wire`` and the ``base`` views, as the
    wire tensors complete."""

    def __init__(self, a: UpdateAnnounce, wire: torch.Tensor, result: torch.Tensor,
                 base: Mapping[str, torch.Tensor]) -> None:
        assert a.delta is not None
        self.announce, self.base = a, base
        self.wire = tensor_views(wire, a.tensors)
        self.result = tensor_views(result, a.delta.result)
        self._by_values = {c.values: c for c in a.delta.changed}

    def decode(self, wire_names: list[str]) -> list[str]:
        """Rebuild the result tensors that ``wire_names`` (just verified) complete; their names.
        Raises ``UpdateRejected`` (``checksum``) where a rebuilt tensor is not the trainer's."""
        done = []
        with torch.no_grad():
            for w in wire_names:
                if w in self.result:  # sent whole
                    self.result[w].copy_(self.wire[w])
                    done.append(w)
                elif (c := self._by_values.get(w)) is not None:
                    self._rebuild(c)
                    done.append(c.name)
        return done

    def _rebuild(self, c: Changed) -> None:
        out = self.result[c.name].reshape(-1)
        out.copy_(self.base[c.name].reshape(-1))
        if c.codec == "index":
            out.index_copy_(0, self.wire[c.index].to(torch.int64), self.wire[c.values])
        else:
            _bits(out).bitwise_xor_(self._xor(c, out))
        got = checksum(out.view(torch.uint8), self.announce.checksum_algo)
        if got != c.digest:
            raise UpdateRejected("checksum", f"v{self.announce.version}: {c.name} rebuilt on "
                                             f"v{self.announce.delta.base_version} has checksum {got:#x}, the "
                                             f"trainer's is {c.digest:#x}")


    def _xor(self, c: Changed, out: torch.Tensor) -> torch.Tensor:
        """``c``'s xor, decompressed from its zstd frame (checked to be exactly the tensor's size)."""
        nbytes = out.numel() * out.element_size()
        try:
            raw = zstandard.ZstdDecompressor().decompress(self.wire[c.values].cpu().numpy(), max_output_size=nbytes)
        except zstandard.ZstdError as e:
            raise UpdateRejected("bad_layout", f"v{self.announce.version}: {c.name}: its zstd frame does not "
                                               f"decompress: {e}") from e
        if len(raw) != nbytes:
            raise UpdateRejected("bad_layout", f"v{self.announce.version}: {c.name}: its xor has {len(raw)} bytes, "
                                               f"the tensor {nbytes}")
        return torch.frombuffer(bytearray(raw), dtype=_BITS[out.element_size()]).to(out.device)


def base_mismatch(a: UpdateAnnounce, base: Mapping[str, torch.Tensor] | None, held: int | None) -> str | None:
    """Why the base bytes this worker holds (of version ``held``; None: none) cannot rebuild
    ``a``, or None."""
    assert a.delta is not None
    want = a.delta.base_version
    if base is None or held != want:
        have = "no base bytes" if held is None else f"the bytes of v{held}"
        return f"v{a.version} is a sparse update against v{want}, and this worker holds {have}: send it dense"
    specs = {r.name: r for r in a.delta.result}
    for c in a.delta.changed:
        spec = specs[c.name]
        b = base.get(c.name)
        if b is None or tuple(b.shape) != spec.shape or dtype_name(b.dtype) != spec.dtype:
            return (f"v{a.version}: {c.name} changes against v{want}, whose bytes here do not hold it as "
                    f"{spec.dtype}{list(spec.shape)}")
    return None
