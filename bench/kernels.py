"""Per-token log-prob + entropy (forward + backward): Triton / chunked torch vs the reference;
and the fused per-token loss (``inflight.kernels.tis_loss``, lag-aware truncation on).

    python -m inflight.bench.kernels [--tokens 1024 4096] [--vocab 32000 151936] [--loss-tokens 1048576]

On CUDA it times the Triton kernels and reports peak memory; on CPU it compares the
chunked torch fallback with the reference (Triton needs a GPU outside the interpreter), and
times only the loss's reference. Prints tables, then one JSON line each.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from inflight.kernels.logprob_entropy import logprob_entropy
from inflight.kernels.tis_loss import tis_loss


def _time(fn, device: torch.device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--loss-tokens", type=int, nargs="+", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = args.tokens or ([4096, 16384] if device.type == "cuda" else [256, 1024])
    impls = ["reference", "triton"] if device.type == "cuda" else ["reference", "torch"]
    rows = []
    for n in tokens:
        for v in args.vocab:
            z = torch.randn(n, v, device=device, dtype=dtype, requires_grad=True)
            y = torch.randint(0, v, (n,), device=device)
            row = {"tokens": n, "vocab": v, "dtype": str(dtype)[6:]}
            for impl in impls:
                def step(z=z, y=y, impl=impl) -> None:
                    lp, ent = logprob_entropy(z, y, impl=impl)  # type: ignore[arg-type]
                    (lp.sum() + ent.sum()).backward()
                    z.grad = None

                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                row[f"{impl}_ms"] = round(1e3 * _time(step, device, args.reps), 2)
                if device.type == "cuda":
                    row[f"{impl}_peak_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
            row["speedup"] = round(row["reference_ms"] / row[f"{impls[1]}_ms"], 2)
            # what the reference materialises on top of the logits: fp32 log-softmax (+ its grad)
            row["fp32_logsoftmax_mb"] = round(n * v * 4 / 2**20, 1)
            rows.append(row)
    cols = list(rows[0])
    print(f"device={device}  fwd+bwd, median of {args.reps}")
    print(" ".join(f"{c:>18}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]!s:>18}" for c in cols))
    print(json.dumps({"bench": "kernels", "device": str(device), "rows": rows}))
    bench_loss(args.loss_tokens or ([1 << 20, 1 << 23] if device.type == "cuda" else [1 << 16, 1 << 20]), device,
               args.reps)


def bench_loss(sizes: list[int], device: torch.device, reps: int) -> None:
    """The fused per-token loss, forward + backward, per objective (fp32 tokens)."""
    impls = ["reference", "triton"] if device.type == "cuda" else ["reference"]
    rows = []
    for n in sizes:
        logp = (torch.randn(n, device=device) - 2).requires_grad_()
        mu, adv = logp.detach() + 0.3 * torch.randn(n, device=device), torch.randn(n, device=device)
        mask, lag = torch.ones(n, device=device), torch.randint(0, 8, (n,), device=device).float()
        for objective in ("reinforce", "ppo"):
            row = {"tokens": n, "objective": objective}
            for impl in impls:
                def step(logp=logp, mu=mu, adv=adv, mask=mask, n=n, lag=lag, objective=objective,
                         impl=impl) -> None:
                    loss, _ = tis_loss(logp, mu, adv, mask, float(n), lag=lag, lag_decay=0.9,
                                       objective=objective, impl=impl)  # type: ignore[arg-type]
                    loss.backward()
                    logp.grad = None

                row[f"{impl}_ms"] = round(1e3 * _time(step, device, reps), 3)
            if len(impls) == 2:
                row["speedup"] = round(row["reference_ms"] / row["triton_ms"], 2)
            rows.append(row)
    cols = list(rows[0])
    print(f"tis_loss device={device}  fwd+bwd, mean of {reps}")
    print(" ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]!s:>14}" for c in cols))
    print(json.dumps({"bench": "tis_loss", "device": str(device), "rows": rows}))


if __name__ == "__main__":
    main()
