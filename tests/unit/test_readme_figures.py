"""The README's headline table against the committed data: each row either quotes figures that
equal its JSON under ``bench/results/`` (or ``bench/``), with the command that made them, or
says in its date cell that it has no committed JSON. No engine, no clock."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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
    """A recorded ``python -m inflight.bench.X ...`` as the README writes it: ``inflight bench X ...``,
    without ``--results PATH`` or ``--out PATH`` (where the run's line and rows went, not settings
    of the run)."""
    named = re.sub(r"^python -m inflight\.bench\.(\w+)", r"inflight bench \1", command)
    return re.sub(r" --(?:results|out) \S+", "", named)


def _scale_record() -> tuple[dict, list[dict]]:
    """``bench.scale``'s predictions (``bench/scale_predictions.json``) and every recorded run
    (``bench/scale_slow_link_runs.json``)."""
    return (json.loads((ROOT / "bench" / "scale_predictions.json").read_text()),
            json.loads((ROOT / "bench" / "scale_slow_link_runs.json").read_text())["runs"])


def _links(rows: dict) -> tuple[list[str], list[str]]:
    """The shaped-link runs of 2026-11-28 (``bench/scale_slow_link_runs.json``)."""
    runs = _scale_record()[1]
    first = {r["link"] or "loopback": {x["mode"]: x for x in r["rows"]}
             for r in runs if r["recorded"].startswith("2026-11-28")}
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
    """The predictions' declared misses (``bench/scale_predictions.json``), and how many checks
    the judged runs (``bench/scale_slow_link_runs.json``) hold."""
    from inflight.bench.scale_replay import judge, judged_runs

    preds, runs = _scale_record()
    checks = sum(len([m for m in p["modes"] if m != "none_step_ms"]) for p in preds["predictions"].values())
    held = judge(preds, runs)
    judged = sum(len(r) for r in judged_runs(preds, runs).values())
    return [f"**{len(preds['expected_misses'])} of {checks} checks are declared misses**",
            f"{sum(c['ok'] for c in held)} of {len(held)} checks within their bands on {judged} judged runs"], \
        ["inflight bench scale"]


def _results(bench: str) -> list[dict]:
    """``bench/results/<bench>.jsonl``, a run per line."""
    return [json.loads(x) for x in (ROOT / "bench" / "results" / f"{bench}.jsonl").read_text().splitlines()
            if x.strip()]


def _suite(rows: dict) -> tuple[list[str], list[str]]:
    """The last fresh-clone ``make test`` recorded (``bench/results/suite.jsonl``)."""
    run = [r for r in _results("suite") if r["clone"] == "fresh"][-1]
    return [f"{run['passed']} passed, {run['failed']} failed, {run['skipped']} `gpu`",
            f"{round(run['wall_s'] / 60)} min ({round(run['tests_s'] / 60)} min of tests)"], [run["command"]]


def _grpo_run(workload: str, core: str, nice: int) -> tuple[dict, dict[str, dict]]:
    """The last ``bench.grpo --workload WORKLOAD --listener-core CORE --listener-nice NICE`` run
    (``bench/results/grpo.jsonl``) and its cache engine's rows by mode."""
    run = [r for r in _results("grpo")
           if (r["workload"], r["listener_core"], r["listener_nice"]) == (workload, core, nice)][-1]
    return run, {r["mode"]: r for r in run["rows"] if r["engine"] == "cache"}


def _grpo(workload: str) -> tuple[dict, dict[str, dict], list[str]]:
    """The quotes every GRPO row makes: with the listener on the trainer's core, the ratio to
    native-salt with its rounds, the hit rates and the share of no updates; with it on the
    engine's core at the engine's priority (where and how native receives), the ratio with its
    rounds. The trainer-core run and its rows come back for the row's own quotes."""
    run, mode = _grpo_run(workload, "trainer", 19)
    inf, salt = mode["inflight"], mode["native-salt"]
    lo, hi = inf["vs_native_salt_spread"]
    quotes = [f"**{inf['vs_native_salt_median']}x**", f"median of {run['rounds']} rounds, rounds {lo}-{hi}",
              f"cache hit rate {inf['hit_rate']} vs {salt['hit_rate']}",
              f"{inf['vs_none']}x the tokens/s of no updates (native-salt {salt['vs_none']}x)"]
    e = _grpo_run(workload, "engine", 0)[1]["inflight"]
    lo, hi = e["vs_native_salt_spread"]
    quotes.append(f"the listener on the engine's core at its priority, where native receives: "
                  f"**{e['vs_native_salt_median']}x** (rounds {lo}-{hi})")
    return run, mode, quotes


