"""A micro-batch laid out without padding: samples concatenated in one row, and (``prefix_shared``)
each group's shared prefix computed once.

Sample i feeds its prompt and completion but the last token (whose output predicts nothing) at
positions 0..n_i - 2; the output at position P_i - 1 + t predicts completion token t. Within a
group, positions where several samples agree on every token so far (and, with routing replay, on
the routing the engine recorded there) hold the same hidden states, so they form one node of a
prefix tree, laid out once in depth-first order. A token attends to the tokens of its own node up
to itself and to every token of its node's ancestors (``Span.mask``), never across groups or
samples. Gradients stay exact: a shared position's output feeds every sample that shares it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from inflight.engine.routing import unpack
from inflight.protocol import RolloutSample
from inflight.trainer.routing_replay import NO_ROUTE


@dataclass(frozen=True)
class Span:
    """One attention unit: rows ``start..stop`` of the packed row, a tree of nodes. Rows
    ``start..root`` (the root node) attend causally among themselves; rows ``root..stop``
    attend to keys ``start..stop`` where ``mask`` (stop - root, stop - start) is True. A span
    of one node has ``root == stop`` and no mask."""

    start: int
    root: int
    stop: int
    mask: torch.Tensor | None = None


@dataclass(frozen=True)
class PackedLayout:
    """What one forward pass of a packed micro-batch reads: ``input_ids`` and ``position_ids``
    (1, L), the attention ``spans``, and for each of the M completion tokens scored, the row
    whose output predicts it (``predict``), the token (``targets``) and where its log-prob
    goes in the micro-batch's (rows, completion) grid (``rows``, ``cols``)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    spans: tuple[Span, ...]
    predict: torch.Tensor
    targets: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    shape: tuple[int, int]
    """The micro-batch's (samples, longest completion)."""
    routing: torch.Tensor | None = None
    """(1, L, layers, k) expert ids to replay, ``NO_ROUTE`` where the router chooses."""
    prompt_rows: int = 0
    """Rows at a position before their sample's completion."""

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device) -> PackedLayout:
        spans = tuple(Span(s.start, s.root, s.stop, None if s.mask is None else s.mask.to(device)) for s in self.spans)
        moved = {k: v.to(device) for k, v in self.__dict__.items() if isinstance(v, torch.Tensor)}
        return PackedLayout(**{**self.__dict__, **moved, "spans": spans})


@dataclass(frozen=True)
class _Node:
    parent: int  # index of the parent node, -1 for a root
    depth: int  # the position of its first token
    stop: int  # one past the position of its last token
    members: tuple[int, ...]  # the samples whose inputs run through it (indices into the layout's samples)


class _Inputs:
    """Each sample's input tokens and, with routing, each position's routing key (the experts
    recorded for the token it predicts; ``NO_ROUTE`` rows elsewhere)."""

    def __init__(self, samples: Sequence[RolloutSample], routing: bool) -> None:
        self.samples = samples
        self.tokens = [np.asarray([*s.prompt_ids, *s.token_ids[:-1]], dtype=np.int64) for s in samples]
        self.routes: list[np.ndarray] | None = None
        if routing:
            self.routes = [_route_keys(s, len(t)) for s, t in zip(samples, self.tokens)]

    def agree(self, members: Sequence[int], start: int) -> int:
        """The first position >= ``start`` where ``members`` stop agreeing (or the shortest ends)."""
        end = min(len(self.tokens[m]) for m in members)
        if len(members) == 1 or end <= start:
            return end
        first, same = members[0], np.ones(end - start, dtype=bool)
        for m in members[1:]:
            same &= self.tokens[m][start:end] == self.tokens[first][start:end]
            if self.routes is not None:
                same &= (self.routes[m][start:end] == self.routes[first][start:end]).all(-1)
        return start + (int(np.argmin(same)) if not same.all() else len(same))

    def key(self, m: int, position: int) -> tuple:
        token = int(self.tokens[m][position])
        return (token,) if self.routes is None else (token, *self.routes[m][position].tolist())


def _route_keys(s: RolloutSample, n_inputs: int) -> np.ndarray:
    """(n_inputs, layers * k) routing key of each input position of ``s``."""
    if not s.routing:
        raise ValueError(f"loss.routing_replay=true but sample {s.sample_id!r} carries no routing")
    rows = unpack(s.routing, s.routing_layers, s.routing_k).astype(np.int64).reshape(len(s.token_ids), -1)
    keys = np.full((n_inputs, rows.shape[1]), NO_ROUTE, dtype=np.int64)
    p = len(s.prompt_ids)
    keys[p - 1: p - 1 + len(s.token_ids)] = rows[: n_inputs - p + 1]
    return keys


