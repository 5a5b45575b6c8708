"""The README's headline table against the committed data: each row either quotes figures that
equal its JSON under ``bench/results/`` (or ``bench/``), with the command that made them, or
says in its date cell that it has no committed JSON. No engine, no clock."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NO_JSON = "(no committed JSON)"


def headline_rows() -> dict[str, dict[str, str]]:
    """The table under README's ``| what | latest figure | command | date |`` header, by its
    first cell."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("| what | latest figure | command | date |") + 2
    rows = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        what, figure, command, date = (c.strip() for c in line.strip("|").split(" | "))
        rows[what] = {"figure": figure, "command": command, "date": date}
    return rows


def cli(command: str) -> str:
    """A recorded ``python -m inflight.bench.X ...`` as the README writes it: ``inflight bench X ...``."""
    return re.sub(r"^python -m inflight\.bench\.(\w+)", r"inflight bench \1", command)


def _links(rows: dict) -> tuple[list[str], list[str]]:
    """The shaped-link runs of 2026-11-28 (``bench/scale_slow_link_runs.json``)."""
    runs = json.loads((ROOT / "bench" / "scale_slow_link_runs.json").read_text())["runs"]
    first = {r["link"] or "loopback": {x["mode"]: x for x in r["rows"]} for r in runs if r["recorded"].startswith("2026-11-28")}
    want = []
    for rate in ("10gbit", "1gbit"):
        inf, nat = first[rate]["inflight"]["lost_ms_per_update"], first[rate]["native@inflight"]["lost_ms_per_update"]
        want += [f"{inf} vs {round(nat)} ms", f"({100 * inf / nat:.1f}%)"]
    slow = first["100mbit"]
    want += [f"native {round(slow['native@inflight']['lost_ms_per_update'])} ms",
             f"({round(slow['inflight']['lost_ms_per_update'])} ms)"]
    commands = [cli(r["command"]) for r in runs if r["recorded"].startswith("2026-11-28") and r["link"] == "1gbit"]
    return want, commands


def _scale(rows: dict) -> tuple[list[str], list[str]]:
    """The predictions' declared misses (``bench/scale_predictions.json``)."""
    preds = json.loads((ROOT / "bench" / "scale_predictions.json").read_text())
    checks = sum(len([m for m in p["modes"] if m != "none_step_ms"]) for p in preds["predictions"].values())
    return [f"**{len(preds['expected_misses'])} of {checks} checks are declared misses**"], ["inflight bench scale"]


def _suite(rows: dict) -> tuple[list[str], list[str]]:
    """The last fresh-clone ``make test`` recorded (``bench/results/suite.jsonl``)."""
    runs = [json.loads(x) for x in (ROOT / "bench" / "results" / "suite.jsonl").read_text().splitlines()]
    run = [r for r in runs if r["clone"] == "fresh"][-1]
    return [f"{run['passed']} passed, {run['failed']} failed, {run['skipped']} `gpu`",
            f"{round(run['wall_s'] / 60)} min ({round(run['tests_s'] / 60)} min of tests)"], [run["command"]]


def _grpo_system(rows: dict) -> tuple[list[str], list[str]]:
    """The last ``bench.grpo --workload system`` run with the listener on the trainer's core
    (``bench/results/grpo.jsonl``)."""
    runs = [json.loads(x) for x in (ROOT / "bench" / "results" / "grpo.jsonl").read_text().splitlines()]
    run = [r for r in runs if r["workload"] == "system" and r["listener_core"] == "trainer"][-1]
    mode = {r["mode"]: r for r in run["rows"] if r["engine"] == "cache"}
    inf, salt, reset = mode["inflight"], mode["native-salt"], mode["native-reset"]
    lo, hi = inf["vs_native_salt_spread"]
    return [f"**{inf['vs_native_salt_median']}x**", f"median of {run['rounds']} rounds, rounds {lo}-{hi}",
            f"cache hit rate {inf['hit_rate']} vs {salt['hit_rate']}", f"{reset['vs_native_salt_median']}x native-salt",
            f"{inf['vs_none']}x the tokens/s of no updates (native-salt {salt['vs_none']}x)"], [cli(run["command"])]


SOURCES: dict[str, Callable[[dict], tuple[list[str], list[str]]]] = {
    "decode time lost per update over emulated links (network namespace, `tbf`), SmolLM2-135M fp32, split cores, "
    "same cadence": _links,
    "GPU fleets at scale (a model, not a GPU run)": _scale,
    "test suite, fresh clone, install included (machine otherwise idle)": _suite,
    "GRPO groups of 8 sharing a 2048-token system prompt (32-token questions, 64 sampled), an update every 16 steps, "
    "prefix caching on": _grpo_system,
}
"""Row -> what its figure cell must quote from its JSON, and the commands its command cell
must start with (one of)."""


def test_every_headline_figure_is_its_json_or_says_it_has_none() -> None:
    rows = headline_rows()
    assert set(SOURCES) <= set(rows), set(SOURCES) - set(rows)
    for what, row in rows.items():
        if what not in SOURCES:
            assert row["date"].endswith(NO_JSON), f"{what!r}: no JSON checks its figure; its date cell must say {NO_JSON}"
            continue
        assert NO_JSON not in row["date"], what
        quotes, commands = SOURCES[what](rows)
        for q in quotes:
            assert q in row["figure"], (what, q)
        assert any(row["command"].strip("`").startswith(c) for c in commands), (what, row["command"], commands)


def test_the_links_rows_quotes_would_catch_a_changed_figure() -> None:
    """The check has power: the row with one measured figure altered fails it."""
    rows = headline_rows()
    what = next(w for w in SOURCES if w.startswith("decode time lost per update over emulated links"))
    quotes, _ = SOURCES[what](rows)
    altered = rows[what]["figure"].replace("186.1 vs", "186.2 vs")
    assert altered != rows[what]["figure"] and not all(q in altered for q in quotes)


def test_a_suite_run_is_read_from_pytests_last_line() -> None:
    from inflight.bench.suite_record import summary

    assert summary("...\n=== 844 passed, 56 skipped, 3 warnings in 2437.12s (0:40:37) ===\n") == \
        {"passed": 844, "failed": 0, "skipped": 56, "tests_s": 2437.12}
    assert summary("1 failed, 754 passed, 2 skipped in 100.5s")["failed"] == 1
