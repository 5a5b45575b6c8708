"""A real rate-limited link on this machine: a network namespace joined to this one by a veth
pair, each end shaped by a ``tbf`` qdisc.

    python -m inflight.bench.slow_link [--rate 1gbit 100mbit] [--mb 64]   # the link's achieved bytes/s

``slow_link(rate)`` builds it and always takes it down, on success or failure; ``enter(link)``
moves the calling process (before it opens any socket or starts a thread) into the namespace.
A trainer process that enters it reaches an engine in this namespace only through the link:
its address is ``link.inner`` and the engine's is ``link.outer``, so the weight group's store,
control messages and data plane all cross the shaped veth. ``tbf`` shapes each end's egress
to ``rate``; the kernel here has no ``netem``, so the link adds no delay of its own.

Needs root (CAP_NET_ADMIN) and ``ip``/``tc`` (iproute2). Every name carries ``PREFIX`` and
this process's id, and its addresses are a /30 of this process's own, so runs side by side
do not meet; ``leftovers(pid)`` finds anything a run left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

PREFIX = "infl"
"""Every namespace and veth device this module creates starts with it."""
CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class SlowLink:
    """One shaped link: the namespace, the two veth ends (``outer_dev`` here, ``inner_dev`` in
    the namespace), their addresses and the rate in bits/s."""

    namespace: str
    outer_dev: str
    inner_dev: str
    outer: str
    inner: str
    rate_bps: int


def rate_bps(rate: str) -> int:
    """``tc``'s rate words: ``10gbit``, ``1gbit``, ``100mbit``, ``500kbit`` -> bits/s."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g)bit", rate.strip().lower())
    if m is None:
        raise ValueError(f"rate={rate!r}: expected a number and kbit, mbit or gbit (e.g. '1gbit')")
    return int(float(m[1]) * {"k": 1e3, "m": 1e6, "g": 1e9}[m[2]])


