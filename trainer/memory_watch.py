"""A process's memory, watched while it lives; after a SIGKILL, whether the kernel's OOM killer did it.

Shared by the three parents of the run's processes: ``inflight train``'s supervisor (the trainer,
``inflight.trainer.supervisor``), ``launch_ranks`` (``--nproc`` ranks, ``ChildrenWatch``) and the
``Fleet`` (its engines). A look (``MemoryWatch.look``) reads a few small files: the process's
/proc status and cgroup, its memory cgroup's OOM counter and limit (cgroup v1 or v2, whichever
holds the memory controller here), and the kernel's /proc/vmstat; it imports nothing heavy.

Invariants:
- memory is blamed on evidence (``diagnose``): an ``oom_kill`` counter, of the cgroup the process
  was last seen in or the kernel's, that rose after the last look at the living process; where
  no counter can be read, resident memory within ``NEAR_LIMIT`` of its limit (said as likely);
- a look reads the counters before it confirms the process alive, so no look takes a kill's
  own count as its baseline; the verdict on a death is judged once and kept.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

LOOK_EVERY_S = 0.5
"""How often a watcher looks at the processes it watches."""
NEAR_LIMIT = 0.9
"""Without a readable counter: resident memory at this fraction of the limit or more is the OOM killer's."""
UNLIMITED = 1 << 62
"""A cgroup limit at or above this is none (v1 writes "no limit" as a huge page-rounded number)."""
GiB = float(1 << 30)


@dataclass(frozen=True)
class Cgroup:
    """A memory cgroup: its directory, its hierarchy's version (1 or 2) and mount point."""

    path: Path
    version: int
    top: Path


@dataclass(frozen=True)
class Counters:
    """OOM kills counted at one moment, in a cgroup and by the kernel; None: unreadable."""

    cgroup: int | None
    kernel: int | None


@dataclass(frozen=True)
class Look:
    """One look at a living process."""

    resident: int
    """Its high-water mark of resident memory (``VmHWM``), bytes."""
    cgroup: Cgroup | None
    limit: int | None
    """Its cgroup's memory limit, its ancestors' included (None: none, or no cgroup)."""
    counters: Counters


@dataclass(frozen=True)
class Death:
    """What killed a process that died by SIGKILL, as far as its watch can tell."""

    oom: bool
    evidence: str
    """``cgroup`` or ``kernel`` (that oom_kill counter rose), ``resident`` (no counter: its memory
    at the limit), or, when memory is not blamed, why."""
    resident: int | None
    limit: int | None
    """The limit it ran under: its cgroup's, else this machine's memory (``of_machine``)."""
    of_machine: bool = False


def memory_mounts() -> tuple[Cgroup | None, Cgroup | None]:
    """(the v1 memory hierarchy, the v2 hierarchy) as mounted here, from /proc/self/mountinfo;
    ``path`` is the mount's root inside its hierarchy (a cgroup namespace's, or /)."""
    v1 = v2 = None
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        pre, _, post = line.partition(" - ")
        fields, kind = pre.split(), post.split()
        if len(fields) < 5 or len(kind) < 3:
            continue
        if kind[0] == "cgroup" and "memory" in kind[2].split(","):
            v1 = Cgroup(Path(fields[3]), 1, Path(fields[4]))
        elif kind[0] == "cgroup2":
            v2 = Cgroup(Path(fields[3]), 2, Path(fields[4]))
    return v1, v2


_MOUNTS: list[tuple[Cgroup | None, Cgroup | None]] = []


def cgroup_of(pid: int) -> Cgroup | None:
    """The memory cgroup of process ``pid``: v1's where the memory controller is mounted there,
    else v2's; None when it is gone or nothing here holds the memory controller."""
    if not _MOUNTS:
        _MOUNTS.append(memory_mounts())
    v1, v2 = _MOUNTS[0]
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        mount = v1 if "memory" in controllers.split(",") else v2 if hierarchy == "0" and v1 is None else None
        if mount is not None:
            inside = Path(path).relative_to(mount.path) if Path(path).is_relative_to(mount.path) else Path(path)
            return Cgroup(mount.top / str(inside).lstrip("/"), mount.version, mount.top)
    return None


