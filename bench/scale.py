"""At scale, on paper: in-flight updates vs pause-based and batch-boundary sync for a fleet.

    inflight bench scale [--configs bench/scenarios/*.toml] [--cpu-bench bench/scale_cpu_bench.json]
                         [--png docs/scale.png]          (or: python -m inflight.bench.scale ...)

For each scenario (one TOML under bench/scenarios/, every figure published or derived from
one, with its source beside it), first what an update moves: the bytes the trainer sends
one engine and the most one rank stages, from the model's shapes (``scale_shapes``), and
pause's update time at each system's published rate (``transfers.toml``). Then each way of
updating is planned (``scale_fleet.plan``: memory, concurrency, decode step time, what an
update costs) and one engine is stepped through a dozen updates (``scale_model.simulate``);
a fleet's tokens/s is its engines'; the layer-granular commit's modes get a table of their
own, beside pause and the shard modes (``scale_layer``). Pause runs at the fastest published
rate, and again at checkpoint-engine's. Where in-flight gains little, its cadence: how often
it can update and still decode what pause does. Then two sweeps find where in-flight stops
paying: request length (the KV cache that staging takes matters once memory, not
``max_num_seqs``, bounds concurrency) and update period (pausing costs less the rarer the
updates). Last, the same
model, fed the costs a ``inflight.bench.inflight`` run measured on this machine, predicts that run's
tokens/s ratios.

Prints markdown tables and one JSON line; writes the figure.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from inflight.bench.scale_fleet import (BUILT, CPU_LENGTHS, SCENARIOS, VARIANTS, Plan, Scenario, bytes_row, cpu_step_time,
                               cpu_update, plan, published_rows, scenario_paths)
from inflight.bench.scale_layer import layer_rows, layer_table
from inflight.bench.scale_model import Run, simulate

LENGTH_FACTORS = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0, 2.0)
PERIODS_S = (5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
TOLERANCE = 0.15  # the CPU check: every predicted ratio within 15% of the measured one
BESIDE = "checkpoint-engine"  # pause is shown at this system's published rate too
# the sweeps' in-flight variants: the first that fits of each, and its line style
PLACES = (("device", ("inflight", "inflight_shard")), ("host", ("inflight_host", "inflight_host_shard")),
          ("layer", ("inflight_layer",)))
LINES = {"device": "-", "host": "--", "layer": ":"}


def run_plan(p: Plan, s: Scenario, updates: int = 12, seed: int = 0) -> Run | None:
    """One engine of ``p``, warmed up for the longest request (so every slot holds a request of
    any age), then run for ``updates`` update periods and at least twice the longest request
    (so the lag of long requests is seen)."""
    if p.slots == 0:
        return None
    steps_per_period = s.updates.every_s / p.step(p.slots)
    steps = int(max(updates * steps_per_period, 2 * s.lengths.high))
    return simulate(p.slots, p.step, p.update, s.lengths, steps=steps, seed=seed, warmup_steps=s.lengths.high)


def scenario_rows(s: Scenario) -> list[dict]:
    """One table row per variant of scenario ``s``: memory, concurrency, and what its engine did;
    pause once more at checkpoint-engine's published rate (``pause@checkpoint-engine``)."""
    beside = f"pause@{BESIDE}"
    plans = {v: plan(s, v) for v in VARIANTS} | {beside: plan(s.via(BESIDE), "pause")}
    runs = {v: run_plan(p, s) for v, p in plans.items()}
    ceiling = runs["none"]
    rows = []
    for v in plans:
        p, r = plans[v], runs[v]
        row = {"scenario": s.name, "variant": v, "built": p.variant in BUILT, "fits": r is not None, "note": p.note,
               "slots": p.slots, "kv_lost": round(1 - p.kv_tokens / plans["none"].kv_tokens, 3),
               "staging_gb_gpu": round(p.staging_gb_gpu, 1), "host_gb_node": round(p.host_gb_node),
               "stall_s": round(p.update.stall_s, 3)}
        if r is not None:
            # Everything the variant decodes less than the ceiling would have in the same time,
            # per update: the stalls, the slower steps while staging, and fewer slots.
            lost = (r.wall_s - r.tokens / ceiling.tok_s) / r.updates if r.updates else 0.0
            row |= {"tok_s": round(s.fleet.engines * r.tok_s), "vs_none": round(r.tok_s / ceiling.tok_s, 3),
                    "step_ms": round(1e3 * p.step(p.slots), 1), "updates": r.updates,
                    "span_s": round(r.span_s / r.updates, 2) if r.commits and r.updates else None,
                    "lost_s_per_update": round(lost, 3), "lag_mean": round(r.lag_mean, 2),
                    "lag_p50": r.lag_quantile(0.5), "lag_p90": r.lag_quantile(0.9), "lag_max": max(r.lag_hist, default=0)}
        rows.append(row)
    return rows