def _grpo_system(rows: dict) -> tuple[list[str], list[str]]:
    """The shared system prompt workload; its row also quotes native-reset."""
    run, mode, quotes = _grpo("system")
    return [*quotes, f"{mode['native-reset']['vs_native_salt_median']}x native-salt"], [cli(run["command"])]


def _grpo_multi_turn(rows: dict) -> tuple[list[str], list[str]]:
    """The multi-turn workload, histories growing across commits."""
    run, _, quotes = _grpo("multi-turn")
    return quotes, [cli(run["command"])]


def _train(config: str) -> dict:
    """The last ``bench.train_record`` run of a packaged config, without overrides."""
    return [r for r in _results("train") if r["config"] == config and not r["sets"]][-1]


def _demo(rows: dict) -> tuple[list[str], list[str]]:
    """``make demo`` (``inflight train --config demo``) as ``bench.train_record`` ran it."""
    run = _train("demo")
    s = run["summary"]
    return [f"{s['steps']} steps", f"reward {s['reward_first_20pct']:.3f} -> {s['reward_last_20pct']:.3f}",
            f"{100 * s['frac_samples_multi_version']:.1f}% of samples span >1 version",
            f"engine stall {s['stall_ms_mean']:.1f} ms per update",
            f"{run['pushes']['on_every_engine']} of {run['pushes']['landed']} pushes committed",
            f"{round(run['wall_s'])} s"], \
        ["make demo", run["train"]]


def _smollm2(rows: dict) -> tuple[list[str], list[str]]:
    """``inflight train --config smollm2_cpu`` as ``bench.train_record`` ran it."""
    run = _train("smollm2_cpu")
    s = run["summary"]
    return [f"{s['steps']} steps", f"sampled reward {s['reward_first_20pct']:.3f} -> {s['reward_last_20pct']:.3f}",
            f"greedy held-out {s['eval_accuracy_first']:.3f} -> {s['eval_accuracy_last']:.3f}",
            f"{run['pushes']['on_every_engine']} of {run['pushes']['landed']} pushes committed",
            f"{round(run['wall_s'])} s", f"load {min(run['load_1m']):.1f}-{max(run['load_1m']):.1f}"], [run["train"]]


def _fleet(rows: dict) -> tuple[list[str], list[str]]:
    """``inflight train --config fleet_cpu`` as ``bench.train_record`` ran it."""
    run = _train("fleet_cpu")
    p = run["pushes"]
    return [f"{run['summary']['steps']} steps", f"{p['on_every_engine']} of {p['landed']} pushes committed on all "
            f"{p['engines']} engines"], [run["train"]]


def _loopback_runs() -> list[dict]:
    """The judged loopback runs of ``bench.scale`` (``bench/scale_slow_link_runs.json``)."""
    from inflight.bench.scale_replay import judged_runs

    return judged_runs(*_scale_record())["loopback"]


def _mode_median(runs: list[dict], mode: str, key: str) -> float:
    import statistics

    return statistics.median(next(r for r in run["rows"] if r["mode"] == mode)[key] for run in runs)


def _loopback(rows: dict) -> tuple[list[str], list[str]]:
    """Decode lost per update over loopback, and the stall at the commit step: the medians of
    the judged runs."""
    runs = _loopback_runs()
    inf = _mode_median(runs, "inflight", "lost_ms_per_update")
    nat = _mode_median(runs, "native@inflight", "lost_ms_per_update")
    return [f"in-flight **{inf:.1f} ms** vs vLLM native pause+update {nat:.1f} ms ({100 * inf / nat:.1f}%)",
            f"medians of {len(runs)} runs", f"in-flight's commit {_mode_median(runs, 'inflight', 'commit_ms'):.2f} ms",
            f"native's stall at its update steps {_mode_median(runs, 'native@inflight', 'stall_ms'):.0f} ms"], \
        sorted({cli(r["command"]) for r in runs})


