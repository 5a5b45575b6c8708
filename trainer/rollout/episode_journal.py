"""Episodes that outlive their engine process: an append-only journal of each episode's progress.

``EpisodeRollout`` writes a record whenever an episode changes (a group starts, a reply or an
observation is appended, an episode ends, a group leaves) to ``<run.out_dir>/episodes-e<i>.journal``,
and its ledger with every record. A restarted engine process of the same index reads it back:
the groups that had not left are the episodes in flight when the last process stopped
(restarted, crashed, killed), with every token, log-prob and tag sampled so far. They are
resumed (the next turn continues their token ids under whatever version is live then; a
turn whose environment answer was lost is asked again) or dropped, as
``task.episode.on_restart`` says, and counted either way: the ledger goes on from the last
record, so the trainer's ``rollout_episodes_*`` totals never go backwards.

Format: records of ``<u32 length><pickle>``, flushed as written; a record cut short by a
kill is ignored. The journal is rewritten (compacted) when read, under a new name then
renamed, so a crash during the rewrite leaves the old one.
"""

from __future__ import annotations

import os
import pickle
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_LEN = struct.Struct("<I")


@dataclass
class Recovered:
    """What a journal held: the groups in flight (id -> ``EpisodeGroup``) and the last ledger."""

    groups: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)


class EpisodeJournal:
    """One engine's journal (``path``); ``read`` what an earlier process left, then ``write``."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file: Any = None

    def read(self) -> Recovered:
        """The groups the journal holds that had not left, and the last ledger; the file is
        compacted to just those and opened for appending."""
        got = peek(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")  # closed by close()
        self.compact_past(got.groups, got.counts, limit_bytes=0)
        return got

    def compact_past(self, groups: dict[str, Any], counts: dict[str, int], limit_bytes: int = 64 << 20) -> None:
        """Once the file passes ``limit_bytes``, rewrite it with the groups in flight alone."""
        if self._file is None or self._file.tell() < limit_bytes:
            return
        self._file.close()
        tmp = self.path.with_suffix(".journal.new")
        with open(tmp, "wb") as f:
            for gid, group in groups.items():
                f.write(_frame(("group", gid, group, counts)))
        os.replace(tmp, self.path)
        self._file = open(self.path, "ab")  # closed by close()

    def group(self, gid: str, group: Any, counts: dict[str, int]) -> None:
        """The group's whole state (it started, or one of its episodes changed)."""
        self._write(("group", gid, group, counts))

    def leave(self, gid: str, counts: dict[str, int]) -> None:
        """The group was shipped, dropped or failed: nothing of it to resume."""
        self._write(("leave", gid, None, counts))

    def _write(self, record: tuple) -> None:
        if self._file is not None:
            self._file.write(_frame(record))
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _frame(record: tuple) -> bytes:
    data = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(data)) + data


def peek(path: Path) -> Recovered:
    """What the journal at ``path`` holds now, read without touching it (for inspection: the
    engine process that owns it may be writing)."""
    got = Recovered()
    if Path(path).exists():
        for record in _records(Path(path).read_bytes()):
            _apply(got, record)
    return got


def _records(data: bytes):
    at = 0
    while at + _LEN.size <= len(data):
        (n,) = _LEN.unpack_from(data, at)
        if at + _LEN.size + n > len(data):
            return  # cut short by a kill: the episode resumes from its record before
        try:
            yield pickle.loads(data[at + _LEN.size: at + _LEN.size + n])
        except Exception:  # a torn record: nothing after it can be trusted
            return
        at += _LEN.size + n


def _apply(got: Recovered, record: tuple) -> None:
    kind, gid, group, counts = record
    got.counts = dict(counts)
    if kind == "group":
        got.groups[gid] = group
    else:
        got.groups.pop(gid, None)
