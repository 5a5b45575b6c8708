"""The packed layout (``inflight.trainer.packed_batch``) and the step's micro-batches
(``inflight.trainer.step_plan``), against what each sample's own sequence says.

For every sample, the rows of the packed layout it runs through, read back in order, must be
its own input tokens at its own positions; every row may attend exactly to the rows of its own
sample's sequence before it (no other sample's, no other group's); each completion token is
predicted from the row of the position before it. The tree holds each distinct prefix once.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inflight.protocol import RolloutGroup, RolloutSample
from inflight.trainer.packed_batch import PackedLayout, pack
from inflight.trainer.step_plan import layout_tokens, plan
from tests.helpers import random_groups, shared_prompt_groups


def _rows_of(layout: PackedLayout, i: int, s: RolloutSample) -> np.ndarray:
    """The packed row of each input position of sample ``i``, recovered from the attention:
    the rows its last predicting row may attend to, in order, plus that row itself."""
    last = int(layout.predict[layout.rows == i][-1])
    return np.flatnonzero(_visible(layout)[last].numpy())


def _visible(layout: PackedLayout) -> torch.Tensor:
    """(L, L) bool: which rows each row attends to, assembled from the spans."""
    n = layout.tokens
    out = torch.zeros(n, n, dtype=torch.bool)
    for s in layout.spans:
        out[s.start:s.root, s.start:s.root] = torch.ones(s.root - s.start, s.root - s.start, dtype=torch.bool).tril()
        if s.mask is not None:
            out[s.root:s.stop, s.start:s.stop] = s.mask
    return out


def _flat(groups: list[RolloutGroup]) -> tuple[list[RolloutSample], list[list[int]]]:
    samples = [s for g in groups for s in g.samples]
    members, row = [], 0
    for g in groups:
        members.append(list(range(row, row + len(g.samples))))
        row += len(g.samples)
    return samples, members


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_every_sample_sees_its_own_sequence_and_nothing_else(seed: int, share: bool) -> None:
    groups = shared_prompt_groups(torch.Generator().manual_seed(seed), 3, 5)
    samples, members = _flat(groups)
    layout = pack(samples, members, share=share)
    ids, pos = layout.input_ids[0].numpy(), layout.position_ids[0].numpy()
    visible = _visible(layout)
    for i, s in enumerate(samples):
        rows = _rows_of(layout, i, s)
        want = np.asarray([*s.prompt_ids, *s.token_ids[:-1]])
        assert ids[rows].tolist() == want.tolist(), i  # its tokens, in order
        assert pos[rows].tolist() == list(range(len(want))), i  # at its own positions
        # each of its rows sees exactly the rows of its sequence up to itself
        for k, r in enumerate(rows):
            assert np.flatnonzero(visible[r].numpy()).tolist() == rows[:k + 1].tolist(), (i, k)
        mine = layout.rows == i
        p = len(s.prompt_ids)
        assert layout.predict[mine].tolist() == rows[p - 1:].tolist()
        assert layout.targets[mine].tolist() == s.token_ids
        assert layout.cols[mine].tolist() == list(range(len(s.token_ids)))
    assert layout.shape == (len(samples), max(len(s.token_ids) for s in samples))


def test_a_group_prompt_and_shared_history_are_laid_out_once() -> None:
    """Three samples of one prompt, two of them opening alike: the prompt once, their common
    opening once, and no row of another group is visible."""
    prompt, other = [5, 6, 7, 8], [9, 10]

    def sample(i: int, group: str, p: list[int], tokens: list[int]) -> RolloutSample:
        return RolloutSample(sample_id=f"{group}{i}", group_id=group, prompt_ids=p, token_ids=tokens,
                             logprobs=[0.0] * len(tokens), versions=[0] * len(tokens), reward=0.0)

    a = [sample(0, "a", prompt, [20, 21, 22]), sample(1, "a", prompt, [20, 21, 30, 31]),
         sample(2, "a", prompt, [40])]
    b = [sample(0, "b", other, [20, 21])]
    layout = pack([*a, *b], [[0, 1, 2], [3]], share=True)
    # rows: prompt 4, then "20 21" shared (predicting 21, 22/30), then 30 alone, then nothing for
    # sample 2 (its one token is predicted from the prompt), then b's 2 + 1
    assert layout.tokens == 4 + 2 + 1 + 3
    assert layout.input_ids[0].tolist() == [5, 6, 7, 8, 20, 21, 30, 9, 10, 20]
    assert layout.prompt_rows == 4 + 2
    assert len(layout.spans) == 2 and layout.spans[1].mask is None  # b: one sample, one node
    packed = pack([*a, *b], [[0, 1, 2], [3]], share=False)
    assert packed.tokens == 6 + 7 + 4 + 3 and packed.prompt_rows == 3 * 4 + 2
    assert layout_tokens([*a, *b], [0, 0, 0, 1], "prefix_shared") == layout.tokens
    assert layout_tokens([*a, *b], [0, 0, 0, 1], "packed") == packed.tokens
    assert layout_tokens([*a, *b], [0, 0, 0, 1], "padded") == 4 * (4 + 4)


def test_routing_that_differs_splits_a_shared_position() -> None:
    """With routing replay, a position is shared only where the engine routed it alike: the
    odd samples share their opening's routes, the even ones do not."""
    groups = shared_prompt_groups(torch.Generator().manual_seed(7), 1, 4, routers=2)
    samples, members = _flat(groups)
    plain, routed = pack(samples, members, share=True), pack(samples, members, share=True, routing=True)
    assert routed.tokens > plain.tokens  # the last prompt position splits by its routing
    assert routed.routing is not None and routed.routing.shape[:2] == (1, routed.tokens)
    for i, s in enumerate(samples):  # each predicting row replays the routing recorded for its token
        rows = routed.predict[routed.rows == i]
        want = np.frombuffer(s.routing, dtype=np.int16).reshape(len(s.token_ids), 2, 2)
        assert routed.routing[0, rows].numpy().tolist() == want.tolist()


def test_micro_batches_keep_to_the_budget_and_pad_to_the_passes_asked() -> None:
    groups = random_groups(torch.Generator().manual_seed(1), 4, 3)
    samples = [s for g in groups for s in g.samples]
    owners = [i for i, g in enumerate(groups) for _ in g.samples]
    for packing in ("padded", "packed", "prefix_shared"):
        micro = plan(samples, owners, packing, 30)
        assert [m.start for m in micro] == [0, *[m.stop for m in micro[:-1]]] and micro[-1].stop == len(samples)
        for m in micro:
            assert m.tokens == layout_tokens(samples[m.start:m.stop], owners[m.start:m.stop], packing)
            assert m.tokens <= 30 or m.stop - m.start == 1  # a sample longer than the budget goes alone
        more = plan(samples, owners, packing, 30, passes=len(micro) + 3)
        assert len(more) == len(micro) + 3
        assert max(m.stop for m in more) == len(samples) and sum(m.stop - m.start for m in more) == len(samples)
    one = plan(samples[:2], owners[:2], "packed", 1000, passes=4)  # two samples, four passes: two join passes
    assert [m.empty for m in one] == [False, False, True, True]
    with pytest.raises(ValueError, match="do not fit in 1 passes"):
        plan(samples, owners, "packed", 30, passes=1)
