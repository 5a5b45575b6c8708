"""Wire protocol: every message round-trips; malformed input fails with a clear error."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import msgspec
import pytest

from inflight import protocol as P
from inflight.transport.bucket import bucket_windows, plan_tensors


def _announce(**over) -> P.UpdateAnnounce:
    tensors, total = plan_tensors([("a.weight", (4, 8), "float32"), ("b.bias", (3,), "bfloat16")])
    buckets = tuple(P.BucketSpec(index=i, offset=o, nbytes=n) for i, (o, n) in enumerate(bucket_windows(total, 64)))
    fields = dict(version=3, total_bytes=total, bucket_bytes=64, checksum_algo="crc32", tensors=tensors,
                  buckets=buckets)
    fields.update(over)
    return P.UpdateAnnounce(**fields)


MESSAGES = [
    _announce(),
    P.Commit(version=3),
    P.Abort(version=3, reason="trainer restarted"),
    P.Shutdown(reason="done"),
    P.BucketHeader(version=3, index=1, offset=64, nbytes=64, checksum=2**63 + 5),
    P.Accepted(rank=1, version=3),
    P.Joined(rank=1, live_version=7, incarnation="a1b2"),
    P.Staged(rank=1, version=3, receive_ms=1.5, steps_during_transfer=4),
    P.Rejected(rank=2, version=3, code="checksum", reason="bucket 1", live_version=2),
    P.Committed(rank=1, version=3, step=17, commit_ms=12.5, steps_since_first_bucket=3, tokens_at_commit={"7": 12}),
    P.RolloutSample(sample_id="s1", group_id="g1", prompt_ids=[1, 2], token_ids=[5, 6, 7],
                    logprobs=[-0.5, -1.0, -0.1], versions=[3, 3, 4], reward=1.0, finish_reason="stop"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg) -> None:
    decode = {
        P.UpdateAnnounce: P.decode_control, P.Commit: P.decode_control, P.Abort: P.decode_control,
        P.Shutdown: P.decode_control, P.BucketHeader: P.decode_frame, P.Accepted: P.decode_reply,
        P.Joined: P.decode_reply, P.Staged: P.decode_reply, P.Rejected: P.decode_reply, P.Committed: P.decode_reply,
        P.RolloutSample: P.decode_sample,
    }[type(msg)]
    assert decode(P.encode(msg)) == msg


def test_messages_are_frozen() -> None:
    with pytest.raises(AttributeError, match="immutable type: 'Commit'"):
        P.Commit(version=1).version = 2  # type: ignore[misc]


def _raw(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (_raw({"kind": "explode", "version": 1}), "Invalid value 'explode'"),
        (_raw({"kind": "commit", "version": "7"}), "Expected `int`, got `str`"),
        (_raw({"kind": "commit"}), "missing required field `version`"),
        (_raw({"kind": "commit", "version": 1, "extra": 2}), "unknown field `extra`"),
        (_raw({"kind": "commit", "version": -1}), "Expected `int` >= 0"),
        (_raw({"version": 1}), "missing required field `kind`"),
        (b"\xc1\xc1", "bad control message"),
        # a reply type is not a control message: the typed decoder refuses it
        (P.encode(P.Accepted(rank=1, version=2)), "Invalid value 'accepted'"),
    ],
)
def test_control_rejections(data: bytes, fragment: str) -> None:
    with pytest.raises(P.ProtocolError, match=re.escape(fragment)) as exc:
        P.decode_control(data)
    assert fragment in str(exc.value)
    assert str(exc.value).startswith("bad control message")


def test_announce_invariants() -> None:
    good = _announce()
    with pytest.raises(ValueError, match="tile the stream"):
        _announce(buckets=tuple(reversed(good.buckets)))
    with pytest.raises(ValueError, match="total_bytes"):
        _announce(total_bytes=good.total_bytes + 64)
    t0, t1 = good.tensors
    overlap = P.TensorSpec(name=t1.name, shape=t1.shape, dtype=t1.dtype, offset=t0.offset + 64, nbytes=t1.nbytes)
    with pytest.raises(ValueError, match="overlap"):
        _announce(tensors=(t0, overlap))
    with pytest.raises(ValueError, match="listed twice"):
        _announce(tensors=(t0, t0))
    with pytest.raises(ValueError, match="needs 128"):
        P.TensorSpec(name="x", shape=(4, 8), dtype="float32", offset=0, nbytes=100)
    with pytest.raises(ValueError, match="not aligned"):
        P.TensorSpec(name="x", shape=(2,), dtype="float32", offset=2, nbytes=8)
    # the same invariants hold when the bytes come off the wire
    raw = msgspec.msgpack.encode(msgspec.structs.asdict(good)
                                 | {"kind": "announce", "total_bytes": good.total_bytes + 64})
    with pytest.raises(P.ProtocolError, match="total_bytes"):
        P.decode_control(raw)


def test_sample_length_mismatch_is_refused() -> None:
    bad = {"kind": "sample", "sample_id": "s", "group_id": "g", "prompt_ids": [1], "token_ids": [1, 2],
           "logprobs": [-1.0], "versions": [0, 0], "reward": 0.0}
    with pytest.raises(P.ProtocolError, match="2 tokens but 1 log-probs and 2 version tags"):
        P.decode_sample(_raw(bad))


def test_protocol_imports_neither_vllm_nor_trainer() -> None:
    tree = ast.parse(Path(P.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "typing", "msgspec"}, imported
