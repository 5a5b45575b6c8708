"""``inflight.bench.spec``'s pure parts, without an engine: the copy workload, vLLM's n-gram
proposal and the copy ceiling it gives, and the report's arithmetic (speculation counts per
chunk, spreads and round-by-round ratios, the verdict)."""

from __future__ import annotations

import pytest

from inflight.bench.spec import (
    copy_ceiling,
    copy_prompt,
    ngram_draft,
    ratio_table,
    round_ratios,
    spec_delta,
    spec_summary,
    spread,
    transcript,
    verdict,
)

TEMPLATE = ("You have a calculator: write `calc: <expression>` on a line and you will get its value. When you know "
            "the result, write `answer: <number>`.")


def test_the_prompt_holds_a_calculator_transcript_and_the_completion_copies_it() -> None:
    prompt, completion = copy_prompt(0, 0, 1)
    first = f"User: What is 450 - 809? {TEMPLATE}"
    episode = f"{first}\nAssistant: calc: 450 - 809\nTool: -359\nAssistant: answer: -359\n"
    assert prompt == ("Below is the transcript of a calculator session.\n\n" + episode
                      + "\nThe same transcript, copied exactly:\n\n" + first + "\n")
    assert completion == "Assistant: calc: 450 - 809\nTool: -359\nAssistant: answer: -359\n"
    assert prompt.endswith(first + "\n") and completion in prompt


def test_each_prompt_has_its_own_episodes_and_every_mode_the_same() -> None:
    lines = transcript(0, 1, 2)
    assert lines == [f"User: What is 873 * 552? {TEMPLATE}", "Assistant: calc: 873 * 552", "Tool: 481896",
                     "Assistant: answer: 481896", f"User: What is 851 * 503? {TEMPLATE}", "Assistant: calc: 851 * 503",
                     "Tool: 428053", "Assistant: answer: 428053"]
    prompt, completion = copy_prompt(0, 1, 2)
    assert completion == "\n".join(lines[1:]) + "\n" and completion in prompt
    assert prompt.count("\n".join(lines)) == 1  # the whole transcript once; the copy holds its first line only
    assert copy_prompt(0, 1, 2) == (prompt, completion) and copy_prompt(0, 2, 2) != (prompt, completion)
    assert copy_prompt(1, 1, 2) != (prompt, completion)


@pytest.mark.parametrize(("context", "k", "draft"), [
    ([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3, [9, 1, 2]),  # the longest suffix (3 tokens), its first occurrence
    ([5, 6, 7, 5], 3, [6, 7, 5]),  # only a 1-token suffix occurs earlier
    ([7, 8, 1, 2, 9, 1, 2], 2, [9, 1]),  # 2 tokens beat the earlier 1-token match of "2"
    ([4, 4], 3, [4]),  # the proposal stops where the context does
    ([1, 2], 3, []),  # nothing occurs earlier
    ([3], 3, []),
])
def test_the_ngram_proposal_is_vllms(context: list[int], k: int, draft: list[int]) -> None:
    assert ngram_draft(context, k) == draft


def test_the_copy_ceiling_counts_steps_as_the_engine_meter_does() -> None:
    # prefill emits 1; then [2, 3, 4] drafted from "1" and all accepted (+5 sampled); then [6, 1, 2]
    # drafted from "3 4 5": 6 matches but is the completion's last token, so that step emits it alone
    assert copy_ceiling([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], 3) == {
        "steps": 3, "emitted": 6, "drafted": 6, "accepted": 3}
    # nothing to look up: one token per step, no drafts
    assert copy_ceiling([1, 2, 3], [7, 8, 9], 3) == {"steps": 3, "emitted": 3, "drafted": 0, "accepted": 0}
    # a draft of 3 with its second token wrong: 1 accepted, then the target's own token
    assert copy_ceiling([5, 6, 7, 8], [5, 6, 0, 8], 3) == {"steps": 3, "emitted": 4, "drafted": 3, "accepted": 1}


def test_a_chunks_speculation_is_what_it_added_over_versions() -> None:
    before = {3: (10, 25, 30, 15), 4: (2, 5, 6, 3)}
    after = {3: (10, 25, 30, 15), 4: (6, 17, 18, 11), 5: (4, 9, 12, 5)}  # v4 moved on, v5 is new
    assert spec_delta(before, after) == {"steps": 8, "emitted": 21, "drafted": 24, "accepted": 13}
    assert spec_delta({}, {}) == {"steps": 0, "emitted": 0, "drafted": 0, "accepted": 0}
    assert spec_summary([spec_delta(before, after), {"steps": 2, "emitted": 3, "drafted": 6, "accepted": 1}]) == {
        "accept": 0.467, "tok_per_step": 2.4}  # 14 / 30, 24 / 10
    assert spec_summary([{"steps": 5, "emitted": 5, "drafted": 0, "accepted": 0}]) == {
        "accept": None, "tok_per_step": None}


def chunk(tokens: int, wall_s: float) -> dict:
    return {"tokens": tokens, "wall_s": wall_s}


def test_ratios_pair_rounds_and_report_their_median_and_spread() -> None:
    assert spread([3.0, 1.0, 2.0, 10.0]) == {"med": 2.5, "min": 1.0, "max": 10.0}
    assert round_ratios([chunk(100, 1.0), chunk(300, 2.0)], [chunk(50, 1.0), chunk(100, 1.0)]) == [2.0, 1.5]
    assert [verdict(spread(r)) for r in ([1.2, 1.1], [0.9, 0.8], [1.1, 0.95])] == ["wins", "loses", "even"]
    fast, slow = [chunk(200, 1.0), chunk(180, 1.0)], [chunk(100, 1.0), chunk(120, 1.0)]
    chunks = {("ngram", 1): {"none": fast, "inflight": fast, "native": slow},
              ("plain", 1): {"none": slow, "inflight": slow, "native": slow}}
    table = ratio_table(chunks, [1])
    assert table["ngram_vs_plain"] == [
        {"batch": 1, "mode": "none", "med": 1.75, "min": 1.5, "max": 2.0, "speculation": "wins"},
        {"batch": 1, "mode": "inflight", "med": 1.75, "min": 1.5, "max": 2.0, "speculation": "wins"},
        {"batch": 1, "mode": "native", "med": 1.0, "min": 1.0, "max": 1.0, "speculation": "even"}]
    assert table["inflight_vs_native"] == [{"batch": 1, "engine": "plain", "med": 1.0, "min": 1.0, "max": 1.0},
                                           {"batch": 1, "engine": "ngram", "med": 1.75, "min": 1.5, "max": 2.0}]