def _sparse(rows: dict) -> tuple[list[str], list[str]]:
    """``bench.sparse --run`` over a bf16, sparse ``smollm2_cpu`` run."""
    line = [r for r in _results("sparse") if "run" in r][-1]
    s = line["run"]
    cfg = s["config"]
    assert (cfg["model"]["dtype"], cfg["transport"]["encoding"]) == ("bfloat16", "sparse")
    return [f"**{s['sent_mb']['mean']:.1f} MB** sent per update against {s['dense_mb']:.1f} MB dense "
            f"({100 * s['sent_over_dense']:.2f}%; {100 * s['changed_frac']['mean']:.1f}% of the weights changed "
            "per step)",
            f"over {s['sparse']} sparse pushes"], [f"inflight train --config smollm2_cpu --set model.dtype=bfloat16 "
                                                   "--set transport.encoding=sparse --set run.steps="
                                                   f"{cfg['run']['steps']}"]


def _staging(rows: dict) -> tuple[list[str], list[str]]:
    """One update's staging, engine idle (``bench.profile_staging``)."""
    line = _results("profile_staging")[-1]
    total = "staging total (announce to Staged)"
    return [f"{line['idle'][total]['wall_ms']} ms wall", f"median of {line['updates']} updates",
            f"{line['decoding'][total]['wall_ms']} ms while the engine decodes"], [cli(line["command"])]


def _last_e2e(workload: str) -> dict:
    """The last ``bench.e2e`` run of ``workload``."""
    return [r for r in _results("e2e") if r["workload"] == workload][-1]


def _e2e(rows: dict) -> tuple[list[str], list[str]]:
    """The training loop's samples/s, in-flight against batch-boundary (``bench.e2e``)."""
    line = _last_e2e("tiny")
    ratios = {cores: line["summary"][cores]["ratios"] for cores in line["summary"]}
    quotes = [f"**{r['inflight/batch']}x** {cores} ({r['inflight/pause']}x against pause)"
              for cores, r in ratios.items()]
    return [*quotes, f"medians of {line['rounds']} interleaved rounds of {line['steps']} steps"], [cli(line["command"])]


def _trainer_step(rows: dict) -> tuple[list[str], list[str]]:
    """One optimizer step of the leg-counting config, padded, packed and prefix-shared
    (``bench.trainer_step``)."""
    line = _results("trainer_step")[-1]
    s = {mode: line["summary"][mode] for mode in ("padded", "packed", "prefix_shared")}
    shared, padded = s["prefix_shared"], s["padded"]
    return [f"prefix-shared **{shared['step_s']['median']:.1f} s** per step "
            f"({shared['vs_padded']['step_time']:.2f}x padded's {padded['step_s']['median']:.1f} s)",
            f"peak **{shared['peak_rss_gb']['median']:.2f} GB** resident (padded {padded['peak_rss_gb']['median']:.2f} "
            f"GB, packed {s['packed']['peak_rss_gb']['median']:.2f} GB)",
            f"{shared['trainer_tokens']:.0f} tokens as laid out against padded's {padded['trainer_tokens']:.0f}",
            f"prompts once per group ({shared['prompt_passes']:.3f} of a pass per sample)",
            f"medians of {line['rounds']} interleaved rounds of {line['steps']} steps",
            f"load {min(line['load']):.1f}-{max(line['load']):.1f}"], [cli(line["command"])]


def _e2e_leg_counting(rows: dict) -> tuple[list[str], list[str]]:
    """The training loop on the leg-counting config (``bench.e2e --workload smollm2-leg-counting``):
    whether it is trainer-bound, and the ratios."""
    line = _last_e2e("smollm2-leg-counting")
    (cores, s), = line["summary"].items()
    m, r = s["modes"], s["ratios"]
    return [f"{cores}: in-flight **{r['inflight/pause']}x** pause, **{r['inflight/batch']}x** batch-boundary "
            f"({m['inflight']['samples_s']}, {m['pause']['samples_s']} and {m['batch']['samples_s']} samples/s)",
            f"the trainer waited {100 * m['inflight']['wait_share']:.0f}% of in-flight's steps and "
            f"{100 * m['pause']['wait_share']:.0f}% of pause's, {100 * m['batch']['wait_share']:.0f}% of batch's",
            f"median trainer step {m['inflight']['trainer_ms'] / 1e3:.1f} s in-flight",
            f"medians of {line['rounds']} interleaved rounds of {line['steps']} steps"], [cli(line["command"])]


