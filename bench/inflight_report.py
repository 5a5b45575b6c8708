"""``inflight.bench.inflight``'s arithmetic and figure: what each mode's rows mean against ``none``.

The headline, decode time lost per update, is (the mode's wall time - the wall time
``none`` needs for the same tokens) / updates; ``compare`` adds it to every row, with its
outlier-capped twin, and ``plot`` draws it beside the throughput ratio.
"""

from __future__ import annotations

from pathlib import Path

CAP = 4.0  # steps longer than CAP x none's median step count as that (``lost_ms_per_update_capped``)


def compare(rows: list[dict]) -> None:
    """Against ``none`` of the same model, engine (commit unit) and cadence group (or the row's
    own ``ceiling``: ``none@inflight``, none over in-flight's steps, where in-flight ran past its
    chunks): throughput ratio, and decode time lost per update = (wall - the wall the ceiling
    needs for the same tokens) / updates. Each engine has its own ``none``: engines run one after
    the other, so only the modes within one engine are interleaved against drift."""
    for r in rows:
        ceiling = next(x for x in rows if x["model"] == r["model"] and x["engine"] == r["engine"]
                       and x["group"] == r["group"] and x["mode"] == r.get("ceiling", "none"))
        r["vs_none"] = round(r["tok_s"] / ceiling["tok_s"], 3)
        lost = r["wall_s"] - r["tokens"] / ceiling["tok_s"]
        r["lost_ms_per_update"] = round(1e3 * lost / r["updates"], 1) if r["updates"] else None
        r["lost_ms_per_step"] = round(1e3 * lost / r["steps"], 2)
        # The same with outlier steps capped: on a machine shared with other jobs a few steps take
        # seconds (another job's burst) and land in whichever mode ran then. Steps without an
        # update event longer than CAP x none's median count as CAP x that median; the
        # intervals holding an update (native's pause, batch's drain) are never capped.
        cap = CAP * ceiling["step_ms"] / 1e3
        capped = [g for g in r["_quiet"] if g > cap]
        robust = sum(min(g, cap) for g in r["_quiet"]) + sum(r["_events"])
        r["capped_steps"] = len(capped)
        # tokens/s, none's steps capped alike
        none_rate = ceiling["tokens"] / sum(min(g, cap) for g in ceiling["_quiet"])
        lost_robust = robust - r["tokens"] / none_rate
        r["lost_ms_per_update_capped"] = round(1e3 * lost_robust / r["updates"], 1) if r["updates"] else None
    for r in rows:
        r.pop("_quiet"), r.pop("_events")


def plot(rows: list[dict], png: Path) -> None:
    """Left: decode time lost per update, per model and mode (log scale); right: throughput
    relative to no updates. Labels carry requested -> achieved steps per update."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows
             if not r["mode"].startswith("none") and r["updates"] and not str(r["group"]).startswith("routing")]
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.8 + 0.28 * len(shown)))
    labels = [f"{r['model']} [{r['engine']} engine] every {r['every']} {r['mode']} (-> {r['steps_per_update']})"
              for r in shown]
    colors = {"inflight": "C1", "inflight-layer": "C5", "native": "C2", "native@inflight": "C4", "batch": "C3",
              "inflight-native-api": "C6"}
    ys = range(len(shown))
    axes[0].barh(ys, [max(r["lost_ms_per_update"], 0.1) for r in shown], color=[colors[r["mode"]] for r in shown])
    axes[0].set_xscale("log")
    axes[0].set_yticks(ys, labels, fontsize=7)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("decode time lost per update, ms (wall - none's wall for the same tokens) / updates")
    axes[1].barh(ys, [r["vs_none"] for r in shown], color=[colors[r["mode"]] for r in shown])
    axes[1].set_yticks(ys, [""] * len(shown))
    axes[1].invert_yaxis()
    axes[1].axvline(1.0, color="k", lw=0.6)
    axes[1].set_xlim(0, 1.05)
    axes[1].set_xlabel("tokens/s relative to no updates")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


COLS = ["model", "engine", "every", "mode", "updates", "steps_per_update", "tok_s", "vs_none", "lost_ms_per_update",
        "lost_ms_per_update_capped", "capped_steps", "step_ms", "stall_ms", "commit_ms", "push_stall_ms", "groups",
        "stage_ms", "ms_per_gb", "staging_peak_bytes", "peak_how", "api_ms"]
