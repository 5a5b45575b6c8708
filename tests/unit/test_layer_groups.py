"""Layer groups and hybrid labels (``inflight.layer_groups``), without an engine.

- the groups and their order come from tensor names alone: embeddings, each decoder layer
  by index (10 after 9), the rest; a tied model has no head tensor, so its embedding group
  is the head's too;
- a label round-trips, names the exact version of every group, and a malformed one is refused;
- an update sent again after it stopped part-way keeps the groups of it already live;
- a group's update must hold exactly one group's tensors.
"""

from __future__ import annotations

import re

import pytest

from inflight.layer_groups import Hybrid, LabelError, LayerGroups, hybrid_fraction, layer_groups, parse_label
from inflight.versions import VersionTagError, labels_from_spans, tags_and_labels, tags_from_spans

NAMES = ["lm_head.weight", "model.norm.weight", "model.embed_tokens.weight", "model.layers.10.mlp.up_proj.weight",
         "model.layers.9.self_attn.q_proj.weight", "model.layers.9.input_layernorm.weight"]


def test_groups_follow_the_model_order_by_name() -> None:
    assert layer_groups(NAMES) == [
        ("model.embed_tokens.weight",),
        ("model.layers.9.input_layernorm.weight", "model.layers.9.self_attn.q_proj.weight"),
        ("model.layers.10.mlp.up_proj.weight",),
        ("lm_head.weight", "model.norm.weight"),
    ]
    tied = [n for n in NAMES if n != "lm_head.weight"]
    assert layer_groups(tied)[-1] == ("model.norm.weight",)  # the head reads the embedding: it moves with it


def test_labels_name_every_groups_version() -> None:
    h = Hybrid(5).with_groups(6, 3, 8)
    assert str(h) == "5>6:3" and parse_label("5>6:3") == h and h.oldest == 5 and h.newest == 6
    h2 = h.with_groups(7, 2, 8)
    assert str(h2) == "5>6:3>7:2" and h2.group_versions(8) == [7, 7, 6, 5, 5, 5, 5, 5]
    assert h2.with_groups(7, 8, 8) == Hybrid(7) and str(Hybrid(7)) == "7"
    # the same version sent again after it stopped at group 3: its first 3 groups stay counted
    assert h.with_groups(6, 1, 8) == h and h.with_groups(6, 4, 8) == Hybrid(5, ((6, 4),))
    for bad in ("x", "5>6", "5>4:1", "5>6:0", "5>7:1>6:1", "-1"):
        with pytest.raises(LabelError, match=f"version label {re.escape(repr(bad))}"):
            parse_label(bad)


def test_tags_of_hybrid_tokens_are_their_oldest_version() -> None:
    class Span:
        def __init__(self, version: str, start: int, end: int) -> None:
            self.version, self.start, self.end = version, start, end

    spans = [Span("5", 0, 2), Span("5>6:1", 2, 3), Span("5>6:3>7:1", 3, 5), Span("7", 5, 6)]
    assert labels_from_spans(spans, 6) == ["5", "5", "5>6:1", "5>6:3>7:1", "5>6:3>7:1", "7"]
    assert tags_from_spans(spans, 6) == [5, 5, 5, 5, 5, 7]
    assert tags_and_labels(spans, 6) == (tags_from_spans(spans, 6), labels_from_spans(spans, 6))
    assert hybrid_fraction(labels_from_spans(spans, 6)) == 0.5
    with pytest.raises(VersionTagError, match="neither a version nor a hybrid"):
        tags_from_spans([Span("v5", 0, 1)], 1)


def test_a_group_update_holds_exactly_one_group() -> None:
    groups = LayerGroups.of(NAMES)
    assert list(groups) == layer_groups(NAMES) and len(groups) == 4
    assert groups.group_of_update(["model.layers.10.mlp.up_proj.weight"]) == 2
    with pytest.raises(ValueError, match=r"reach groups \[0, 2\]"):
        groups.group_of_update(["model.embed_tokens.weight", "model.layers.10.mlp.up_proj.weight"])
    with pytest.raises(ValueError, match="layer group 1: missing"):
        groups.group_of_update(["model.layers.9.input_layernorm.weight"])