def _staleness(rows: dict) -> tuple[list[str], list[str]]:
    """Max lag 8 against batch RL (``bench.staleness``)."""
    line = _results("staleness")[-1]
    run = {r["run"]: r for r in line["rows"]}
    lag, batch = run["lag8 TIS"], run["batch TIS"]
    return [f"{line['target']} reward after {lag['samples_to_target']} samples vs {batch['samples_to_target']}",
            f"steps of {lag['step_ms_median']} ms vs {batch['step_ms_median']} ms"], [cli(line["command"])]


def _trainer_push(rows: dict) -> tuple[list[str], list[str]]:
    """What a push costs the trainer (``bench.trainer_push``)."""
    line = _results("trainer_push")[-1]
    return [f"{line['max_extra_mib']:.1f} MiB resident at most during a push (buckets of "
            f"{line['bucket_mib']:.0f} MiB), not the {line['model_mib']:.0f} MiB model",
            f"the optimizer waited {line['steps']['read_wait_s']:.2f} s",
            f"an optimizer step took {line['steps']['step_with_push_s']:.2f} s with a push in flight, "
            f"{line['steps']['step_alone_s']:.2f} s alone"], \
        [cli(line["command"])]


SOURCES: dict[str, Callable[[dict], tuple[list[str], list[str]]]] = {
    "decode time lost per update over emulated links (network namespace, `tbf`), SmolLM2-135M fp32, split cores, "
    "same cadence": _links,
    "GPU fleets at scale (a model, not a GPU run)": _scale,
    "test suite, fresh clone (install included unless its `.venv` was there)": _suite,
    "GRPO groups of 8 sharing a 2048-token system prompt (32-token questions, 64 sampled), an update every 16 steps, "
    "prefix caching on": _grpo_system,
    "GRPO groups of 8 in 4-turn episodes (256-token prompts; per turn 32 tokens sampled, then a 32-token tool result), "
    "histories growing across commits, an update every 16 steps": _grpo_multi_turn,
    "decode time lost per update over loopback, SmolLM2-135M fp32 (0.54 GB), split cores, same cadence; the stall at "
    "the commit step": _loopback,
    "CPU demo (tiny Qwen2, 200 steps)": _demo,
    "what a push costs the trainer, SmolLM2-135M fp32": _trainer_push,
    "staging one 0.54 GB update, engine idle": _staging,
    "training loop, samples/s vs batch-boundary RL": _e2e,
    "fleet of 2 engines, 100 steps": _fleet,
    "SmolLM2-135M on one-digit addition, 40 steps": _smollm2,
    "staleness: max lag 8 vs batch RL": _staleness,
    "training loop on SmolLM2-135M fp32, reasoning-gym leg counting (the trainer row's config), one engine":
    _e2e_leg_counting,
    "one trainer step, SmolLM2-135M fp32 on reasoning-gym leg counting (2 groups of 8, ~330-token prompts, 64 "
    "completion tokens), one process": _trainer_step,
    "sparse updates over 58 real RL steps, SmolLM2-135M (fp32 master, bf16 engine)": _sparse,
}
"""Row -> what its figure cell must quote from its JSON, and the commands its command cell
must start with (one of)."""


def test_every_headline_figure_is_its_json_or_says_it_has_none() -> None:
    rows = headline_rows()
    assert set(SOURCES) <= set(rows), set(SOURCES) - set(rows)
    for what, row in rows.items():
        if what not in SOURCES:
            assert row["date"].endswith(NO_JSON), (f"{what!r}: no JSON checks its figure; its date cell must say "
                                                   f"{NO_JSON}")
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


def test_a_training_runs_pushes_count_only_those_every_engine_committed() -> None:
    from inflight.bench.train_record import pushes

    rows = [{"pushes_landed": [[1, [1, 2]], [2, [1]]]}, {}, {"pushes_landed": [[3, [2, 1]]]}]
    assert pushes(rows, 2) == {"engines": 2, "landed": 3, "on_every_engine": 2}
    assert pushes(rows, 1)["on_every_engine"] == 1  # [1] alone is every engine of one


def test_a_runs_line_is_appended_never_replacing_the_file(tmp_path: Path) -> None:
    from inflight.bench.run_record import append_result

    path = tmp_path / "x.jsonl"
    append_result(path, {"a": 1})
    append_result(path, {"a": 2})
    append_result("", {"a": 3})  # '' writes nothing
    assert [json.loads(x) for x in path.read_text().splitlines()] == [{"a": 1}, {"a": 2}]
