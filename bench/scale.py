"""At scale, on paper: in-flight updates vs pause-based and batch-boundary sync for a fleet.

    inflight bench scale [--configs bench/scenarios/*.toml] [--png docs/scale.png]
                                                                (or: python -m inflight.bench.scale ...)
    inflight bench scale calibrate [--parts link engine push]   # the CPU replay's micro-benchmarks (scale_calibrate)
    inflight bench scale predict                                 # its predictions, before the runs (scale_replay)
    inflight bench scale record LOG [LOG ...]                    # the inflight.bench.inflight runs they are judged on

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
updates). Last, the check against this machine: ``scale_replay`` predicts the decode time
``inflight.bench.inflight`` loses per update on SmolLM2, over loopback and over shaped links, from
micro-benchmarks run apart from those runs (``scale_calibrate``), and every prediction is judged
against the recorded runs within a band fixed beforehand, none excluded.

Prints markdown tables and one JSON line; writes the figure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from inflight.bench.scale_fleet import (
    BUILT,
    SCENARIOS,
    VARIANTS,
    Plan,
    Scenario,
    bytes_row,
    plan,
    published_rows,
    scenario_paths,
)
from inflight.bench.scale_layer import layer_rows, layer_table
from inflight.bench.scale_links import link_rows, links_table, load_links, plot_links
from inflight.bench.scale_model import Run, simulate
from inflight.bench.scale_replay import PREDICTIONS, RUNS, judge

LENGTH_FACTORS = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0, 2.0)
PERIODS_S = (5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
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
                    "lag_p50": r.lag_quantile(0.5), "lag_p90": r.lag_quantile(0.9),
                    "lag_max": max(r.lag_hist, default=0)}
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
        out[place] = {"variant": v, "by_length": [round(g, 4) for g in by_len],
                      "by_period": [round(g, 4) for g in by_period],
                      "length_factor_crossover": crossover(LENGTH_FACTORS, by_len),
                      "period_s_crossover": crossover(PERIODS_S, by_period)}
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
    systems, names = (list(dict.fromkeys(p["system"] for p in published)),
                      dict.fromkeys(p["scenario"] for p in published))
    markdown(["scenario"] + [f"{x}: GB/s, pause s" for x in systems],
             [[name] + [f"{p['engine_gbps']:g}, {p['pause_s']}" for x in systems for p in published
                        if p["scenario"] == name and p["system"] == x] for name in names])
    body, last = [], None
    for r in rows:
        fits, updates = r["fits"], r["variant"] != "none"
        body.append([r["scenario"] if r["scenario"] != last else "", r["variant"],
                     r["slots"] if fits else "", f"{100 * r['kv_lost']:.0f}%" if fits else "",
                     f"{r['tok_s']:,}" if fits else r["note"], r.get("vs_none"),
                     r["stall_s"] if fits and updates else "", r.get("lost_s_per_update") if updates else "",
                     f"{r['lag_mean']:.2f} / {r['lag_p90']}" if fits else "",
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
               f"{c['lag_mean']} / {c['lag_p90']}, {c['lag_mean_s']}" if c["inflight_per_hour"] else ""]
              for c in cadences])


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
    ax.plot([1, 1e5], [1, 1e5], "k", lw=0.7)
    for k, mode in enumerate(("inflight", "native", "native@inflight")):
        lost = [c["quantities"]["lost_ms_per_update"] for c in checks if c["mode"] == mode and "quantities" in c]
        if lost:
            ax.scatter([q["median"] for q in lost], [q["predicted"] for q in lost], color=f"C{k}", zorder=3, label=mode)
        for q in lost:
            ax.plot([q["median"]] * 2, [max(q["median"] - q["band"], 1), q["median"] + q["band"]],
                    color=f"C{k}", lw=3, alpha=0.3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured decode time lost per update, median of the runs, ms (inflight.bench.inflight, SmolLM2)")
    ax.set_ylabel("predicted from the micro-benchmarks, ms")
    ax.set_title("CPU validation (bars: the band, the runs' spread)")
    if checks:
        ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)


def main() -> None:
    if sys.argv[1:2] == ["calibrate"]:  # the CPU replay's micro-benchmarks (inflight.bench.scale_calibrate)
        from inflight.bench.scale_calibrate import main as calibrate

        return calibrate(sys.argv[2:])
    if sys.argv[1:2] in (["predict"], ["record"]):  # its predictions, and the runs they are judged on
        from inflight.bench.scale_replay import main as replay

        return replay(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", type=Path, default=scenario_paths(SCENARIOS))
    ap.add_argument("--predictions", type=Path, default=PREDICTIONS,
                    help="the CPU replay's predictions (scale predict)")
    ap.add_argument("--runs", type=Path, default=RUNS,
                    help="the inflight.bench.inflight runs they are judged on (scale record)")
    ap.add_argument("--png", type=Path, default=Path("docs/scale.png"))
    ap.add_argument("--links-png", type=Path, default=Path("docs/scale_links.png"))
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
    links, sparse_ratio = load_links(args.configs[0].parent)
    linked = [r for s in scenarios for r in link_rows(s, links, sparse_ratio)]
    print(f"\nOver slower links (scenarios/links.toml; sparse: {sparse_ratio} of the bytes):")
    markdown(*links_table(linked))
    plot_links(linked, args.links_png)
    checks = judge(json.loads(args.predictions.read_text()), json.loads(args.runs.read_text())["runs"]) \
        if args.predictions.exists() and args.runs.exists() else []
    for c in checks:
        print(f"CPU check {c['rate']:>8} {c['mode']:>15} over {c['runs']} runs: {'ok' if c['ok'] else 'MISSED'} "
              f"{c.get('why', '')}")
        for q, v in c.get("quantities", {}).items():
            print(f"    {q:>20}: predicted {v['predicted']}, measured {v['measured']} (median {v['median']}, "
                  f"band +-{v['band']}): {'ok' if v['ok'] else 'missed'}")
    if checks:
        print(f"CPU check: {sum(c['ok'] for c in checks)} of {len(checks)} checks within their bands, none excluded: "
              f"{'PASS' if all(c['ok'] for c in checks) else 'FAIL'}")
    plot(rows, swept, checks, args.png)
    print(json.dumps({"bench": "scale", "bytes": moved, "published": published, "rows": rows, "layer": layer,
                      "cadence": cadences, "sweeps": swept, "length_factors": LENGTH_FACTORS,
                      "periods_s": PERIODS_S, "links": linked, "sparse_ratio": sparse_ratio, "cpu_check": checks}))


if __name__ == "__main__":
    main()
