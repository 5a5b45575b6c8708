"""Sparse updates on real RL steps: what an update sent as changes against the engine's
version weighs, and what it costs on each side.

    python -m inflight.bench.sparse --run runs/sparse_bf16                  # a training run's pushes
    python -m inflight.bench.sparse --before DIR --after DIR [--dtype bfloat16]   # the encodings

``--run``: a training run with ``transport.encoding = "sparse"`` logs, per push, the fraction
of elements that changed in the engine's dtype, the bytes sent and the bytes the same update
would weigh dense, and the trainer's time to encode it (``metrics.jsonl``); this summarizes
them over the run (the first push has no base and goes dense).

``--before``/``--after``: two consecutive versions of a real run (the trainer's fp32 master,
``save_pretrained`` directories, e.g. a run's checkpoint at step k and at step k + 1), cast
to the engine's dtype as a push casts them. Each candidate encoding of the second against the
first: bytes, and one core's time to encode on the trainer and to rebuild on the worker:
- the wire's two codecs (``inflight.transport.delta``), encoded by ``DeltaEncoder`` and rebuilt
  by the worker's own ``DeltaDecoder``, its checksum of the result included: ``xor_zstd``
  (the bits xor the base's, zstd level 1) and ``index`` (int32 indices + values);
- xor against the base compressed by zlib (level 1) and by zstd level 3; the rebuild
  decompresses and xors back.

Prints a markdown table and one JSON line, which it appends to ``bench/results/sparse.jsonl``
(``--results``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
import zstandard

from inflight.bench.run_record import add_results_option, append_result, run_record
from inflight.protocol import BucketSpec, UpdateAnnounce
from inflight.transport.bucket import dtype_name, plan_tensors, tensor_views
from inflight.transport.delta import DeltaDecoder, DeltaEncoder


def run_summary(run: Path) -> dict:
    """The pushes of a training run: changed fraction, MB sent and dense, encode ms."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    pushes = [r for r in rows if r.get("dense_mb")]
    sparse = [r for r in pushes if r.get("changed_frac") is not None]
    if not sparse:
        raise SystemExit(f"{run}: no sparse push in metrics.jsonl (transport.encoding = 'sparse'?)")

    def stats(key: str) -> dict:
        xs = [r[key] for r in sparse]
        return {"mean": round(statistics.fmean(xs), 5), "min": round(min(xs), 5), "max": round(max(xs), 5)}
    return {"pushes": len(pushes), "sparse": len(sparse), "dense_mb": round(sparse[0]["dense_mb"], 2),
            "sent_mb": stats("sent_mb"), "changed_frac": stats("changed_frac"), "encode_ms": stats("encode_ms"),
            "sent_over_dense": round(sum(r["sent_mb"] for r in sparse) / sum(r["dense_mb"] for r in sparse), 4),
            "first_step": sparse[0].get("step"), "last_step": sparse[-1].get("step"), "config": _settings(run)}


def _settings(run: Path) -> dict:
    """The run's model, transport and run tables (its ``config.json``), so its command can be checked."""
    cfg = json.loads((run / "config.json").read_text()) if (run / "config.json").exists() else {}
    return {k: cfg.get(k) for k in ("model", "transport", "run")}