def best_fit(s: Scenario, variants: tuple[str, ...]) -> str | None:
    """The first of ``variants`` (full staging before shard) that fits the scenario."""
    return next((v for v in variants if plan(s, v).slots > 0), None)


def gain(s: Scenario, variant: str) -> float:
    """In-flight's tokens/s over pause's (> 1: in-flight pays); 0 where it does not fit."""
    r_in, r_pause = run_plan(plan(s, variant), s, updates=6), run_plan(plan(s, "pause"), s, updates=6)
    return r_in.tok_s / r_pause.tok_s if r_in and r_pause else 0.0


def cadence(s: Scenario) -> dict | None:
    """Where in-flight gains little over pause: the shortest update period at which the best
    in-flight variant that fits still decodes pause's tokens/s at the scenario's period (at
    most as often as the link lands a version), the updates per hour that leaves, and the
    lag (versions, i.e. trainer steps, and seconds) of its tokens then, beside pause's."""
    fits = [v for v in VARIANTS if v.startswith("inflight") and plan(s, v).slots > 0]
    if not fits:
        return None
    v = max(fits, key=lambda v: gain(s, v))

    def run(period: float) -> Run:
        at = s.replace(every_s=period)
        return run_plan(plan(at, v), at, updates=6)

    target, here = run_plan(plan(s, "pause"), s, updates=6), run(s.updates.every_s)
    out = {"scenario": s.name, "variant": v, "pause_per_hour": round(3600 / s.updates.every_s, 1),
           "pause_lag_mean": round(target.lag_mean, 2), "pause_lag_p90": target.lag_quantile(0.9),
           "pause_lag_mean_s": round(target.lag_mean * s.updates.every_s, 1)}
    if here.tok_s < target.tok_s:
        return out | {"inflight_per_hour": None}
    lo, hi = plan(s, v).update.stage_s, s.updates.every_s  # a version cannot land faster than the link moves it
    if run(lo).tok_s >= target.tok_s:
        hi = lo
    for _ in range(12):  # bisection on log(period): tokens/s falls as updates come more often
        if hi / lo < 1.02:
            break
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if run(mid).tok_s >= target.tok_s else (mid, hi)
    r = run(hi)
    return out | {"inflight_per_hour": round(3600 / hi, 1), "period_s": round(hi, 2), "lag_mean": round(r.lag_mean, 2),
                  "lag_p90": r.lag_quantile(0.9), "lag_mean_s": round(r.lag_mean * hi, 1)}


def crossover(xs: tuple[float, ...], ys: list[float]) -> float | None:
    """Where ys crosses 1, interpolated on log x; None if it never does."""
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if y0 > 0 and y1 > 0 and (y0 - 1) * (y1 - 1) <= 0 and y0 != y1:
            return round(math.exp(math.log(x0) + (1 - y0) / (y1 - y0) * (math.log(x1) - math.log(x0))), 3)
    return None


def sweeps(s: Scenario) -> dict:
    """In-flight over pause against request length and against update period, for the device-
    and the host-staged in-flight variant that fit (full staging if it fits, else shard), and
    the layer-granular commit on the device."""
    out = {"scenario": s.name, "mean_len": round(s.lengths.moments()[0])}
    for place, variants in PLACES:
        v = best_fit(s, variants)
        if v is None:
            continue
        by_len = [gain(s.replace(lengths=s.lengths.scaled(f)), v) for f in LENGTH_FACTORS]
        by_period = [gain(s.replace(every_s=p), v) for p in PERIODS_S]
        out[place] = {"variant": v, "by_length": [round(g, 4) for g in by_len], "by_period": [round(g, 4) for g in by_period],
                      "length_factor_crossover": crossover(LENGTH_FACTORS, by_len),
                      "period_s_crossover": crossover(PERIODS_S, by_period)}
    return out


MEASURED = ("tok_s", "vs_none", "step_ms", "stall_ms", "commit_ms", "stage_ms", "ms_per_gb")
DISTURBED = 1.3  # a none run whose mean step exceeds its median step by this was itself disturbed