def _field(path: Path, key: str) -> int | None:
    """The number after ``key`` in a file of "key value" lines (memory.oom_control, memory.events,
    /proc/vmstat, memory.stat); None if it cannot be read."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value.split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return None


def counters(cgroup: Cgroup | None) -> Counters:
    """The OOM kills counted so far in ``cgroup`` (v1: memory.oom_control; v2: memory.events,
    its descendants' included) and by the kernel (/proc/vmstat)."""
    count = None
    if cgroup is not None:
        count = _field(cgroup.path / ("memory.oom_control" if cgroup.version == 1 else "memory.events"), "oom_kill")
    return Counters(cgroup=count, kernel=_field(Path("/proc/vmstat"), "oom_kill"))


def limit_of(cgroup: Cgroup | None) -> int | None:
    """The memory limit ``cgroup`` runs under, its ancestors' included; None: none."""
    if cgroup is None:
        return None
    if cgroup.version == 1:
        found = _field(cgroup.path / "memory.stat", "hierarchical_memory_limit")
        return found if found is not None and found < UNLIMITED else None
    limits, path = [], cgroup.path
    while path.is_relative_to(cgroup.top) and path != cgroup.top:
        try:
            text = (path / "memory.max").read_text().strip()
            limits += [int(text)] if text != "max" else []
        except (OSError, ValueError):
            pass
        path = path.parent
    return min(limits, default=None)


def machine_memory() -> int:
    """This machine's memory (MemTotal), bytes; 0 if unreadable."""
    kib = _field(Path("/proc/meminfo"), "MemTotal:")
    return (kib or 0) * 1024


_SIGKILL_BIT = 1 << 8
"""SIGKILL (9) in /proc/PID/status's pending-signal masks."""
_PF_EXITING = 0x4
"""The kernel's flag of a task in its exit (/proc/PID/stat's ninth field)."""


def resident(pid: int) -> int | None:
    """The high-water mark of process ``pid``'s resident memory (``VmHWM``), bytes, while it
    lives; None once it is dying (SIGKILL pending, or in its exit), a zombie, or gone."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":" in line)
        flags = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[6])
        pending = int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)
        if status["State"].split()[0] in ("Z", "X") or pending & _SIGKILL_BIT or flags & _PF_EXITING:
            return None
        return int(status["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None


def diagnose(last: Look | None, now: Counters, machine: int) -> Death:
    """Whether the OOM killer killed (by SIGKILL) a process whose last look alive was ``last``,
    from the counters ``now``, read after its death; ``machine``: this machine's memory."""
    if last is None:
        return Death(oom=False, evidence="it died before its first look", resident=None, limit=None)
    seen = {"resident": last.resident, "limit": last.limit if last.limit is not None else machine or None,
            "of_machine": last.limit is None}
    before = last.counters
    if before.cgroup is not None and now.cgroup is not None and now.cgroup > before.cgroup:
        return Death(oom=True, evidence="cgroup", **seen)
    if before.kernel is not None and now.kernel is not None and now.kernel > before.kernel:
        return Death(oom=True, evidence="kernel", **seen)
    if None in (before.cgroup, now.cgroup) and None in (before.kernel, now.kernel):
        near = seen["limit"] is not None and last.resident >= NEAR_LIMIT * seen["limit"]
        far = f"no oom_kill counter to read, and {size(last.resident)} resident is far from its {size(seen['limit'])}"
        return Death(oom=near, evidence="resident" if near else far, **seen)
    return Death(oom=False, evidence="no oom_kill counter moved", **seen)


class MemoryWatch:
    """One process, looked at while it lives (``look``, from one thread or several); once it is
    dead, ``death`` is the verdict, judged at its first call and kept."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.last: Look | None = None
        self._death: Death | None = None
        self._lock = threading.Lock()

    def look(self) -> bool:
        """Look at the process; False once it is gone (nothing is kept of that look)."""
        with self._lock:
            if self._death is not None:
                return False
            cgroup = cgroup_of(self.pid)
            seen, limit = counters(cgroup), limit_of(cgroup)  # read before the process is confirmed alive
            peak = resident(self.pid)
            if peak is None:
                return False
            self.last = Look(resident=peak, cgroup=cgroup, limit=limit, counters=seen)
            return True

    def death(self) -> Death:
        """The verdict on the process's death by SIGKILL (call it once the process is dead)."""
        with self._lock:
            if self._death is None:
                cgroup = self.last.cgroup if self.last is not None else None
                self._death = diagnose(self.last, counters(cgroup), machine_memory())
            return self._death


class ChildrenWatch:
    """Every child of this process, looked at every ``LOOK_EVERY_S`` by a thread of its own
    while the ``with`` block runs (``launch_ranks``: the ranks the elastic agent starts)."""

    def __init__(self) -> None:
        self.watches: dict[int, MemoryWatch] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inflight-memory-watch", daemon=True)

    def __enter__(self) -> ChildrenWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            for pid in children(os.getpid()):
                self.watches.setdefault(pid, MemoryWatch(pid))
            for watch in list(self.watches.values()):
                if not watch.look():
                    watch.death()  # judged now, while the counters are those of its death
            if self._stop.wait(LOOK_EVERY_S):
                return

    def death(self, pid: int) -> Death:
        """The verdict on child ``pid``'s death by SIGKILL."""
        return self.watches.setdefault(pid, MemoryWatch(pid)).death()


def children(pid: int) -> list[int]:
    """The pids of process ``pid``'s children (/proc/PID/task/*/children)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(p) for p in task.read_text().split()]
        except (OSError, ValueError):
            continue
    return found


def size(nbytes: int | None) -> str:
    """``nbytes`` for a person: GiB with one decimal, MiB below 1 GiB."""
    if nbytes is None:
        return "an unknown amount"
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= GiB else f"{nbytes / (1 << 20):.0f} MiB"


def killed_by_oom(death: Death) -> str:
    """The words for a death the OOM killer did: "was killed by the kernel's out-of-memory killer
    (SIGKILL at 12.6 GiB resident, limit 13.0 GiB)"."""
    where = f" of this machine's {size(death.limit)}" if death.of_machine else f", limit {size(death.limit)}"
    likely = death.evidence == "resident"
    return (f"was {'most likely ' if likely else ''}killed by the kernel's out-of-memory killer (SIGKILL at "
            f"{size(death.resident)} resident{where}{'; no oom_kill counter to read' if likely else ''})")


def not_by_oom(death: Death) -> str:
    """The words for a SIGKILL not blamed on memory, and why."""
    return f"SIGKILL, not the kernel's out-of-memory killer: {death.evidence}"