def load(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{path}: no .safetensors file")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out |= {n: t.to(dtype) for n, t in load_file(str(f)).items()}
    return out


def timed(fn: Callable[[], object], repeats: int = 3) -> tuple[object, float]:
    """The result of ``fn`` and its best time of ``repeats``, in ms."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, 1e3 * best


def wire_codec(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], dtype: str, codec: str) -> dict:
    """One of the wire's codecs: encoded by ``DeltaEncoder``, rebuilt by ``DeltaDecoder``."""
    wire = {n: dtype for n in new}

    def encode():
        enc = DeltaEncoder()
        enc.record(0, base, wire)
        return enc.encode(1, new, wire, 0, "xxh3", codec)  # type: ignore[arg-type]
    encoded, enc_ms = timed(encode)
    if encoded is None:
        raise SystemExit("nothing to encode: the two versions have different tensors")
    tensors, total = plan_tensors((n, tuple(t.shape), dtype_name(t.dtype)) for n, t in encoded.wire.items())
    a = UpdateAnnounce(version=1, total_bytes=total, bucket_bytes=max(total, 64), checksum_algo="xxh3", tensors=tensors,
                       buckets=(BucketSpec(index=0, offset=0, nbytes=total),) if total else (), delta=encoded.delta)
    flat = torch.zeros(total, dtype=torch.uint8)
    for n, view in tensor_views(flat, tensors).items():
        view.copy_(encoded.wire[n])
    result = torch.empty(encoded.delta.result_bytes, dtype=torch.uint8)
    _, dec_ms = timed(lambda: DeltaDecoder(a, flat, result, base).decode([t.name for t in tensors]))
    rebuilt = tensor_views(result, encoded.delta.result)
    assert all(torch.equal(rebuilt[n].view(torch.uint8), t.view(torch.uint8)) for n, t in new.items())
    return {"encoding": f"{codec} (the wire's)", "bytes": encoded.wire_bytes, "encode_ms": enc_ms, "decode_ms": dec_ms,
            "changed": encoded.changed, "elements": encoded.elements, "dense_bytes": encoded.dense_bytes}


def xor_compressed(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], name: str,
                   compress: Callable[[bytes], bytes], decompress: Callable[[bytes], bytes]) -> dict:
    """xor of each tensor's bits against the base's, then a general-purpose compressor."""
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}

    def encode():
        return {n: compress((t.view(bits[t.dtype]) ^ base[n].view(bits[t.dtype])).numpy().tobytes())
                for n, t in new.items()}
    blobs, enc_ms = timed(encode)

    def decode():
        out = {}
        for n, blob in blobs.items():
            b = base[n]
            x = torch.frombuffer(bytearray(decompress(blob)), dtype=bits[b.dtype]).view(b.shape)
            out[n] = (x ^ b.view(bits[b.dtype])).view(b.dtype)
        return out
    rebuilt, dec_ms = timed(decode)
    assert all(torch.equal(rebuilt[n], t) for n, t in new.items())
    return {"encoding": name, "bytes": sum(len(b) for b in blobs.values()), "encode_ms": enc_ms, "decode_ms": dec_ms}


def compare(before: Path, after: Path, dtype: torch.dtype) -> list[dict]:
    torch.set_num_threads(1)
    base, new = load(before, dtype), load(after, dtype)
    name = dtype_name(dtype)
    c, d = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    rows = [wire_codec(base, new, name, "xor_zstd"), wire_codec(base, new, name, "index"),
            xor_compressed(base, new, "xor + zlib 1", lambda b: zlib.compress(b, 1), zlib.decompress),
            xor_compressed(base, new, "xor + zstd 3", c.compress, d.decompress)]
    dense = rows[0]["dense_bytes"]
    for r in rows:
        r["of_dense"] = round(r["bytes"] / dense, 4)
        r["encode_ms"], r["decode_ms"] = round(r["encode_ms"], 1), round(r["decode_ms"], 1)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, help="a training run's out_dir (transport.encoding = 'sparse')")
    ap.add_argument("--before", type=Path, help="version k: a save_pretrained directory")
    ap.add_argument("--after", type=Path, help="version k + 1")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the engine's dtype")
    add_results_option(ap, "sparse")
    args = ap.parse_args()
    out: dict = {"bench": "sparse", **run_record("sparse")}
    if args.run:
        out["run"] = run_summary(args.run)
        print(f"\n{args.run}: {json.dumps(out['run'])}")
    if args.before and args.after:
        rows = compare(args.before, args.after, getattr(torch, args.dtype))
        print(f"\n{rows[0]['changed']} of {rows[0]['elements']} elements changed "
              f"({rows[0]['changed'] / rows[0]['elements']:.4f}) in {args.dtype}; dense "
              f"{rows[0]['dense_bytes'] / 1e6:.1f} MB\n")
        print("| encoding | MB | of dense | encode ms | rebuild ms |\n| --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['encoding']} | {r['bytes'] / 1e6:.2f} | {r['of_dense']:.3f} | {r['encode_ms']} | "
                  f"{r['decode_ms']} |")
        out["encodings"] = rows
    if "run" not in out and "encodings" not in out:
        ap.error("give --run, or --before and --after")
    print(json.dumps(out))
    append_result(args.results, out)


if __name__ == "__main__":
    main()