def reference_ok(run: dict, size: str, every: int) -> bool:
    """Whether a run's ``none`` rows (the reference every ratio divides by) ran undisturbed:
    their mean step (concurrency / tokens per second) within ``DISTURBED`` x their median step.
    On a machine shared with other jobs a reference can lose seconds to them, which shows as
    a mean far above the median (a few very long steps) and inflates every ratio against it."""
    none = next(r for r in run["rows"] if r["size"] == size and r["every"] == every and r["mode"] == "none")
    return run["concurrency"] / none["tok_s"] <= DISTURBED * none["step_ms"] / 1e3


def merge_repeats(runs: list[dict]) -> list[dict]:
    """The rows of repeated ``inflight.bench.inflight`` runs (same settings), each measured field the
    mean over the repeats whose reference ran undisturbed (all of them, flagged
    ``disturbed``, where none did): one run's ratios move by 10-20% with the machine's load."""
    merged = []
    for first in runs[0]["rows"]:
        key = (first["size"], first["every"], first["mode"])
        good = [run for run in runs if reference_ok(run, first["size"], first["every"])]
        same = [r for run in (good or runs) for r in run["rows"] if (r["size"], r["every"], r["mode"]) == key]
        merged.append({k: sum(r[k] for r in same) / len(same) if k in MEASURED and v is not None else v
                       for k, v in first.items()} | {"disturbed": not good, "repeats": len(same)})
    return merged


