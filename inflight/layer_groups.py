"""Layer groups and hybrid labels: the unit of a layer-granular commit, and what a token's tag
says about the weights that sampled it.

With ``InflightConfig(commit_unit="layer")`` an update commits one *layer group* at a time, in a fixed order
that both sides derive from the checkpoint's tensor names alone (``layer_groups``): the embeddings; each
decoder layer, in index order; then everything else (the final norm and an untied LM head). A tied LM head
has no tensor of its own, so it moves with the embedding it reads: the two are one group by construction.

While an update is part-way, the engine serves a *hybrid*: the first n groups at the new version, the
others at what was live before. Its label (vLLM's ``weight_version``, attached to every output token)
spells that out, so the weights can be rebuilt from the label alone:

    "5"            version 5, whole
    "5>6:3"        version 5 with the first 3 groups of version 6
    "5>6:3>7:2"    that hybrid (an update of v6 stopped after 3 groups), then the first
                   2 groups of version 7 over it

A label's *base* (``oldest``) is the oldest version any group of it holds: the lag of a
hybrid token counts from it (conservative). When an update's last group commits, the label
is the new version alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EMBED = ("embed_tokens.", "wte.", "word_embeddings.", "embed_in.")


def group_of(name: str) -> tuple[int, int]:
    """Sort key of ``name``'s group: (0, 0) embeddings, (1, i) decoder layer i, (2, 0) the rest."""
    m = _LAYER.search(name)
    if m is not None:
        return 1, int(m.group(1))
    if any(e in name for e in _EMBED):
        return 0, 0
    return 2, 0


def layer_groups(names: Iterable[str]) -> list[tuple[str, ...]]:
    """The checkpoint's tensors in commit order, one tuple of names per group (sorted within)."""
    by_key: dict[tuple[int, int], list[str]] = {}
    for name in names:
        by_key.setdefault(group_of(name), []).append(name)
    return [tuple(sorted(by_key[k])) for k in sorted(by_key)]


@dataclass(frozen=True)
class LayerGroups:
    """A checkpoint's layer groups in commit order and each tensor's group, computed once from
    the names (``layer_groups``): every update asks which group it holds, and a large MoE
    checkpoint has tens of thousands of names."""

    groups: tuple[tuple[str, ...], ...]
    index: Mapping[str, int]

    @classmethod
    def of(cls, names: Iterable[str]) -> LayerGroups:
        groups = tuple(layer_groups(names))
        return cls(groups, {n: g for g, members in enumerate(groups) for n in members})

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, g: int) -> tuple[str, ...]:
        return self.groups[g]

    def __iter__(self) -> Iterator[tuple[str, ...]]:
        return iter(self.groups)

    def group_of_update(self, names: Iterable[str]) -> int:
        """The index of the one group ``names`` are exactly; ``ValueError`` naming what is off."""
        names = set(names)
        found = {self.index[n] for n in names if n in self.index}
        if len(found) != 1:
            raise ValueError(f"a layer group's update must hold one group's tensors; these reach groups "
                             f"{sorted(found)}")
        g = found.pop()
        if names != set(self.groups[g]):
            raise ValueError(f"layer group {g}: missing {sorted(set(self.groups[g]) - names)[:3]}, "
                             f"unknown {sorted(names - set(self.groups[g]))[:3]}")
        return g


# -- hybrid labels --------------------------------------------------------------------------
class LabelError(ValueError):
    """A version label that is neither an integer version nor a hybrid."""


@dataclass(frozen=True)
class Hybrid:
    """What a label says: ``base`` whole, then, in order, the first ``n`` groups of ``to``."""

    base: int
    steps: tuple[tuple[int, int], ...] = ()

    @property
    def oldest(self) -> int:
        """The oldest version a group of these weights holds (the lag counts from it)."""
        return self.base

    @property
    def newest(self) -> int:
        """The version the last (possibly partial) update brings."""
        return self.steps[-1][0] if self.steps else self.base

    def __str__(self) -> str:
        return str(self.base) + "".join(f">{to}:{n}" for to, n in self.steps)

    def with_groups(self, to: int, n: int, total: int) -> Hybrid:
        """After the first ``n`` of ``total`` groups of ``to`` committed over these weights. A
        version names one set of weights, so groups of ``to`` already live stay counted (an
        update of ``to`` sent again after it stopped part-way)."""
        if self.steps and self.steps[-1][0] == to:
            n = max(n, self.steps[-1][1])
            steps = self.steps[:-1]
        else:
            steps = self.steps
        if n >= total:
            return Hybrid(to)
        return Hybrid(self.base, steps + ((to, n),))

    def group_versions(self, groups: int) -> list[int]:
        """The version each of ``groups`` groups holds, in commit order."""
        out = [self.base] * groups
        for to, n in self.steps:
            out[:n] = [to] * n
        return out


def parse_label(label: str) -> Hybrid:
    """``Hybrid`` of a label (``"5"``, ``"5>6:3"``, ``"5>6:3>7:2"``); ``LabelError`` otherwise."""
    head, *rest = label.split(">")
    try:
        base = int(head)
        steps = []
        for part in rest:
            to, n = part.split(":")
            steps.append((int(to), int(n)))
    except ValueError:
        raise LabelError(f"version label {label!r} is neither a version nor a hybrid 'v>to:n'") from None
    tos = [base] + [to for to, _ in steps]
    if base < 0 or any(b <= a for a, b in zip(tos, tos[1:])) or any(n < 1 for _, n in steps):
        raise LabelError(f"version label {label!r}: each step must bring a newer version and at least one group")
    return Hybrid(base, tuple(steps))


def hybrid_fraction(labels: Sequence[str]) -> float:
    """The fraction of tokens whose label is a hybrid (0 for no tokens)."""
    return sum(">" in s for s in labels) / len(labels) if labels else 0.0
