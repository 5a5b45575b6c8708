"""Every library module's docstring states its purpose and its invariants, and nothing else:
at most ``MAX_LINES`` lines, and no figure measured on some machine or run (those go stale;
they live in docs/performance.md, the rationale in docs/design.md).

Read from the source with ``ast``: no project module is imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("inflight", "engine_patches", "trainer", "kernels")
"""The library's folders; ``bench/`` and ``tests/`` are not checked."""
MAX_LINES = 20

_NUMBER = r"\d[\d.,]*(?:\s*[-\u2013]\s*\d[\d.,]*)?"
_UNIT = r"(?:ms|s|GB|MB|GiB|MiB|%)(?![A-Za-z])"
MEASUREMENT = re.compile(
    "|".join([
        r"\b(?:\d+|none|one|two|three|four|five)\s+of\s+\d+\b",  # "15 of 24": counts from a run
        r"[~\u2248]\s*\d",  # "~5 ms", "~270 loaders"
        r"\b[Mm]easured\b",
        rf"\([^()]*?(?<![\w.]){_NUMBER}\s*{_UNIT}[^()]*\)",  # "(0.54 GB)", "(tens of ms, 2.8% ...)"
        rf"\b(?:about|takes)\s+{_NUMBER}\s*{_UNIT}",  # "takes 0.1-60 s", "about 3 GB"
    ]))
"""Phrasings of a measurement. Design constants ("polls every 50 ms", "64-byte aligned",
"at most two buckets in flight") do not match."""


def measurements(text: str) -> list[str]:
    """The measurement phrasings in ``text``."""
    return [m.group(0) for m in MEASUREMENT.finditer(text)]


def _docstrings() -> dict[str, str]:
    out = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text()))
            if doc:
                out[str(path.relative_to(ROOT))] = doc
    return out


def test_the_library_has_module_docstrings_to_check() -> None:
    assert len(_docstrings()) > 50


def test_every_module_docstring_is_at_most_twenty_lines() -> None:
    long = {path: len(doc.splitlines()) for path, doc in _docstrings().items() if len(doc.splitlines()) > MAX_LINES}
    assert not long, long


def test_no_module_docstring_holds_a_measurement() -> None:
    found = {path: hits for path, doc in _docstrings().items() if (hits := measurements(doc))}
    assert not found, found


def test_the_measurement_check_finds_a_planted_figure() -> None:
    for text in ["whole episodes solve 15 of 24 with it",
                 "creating the handles alone is ~5 ms per layer here",
                 "an ordinary fp32 model (0.54 GB) that vLLM serves",
                 "a verifier that runs code takes 0.1-60 s",
                 "2.8% of the dense bytes, as measured on SmolLM2",
                 "a page fault per 4 KiB (~0.1-0.2 s per 0.5 GB here)",
                 "the stall (tens of ms, 12% of a step)",
                 "a push takes about 3 GB of pinned memory"]:
        assert measurements(text), text


def test_the_measurement_check_lets_design_constants_through() -> None:
    for text in ["the collector polls every 50 ms",
                 "offsets are 64-byte aligned",
                 "at most two buckets in flight per destination",
                 "restarted at most every 30 s",
                 "a page fault per 4 KiB on first touch",
                 "group k of v is accepted only after groups 0..k-1",
                 "(``staged_groups``, default 2)",
                 "a lag of 1 ms would be refused",
                 "engine i's workers are ranks 1 .. tensor_parallel_size"]:
        assert not measurements(text), (text, measurements(text))