def validate_cpu(bench: dict) -> list[dict]:
    """Predict the tokens/s ratios of ``inflight.bench.inflight`` runs from what they measured.

    ``bench["runs"]``: each {"concurrency", "steps", "rounds", "rows"}; the runs with the
    first run's settings are repeats (averaged), the others add decode step times at other
    concurrencies. Inputs per model size: the decode step time (the median steps of ``none``
    and ``native`` at each concurrency, a line through them), the native stall, batch's idle
    update, the in-flight staging time and commit. How much longer a decode step is while a
    version stages beside it is not separable from throughput in such a run, so it is
    calibrated on the smallest model at the shortest cadence and carried to the other rows:
    those predictions are out of sample."""
    main = bench["runs"][0]

    def settings(run: dict) -> tuple[int, int, int]:
        return run["concurrency"], run["steps"], run["rounds"]

    rows = merge_repeats([run for run in bench["runs"] if settings(run) == settings(main)])
    others = [run for run in bench["runs"] if run["concurrency"] != main["concurrency"]]
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    everys = sorted({r["every"] for r in rows})

    def row(size: str, every: int, mode: str) -> dict:
        return next(r for r in rows if r["size"] == size and r["every"] == every and r["mode"] == mode)

    def step_ms(run_rows: list[dict], size: str) -> float:
        """Decode step at a run's concurrency: the median quiet step of ``none`` and ``native``
        (the same decoding; native's stalls are not among its quiet steps), averaged."""
        ms = [r["step_ms"] for r in run_rows if r["size"] == size and r["mode"] in ("none", "native")]
        return sum(ms) / len(ms)

    def predict(size: str, every: int, mode: str, slowdown: float) -> float:
        points = [(main["concurrency"], step_ms(rows, size))]
        points += [(o["concurrency"], step_ms(o["rows"], size)) for o in others
                   if any(r["size"] == size for r in o["rows"])]
        step = cpu_step_time(points)
        total = {}
        for m in ("none", mode):
            if m == "batch":
                # inflight.bench.inflight runs batch as one long run after the interleaved modes, not beside
                # none: the machine's speed then is read off that run's own median step.
                quick = simulate(main["concurrency"], step, cpu_update(row(size, every, m), slowdown), CPU_LENGTHS,
                                 steps=main["steps"], seed=0, record=True)
                k = row(size, every, m)["step_ms"] / 1e3 / statistics.median(quick.step_s)
                r = simulate(main["concurrency"], step.scaled(k), cpu_update(row(size, every, m), slowdown), CPU_LENGTHS,
                             steps=main["steps"], seed=0)
            else:
                r = Run()
                for _ in range(main["rounds"]):  # each chunk starts with fresh requests, from the same seed
                    r.add(simulate(main["concurrency"], step, cpu_update(row(size, every, m), slowdown), CPU_LENGTHS,
                                   steps=main["steps"] // main["rounds"], seed=0))
            total[m] = r.tok_s
        return total[mode] / total["none"]

    def fit_slowdown(size: str, every: int) -> float:
        """Bisection on the slowdown that reproduces this row's measured in-flight ratio."""
        target, lo, hi = row(size, every, "inflight")["vs_none"], 0.0, 2.0
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if predict(size, every, "inflight", mid) > target else (lo, mid)
        return round((lo + hi) / 2, 4)

    slowdown = fit_slowdown(sizes[0], everys[0])
    out = []
    for size in sizes:
        for every in everys:
            for mode in ("inflight", "native", "batch"):
                measured = row(size, every, mode)["vs_none"]
                predicted = predict(size, every, mode, slowdown)
                out.append({"size": size, "every": every, "mode": mode, "measured": round(measured, 3),
                            "predicted": round(predicted, 3), "error": round(predicted / measured - 1, 3),
                            "calibration": size == sizes[0] and every == everys[0] and mode == "inflight",
                            "disturbed": row(size, every, mode)["disturbed"],
                            "repeats": row(size, every, mode)["repeats"], "slowdown": slowdown})
    return out


def markdown(head: list[str], body: list[list[object]]) -> None:
    print("\n| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
    for cells in body:
        print("| " + " | ".join("" if c is None else str(c) for c in cells) + " |")


def print_tables(moved: list[dict], published: list[dict], rows: list[dict], layer: list[dict],
                 cadences: list[dict]) -> None:
    markdown(["scenario", "TP", "checkpoint GB", "trainer -> one engine GB", "staged by one rank GB (most)",
              "of it whole tensors GB", "x S / TP", "with rollback GB"],
             [[m["scenario"], m["tp"], m["checkpoint_gb"], m["link_gb"], m["rank_gb"], m["rank_whole_gb"],
               m["rank_over_even"], m["rank_rollback_gb"]] for m in moved])
    systems, names = list(dict.fromkeys(p["system"] for p in published)), dict.fromkeys(p["scenario"] for p in published)
    markdown(["scenario"] + [f"{x}: GB/s, pause s" for x in systems],
             [[name] + [f"{p['engine_gbps']:g}, {p['pause_s']}" for x in systems for p in published
                        if p["scenario"] == name and p["system"] == x] for name in names])
    body, last = [], None
    for r in rows:
        fits, updates = r["fits"], r["variant"] != "none"
        body.append([r["scenario"] if r["scenario"] != last else "", r["variant"],
                     r["slots"] if fits else "", f"{100 * r['kv_lost']:.0f}%" if fits else "",
                     f"{r['tok_s']:,}" if fits else r["note"], r.get("vs_none"), r["stall_s"] if fits and updates else "",
                     r.get("lost_s_per_update") if updates else "", f"{r['lag_mean']:.2f} / {r['lag_p90']}" if fits else "",
                     r["staging_gb_gpu"] or "", r["host_gb_node"] or ""])
        last = r["scenario"]
    markdown(["scenario", "mode", "slots per engine", "KV lost", "fleet tokens/s", "vs none", "stall s / update",
              "decode lost s / update", "lag mean / p90", "staging GB / GPU", "pinned host GB / node"], body)
    markdown(*layer_table(layer))
    markdown(["scenario", "in-flight mode", "pause: updates / h", "pause lag mean / p90 (versions), mean s",
              "in-flight at pause's tokens/s: updates / h", "its lag mean / p90 (versions), mean s"],
             [[c["scenario"], c["variant"], c["pause_per_hour"],
               f"{c['pause_lag_mean']} / {c['pause_lag_p90']}, {c['pause_lag_mean_s']}",
               c["inflight_per_hour"] or "none: fewer tokens/s at every cadence",
               f"{c['lag_mean']} / {c['lag_p90']}, {c['lag_mean_s']}" if c["inflight_per_hour"] else ""] for c in cadences])


def plot(rows: list[dict], swept: list[dict], checks: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 9.5))
    names = list(dict.fromkeys(r["scenario"] for r in rows))
    shown = VARIANTS[1:] + (f"pause@{BESIDE}",)
    ax = axes[0, 0]
    width = 0.8 / len(shown)
    for j, v in enumerate(shown):
        ys = [next(r.get("vs_none", 0.0) for r in rows if r["scenario"] == n and r["variant"] == v) for n in names]
        xs = [i + (j - (len(shown) - 1) / 2) * width for i in range(len(names))]
        ax.bar(xs, ys, width=width, color=f"C{j}", label=v)
        for x, y in zip(xs, ys):
            if y == 0:
                ax.text(x, 0.02, "x", ha="center", color=f"C{j}")
    ax.set_xticks(range(len(names)), [n.split(",")[0] for n in names], fontsize=8)
    ax.set_ylim(0, 1.3)
    ax.set_ylabel("rollout tokens/s relative to no updates")
    ax.set_title("tokens/s by update mode (x: does not fit)")
    ax.legend(fontsize=7, loc="upper center", ncol=3)
    for ax, key, xs, xlabel in ((axes[0, 1], "by_length", LENGTH_FACTORS, "request length, x the scenario's"),
                                (axes[1, 0], "by_period", PERIODS_S, "seconds between updates")):
        for i, sw in enumerate(swept):
            for place, ls in LINES.items():
                if place in sw:
                    ax.plot(xs, sw[place][key], ls, marker="o", ms=3, color=f"C{i}",
                            label=f"{sw['scenario'].split(',')[0]}: {sw[place]['variant']}")
        ax.axhline(1.0, color="k", lw=0.7)
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("in-flight tokens/s / pause tokens/s")
        ax.legend(fontsize=6)
    axes[0, 1].set_title("in-flight / pause vs request length (solid: device, dashed: host, dotted: layer)")
    axes[1, 0].set_title("in-flight / pause vs update period (pause at the fastest published rate)")
    ax = axes[1, 1]
    ax.fill_between([0.4, 1.1], [0.4 * (1 - TOLERANCE), 1.1 * (1 - TOLERANCE)],
                    [0.4 * (1 + TOLERANCE), 1.1 * (1 + TOLERANCE)], color="0.9")
    ax.plot([0.4, 1.1], [0.4, 1.1], "k", lw=0.7)
    for k, mode in enumerate(("inflight", "native", "batch")):
        for disturbed in (False, True):
            pts = [(c["measured"], c["predicted"]) for c in checks if c["mode"] == mode and c["disturbed"] == disturbed]
            if pts:
                ax.scatter(*zip(*pts), color=f"C{k}", facecolors="none" if disturbed else f"C{k}", zorder=3,
                           label=mode + (" (reference disturbed)" if disturbed else ""))
    ax.set_xlim(0.4, 1.1)
    ax.set_ylim(0.4, 1.1)
    ax.set_xlabel("measured tokens/s vs none (inflight.bench.inflight, this CPU)")
    ax.set_ylabel("predicted by the model")
    ax.set_title("CPU validation (band: +-15%)")
    if checks:
        ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", type=Path, default=scenario_paths(SCENARIOS))
    ap.add_argument("--cpu-bench", type=Path, default=Path(__file__).resolve().parent / "scale_cpu_bench.json")
    ap.add_argument("--png", type=Path, default=Path("docs/scale.png"))
    args = ap.parse_args()
    scenarios = sorted((Scenario.load(p) for p in args.configs), key=lambda s: s.model.params_b)
    rows = [r for s in scenarios for r in scenario_rows(s)]
    layer = [r for s in scenarios for r in layer_rows(s, rows)]
    moved, published = [bytes_row(s) for s in scenarios], [p for s in scenarios for p in published_rows(s)]
    cadences = [c for s in scenarios if (c := cadence(s)) is not None]
    print_tables(moved, published, rows, layer, cadences)
    swept = [sweeps(s) for s in scenarios]
    for sw in swept:
        for place in LINES:
            if place in sw:
                d = sw[place]
                print(f"{sw['scenario']}: {d['variant']} over pause: x{d['by_length'][LENGTH_FACTORS.index(1.0)]:.3f}; "
                      f"crosses 1 at length x{d['length_factor_crossover']} (mean {sw['mean_len']} tokens at x1), "
                      f"period {d['period_s_crossover']} s")
    checks = validate_cpu(json.loads(args.cpu_bench.read_text())) if args.cpu_bench.exists() else []
    for c in checks:
        flag = ("  (calibration)" if c["calibration"] else
                "  (reference disturbed in every repeat: not judged)" if c["disturbed"] else "")
        print(f"CPU check {c['size']} every {c['every']:>2} {c['mode']:>8}: measured {c['measured']:.3f} predicted "
              f"{c['predicted']:.3f} ({100 * c['error']:+.1f}%){flag}")
    judged = [abs(c["error"]) for c in checks if not c["disturbed"]]
    if judged:
        print(f"CPU check: worst error {100 * max(judged):.1f}% over {len(judged)} rows (limit {100 * TOLERANCE:.0f}%): "
              f"{'PASS' if max(judged) <= TOLERANCE else 'FAIL'}")
    plot(rows, swept, checks, args.png)
    print(json.dumps({"bench": "scale", "bytes": moved, "published": published, "rows": rows, "layer": layer,
                      "cadence": cadences, "sweeps": swept, "length_factors": LENGTH_FACTORS,
                      "periods_s": PERIODS_S, "cpu_check": checks}))


if __name__ == "__main__":
    main()