def available() -> str | None:
    """Why a slow link cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN) for ip netns and tc"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    return f"needs {' and '.join(missing)} (iproute2)" if missing else None


def _run(*cmd: str) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")


def _shape(dev: str, bps: int, netns: str | None = None) -> None:
    """``tbf`` at ``bps`` on ``dev``'s egress: a burst of 10 ms at the rate (at least 64 KiB, so
    one GSO segment fits) and up to 100 ms of queue."""
    burst = max(64 * 1024, bps // 8 // 100)
    prefix = ("ip", "netns", "exec", netns) if netns else ()
    _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", str(bps), "burst", str(burst),
         "latency", "100ms")


def _take_down(link: SlowLink) -> None:
    """Delete the namespace (its veth end, and with it the pair and both qdiscs) and, if it is
    still there, this end."""
    subprocess.run(("ip", "netns", "del", link.namespace), capture_output=True)
    subprocess.run(("ip", "link", "del", link.outer_dev), capture_output=True)


@contextlib.contextmanager
def _exit_on_sigterm() -> Iterator[None]:
    """While the block runs, SIGTERM (``kill``, a job's time limit) raises ``SystemExit`` in the
    main thread, so the ``finally`` around it takes the link down; Python's default would end
    the process with the namespace still there. A handler someone else set is left alone."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def slow_link(rate: str, *, index: int = 0) -> Iterator[SlowLink]:
    """A namespace joined to this one by a veth pair shaped to ``rate`` both ways, on a /30 of
    this process's own (``index``: 0..9, one per link it holds at once); taken down when the
    block ends, however it ends (SIGTERM included: ``_exit_on_sigterm``)."""
    reason = available()
    if reason is not None:
        raise RuntimeError(f"a slow link {reason}")
    if not 0 <= index <= 9:
        raise ValueError(f"index={index}: 0..9 (a device name holds at most 15 characters)")
    bps = rate_bps(rate)
    pid = os.getpid()
    tag = f"{pid}x{index}"
    # RFC 2544's benchmarking range, 198.18.0.0/15: a /30 per process and index, no real network's
    base = f"198.{18 + (pid >> 8) % 2}.{pid % 256}"
    link = SlowLink(namespace=f"{PREFIX}-{tag}", outer_dev=f"{PREFIX}o{tag}", inner_dev=f"{PREFIX}i{tag}",
                    outer=f"{base}.{4 * index + 1}", inner=f"{base}.{4 * index + 2}", rate_bps=bps)
    with _exit_on_sigterm():
        try:
            _run("ip", "netns", "add", link.namespace)
            _run("ip", "link", "add", link.outer_dev, "type", "veth", "peer", "name", link.inner_dev)
            _run("ip", "link", "set", link.inner_dev, "netns", link.namespace)
            _run("ip", "addr", "add", f"{link.outer}/30", "dev", link.outer_dev)
            _run("ip", "link", "set", link.outer_dev, "up")
            ns = ("ip", "netns", "exec", link.namespace)
            _run(*ns, "ip", "addr", "add", f"{link.inner}/30", "dev", link.inner_dev)
            _run(*ns, "ip", "link", "set", link.inner_dev, "up")
            _run(*ns, "ip", "link", "set", "lo", "up")
            _shape(link.outer_dev, bps)
            _shape(link.inner_dev, bps, netns=link.namespace)
            yield link
        finally:
            _take_down(link)


def enter(link: SlowLink) -> None:
    """Move the calling thread, and every thread and socket it makes from now on, into
    ``link``'s namespace (``setns``). Call it first thing in a fresh process."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{link.namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {link.namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)


def leftovers(pid: int | None = None) -> list[str]:
    """Every namespace, link and qdisc of this module's naming still on the machine (``pid``:
    only those of that process's links)."""
    mark = "" if pid is None else f"{pid}x"
    found = []
    netns = subprocess.run(("ip", "netns", "list"), capture_output=True, text=True).stdout
    found += [f"netns {line.split()[0]}" for line in netns.splitlines() if line.startswith(f"{PREFIX}-{mark}")]
    links = subprocess.run(("ip", "-o", "link", "show"), capture_output=True, text=True).stdout
    found += [f"link {m}" for m in re.findall(rf"^\d+: ({PREFIX}[io]{mark}\w+)", links, flags=re.M)]
    qdiscs = subprocess.run(("tc", "qdisc", "show"), capture_output=True, text=True).stdout
    found += [f"qdisc {line}" for line in qdiscs.splitlines() if re.search(rf" dev {PREFIX}[io]{mark}", line)]
    return found


def _sender(link: SlowLink, port: int, nbytes: int) -> None:
    """In the namespace: send ``nbytes`` to the listener on ``link.outer``."""
    enter(link)
    chunk = b"\0" * (1 << 20)
    with socket.create_connection((link.outer, port), timeout=600) as s:
        left = nbytes
        while left > 0:
            s.sendall(chunk[:min(left, len(chunk))])
            left -= len(chunk)


def bytes_to_measure(link: SlowLink, seconds: float = 1.0, least: int = 16 << 20) -> int:
    """Enough bytes for ``seconds`` at ``link``'s rate (at least ``least``): a shorter
    transfer reads the socket buffers and the tbf burst as rate (64 MiB at 10 Gbit/s measured
    1347 MB/s, above the link's 1250)."""
    return max(least, int(link.rate_bps / 8 * seconds) >> 20 << 20)


def achieved_bytes_per_s(link: SlowLink, nbytes: int) -> float:
    """Bytes/s of one TCP stream of ``nbytes`` from the namespace to this end, timed from the
    first byte received to the last (the connection's set-up left out)."""
    import multiprocessing as mp

    with socket.create_server((link.outer, 0)) as server:
        port = server.getsockname()[1]
        proc = mp.get_context("spawn").Process(target=_sender, args=(link, port, nbytes), daemon=True)
        proc.start()
        conn, _ = server.accept()
        with conn:
            first = conn.recv(1 << 20)  # the clock starts when this returns: its bytes are not counted
            t0, got = time.perf_counter(), len(first)
            while first and got < nbytes:
                data = conn.recv(1 << 20)
                if not data:
                    break
                got += len(data)
            wall = time.perf_counter() - t0
        proc.join(60)
    if got != nbytes:
        raise RuntimeError(f"the link delivered {got} of {nbytes} bytes")
    return (got - len(first)) / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", nargs="+", default=["10gbit", "1gbit", "100mbit"], help="tc rates, one link each")
    ap.add_argument("--mb", type=float, default=64, help="MiB sent over each link")
    args = ap.parse_args()
    rows = []
    for i, rate in enumerate(args.rate):
        with slow_link(rate, index=i) as link:
            bps = achieved_bytes_per_s(link, int(args.mb * 2**20))
        rows.append({"rate": rate, "shaped_Bps": link.rate_bps / 8, "achieved_Bps": round(bps),
                     "achieved_frac": round(bps / (link.rate_bps / 8), 3)})
        print(f"{rate}: {bps / 1e6:.1f} MB/s achieved of {link.rate_bps / 8e6:.1f} MB/s shaped "
              f"({rows[-1]['achieved_frac']:.3f}), load {os.getloadavg()[0]:.1f}")
    left = leftovers(os.getpid())
    print(json.dumps({"bench": "slow_link", "rows": rows, "load_1m": round(os.getloadavg()[0], 1), "leftovers": left}))
    if left:
        raise SystemExit(f"left behind: {left}")


if __name__ == "__main__":
    main()