def _tree(inputs: _Inputs, members: tuple[int, ...], depth: int, parent: int, nodes: list[_Node]) -> None:
    """Append, depth first, the nodes of the samples ``members``, which agree on positions below ``depth``."""
    stop = inputs.agree(members, depth)
    nodes.append(_Node(parent, depth, stop, members))
    me = len(nodes) - 1
    children: dict[tuple, list[int]] = {}
    for m in members:
        if len(inputs.tokens[m]) > stop:
            children.setdefault(inputs.key(m, stop), []).append(m)
    for child in children.values():
        _tree(inputs, tuple(child), stop, me, nodes)


def _forest(inputs: _Inputs, groups: Sequence[Sequence[int]], share: bool) -> list[list[_Node]]:
    """Each span's nodes: with ``share``, a prefix tree per distinct first token of each group;
    without, one single-node span per sample."""
    spans: list[list[_Node]] = []
    for group in groups:
        if not share:
            spans += [[_Node(-1, 0, len(inputs.tokens[m]), (m,))] for m in group]
            continue
        roots: dict[tuple, list[int]] = {}
        for m in group:
            roots.setdefault(inputs.key(m, 0), []).append(m)
        for members in roots.values():
            nodes: list[_Node] = []
            _tree(inputs, tuple(members), 0, -1, nodes)
            spans.append(nodes)
    return spans


def _span_mask(nodes: list[_Node]) -> torch.Tensor | None:
    """Rows below the root node of a tree attend to their node's ancestors and to their own node causally."""
    if len(nodes) == 1:
        return None
    sizes = torch.tensor([n.stop - n.depth for n in nodes])
    node_of = torch.repeat_interleave(torch.arange(len(nodes)), sizes)
    ancestor = torch.eye(len(nodes), dtype=torch.bool)  # ancestor[a, b]: b is a or one of a's ancestors
    for i, n in enumerate(nodes):
        if n.parent >= 0:
            ancestor[i] |= ancestor[n.parent]
    length, root = int(sizes.sum()), int(sizes[0])
    causal = torch.ones(length - root, length, dtype=torch.bool).tril(diagonal=root)
    return ancestor[node_of[root:]][:, node_of] & causal


def pack(samples: Sequence[RolloutSample], groups: Sequence[Sequence[int]], *, share: bool,
         routing: bool = False) -> PackedLayout:
    """The packed layout of ``samples`` (the micro-batch's rows, in order), ``groups`` the row
    indices of each GRPO group among them; ``share``: each group's common prefixes once."""
    inputs = _Inputs(samples, routing)
    forest = _forest(inputs, groups, share)
    ids, pos, spans, routes = [], [], [], []
    where = [np.empty(len(t), dtype=np.int64) for t in inputs.tokens]  # each sample's position -> packed row
    row = prompt_rows = 0
    for nodes in forest:
        start = row
        for n in nodes:
            m = n.members[0]
            ids.append(inputs.tokens[m][n.depth:n.stop])
            prompt_rows += max(0, min(n.stop, len(samples[m].prompt_ids)) - n.depth)
            pos.append(np.arange(n.depth, n.stop))
            if inputs.routes is not None:
                routes.append(inputs.routes[m][n.depth:n.stop])
            for member in n.members:
                where[member][n.depth:n.stop] = np.arange(row, row + n.stop - n.depth)
            row += n.stop - n.depth
        spans.append(Span(start, start + nodes[0].stop - nodes[0].depth, row, _span_mask(nodes)))
    predict, rows, cols, targets = [], [], [], []
    for i, s in enumerate(samples):
        t = len(s.token_ids)
        predict.append(where[i][len(s.prompt_ids) - 1:])
        rows.append(np.full(t, i))
        cols.append(np.arange(t))
        targets.append(np.asarray(s.token_ids, dtype=np.int64))
    longest = max(len(s.token_ids) for s in samples)
    routing_t = None
    if inputs.routes is not None:
        layers, k = samples[0].routing_layers, samples[0].routing_k
        routing_t = torch.from_numpy(np.concatenate(routes)).reshape(1, row, layers, k)
    cat = lambda parts: torch.from_numpy(np.concatenate(parts))  # noqa: E731
    return PackedLayout(cat(ids)[None], cat(pos)[None], tuple(spans), cat(predict), cat(targets), cat(rows), cat(cols),
                        (len(samples), longest), routing_t, prompt_rows)


def added_tokens(inputs_a: np.ndarray, others: Sequence[np.ndarray], share: bool) -> int:
    """How many rows a sample with input tokens ``inputs_a`` adds to a tree already holding
    ``others`` of its group: its length less its longest common prefix with any of them (what
    a prefix tree's insert adds); its whole length without ``share``."""
    if not share or not others:
        return len(inputs_a)
    best = 0
    for b in others:
        n = min(len(inputs_a), len(b))
        diff = np.flatnonzero(inputs_a[:n] != b[:n])
        best = max(best, int(diff[0]) if diff.size else n)
    return len(inputs_a) - best
