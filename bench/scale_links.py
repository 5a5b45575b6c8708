"""Slower links between the pools: ``python -m inflight.bench.scale``'s tables of every scenario
over 100 and 25 Gbit/s TCP and a 1 Gbit/s decentralized link (``scenarios/links.toml``), dense
and as a sparse delta (``sparse_ratio`` of the bytes).

Each engine receives at the link's line rate x its TCP efficiency, its share of a node's port
(``per = "node"``: tp / gpus_per_node) or a connection of its own (``per = "engine"``). Every
mode then moves the update at that rate: pause (the engine stops for the transfer and the
load), batch (drain, then the same), and in-flight (staged beside decoding; the best of the
built variants that fit: device or host staging, whole or shard). A version cannot land
faster than the link moves it, so the cadence is the scenario's ``every_s`` or the in-flight
transfer time if that is longer; pause and batch decode that long between two updates and
stall on top (``inflight.bench.inflight``'s native@inflight: as many updates over as many
steps), so every mode decodes as many tokens per version. A sparse delta shrinks what crosses
the link only: staging memory, the commit and the load stay the dense update's.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path

from inflight.bench.scale_fleet import BUILT, LINKS, Scenario, plan
from inflight.bench.scale_model import Run, simulate

MODES = ("pause", "batch", "inflight")
INFLIGHT = tuple(v for v in BUILT if v.startswith("inflight"))
PERIODS = 6  # update periods simulated


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    name: str
    gbit: float  # line rate, Gbit/s
    per: str  # "node": one port per inference node, shared by its engines; "engine": one connection each
    efficiency: float  # achieved TCP payload / line rate

    def __post_init__(self) -> None:
        if self.per not in ("node", "engine") or not 0 < self.efficiency <= 1 or self.gbit <= 0:
            raise ValueError(f"LinkSpec {self.name!r}: per={self.per!r} (node or engine), efficiency={self.efficiency} "
                             f"(0..1], gbit={self.gbit} (> 0)")

    def engine_gbps(self, s: Scenario) -> float:
        """GB/s one engine of scenario ``s`` receives an update at over this link."""
        share = s.fleet.tp / s.fleet.gpus_per_node if self.per == "node" else 1.0
        return self.gbit / 8 * self.efficiency * share


def load_links(folder: Path) -> tuple[list[LinkSpec], float]:
    """The links of ``folder/links.toml`` and its ``sparse_ratio``."""
    raw = tomllib.loads((folder / LINKS).read_text())
    ratio = raw["sparse_ratio"]
    if not 0 < ratio <= 1:
        raise ValueError(f"{folder / LINKS}: sparse_ratio={ratio} must be in (0, 1]")
    return [LinkSpec(**x) for x in raw["link"]], ratio


def over(s: Scenario, link: LinkSpec, wire_ratio: float = 1.0) -> Scenario:
    """Scenario ``s`` with every update over ``link``, sending ``wire_ratio`` of its bytes, at
    the cadence the link allows (``every_s``, or the in-flight transfer if longer)."""
    s = dataclasses.replace(s, link=dataclasses.replace(s.link, engine_gbps=link.engine_gbps(s), egress_gbps=0.0),
                            updates=dataclasses.replace(s.updates, wire_ratio=wire_ratio))
    stage = max(plan(s, v).update.stage_s for v in INFLIGHT)
    return s.replace(every_s=max(s.updates.every_s, stage))


def _run(s: Scenario, variant: str) -> Run | None:
    """One engine of ``variant`` for ``PERIODS`` update periods. Pause and batch update every
    ``every_s`` of decoding: each stall comes on top, so they decode as many tokens per version
    as in-flight at that cadence (the same freshness per token; their updates per hour are fewer)."""
    p = plan(s, variant)
    if p.slots == 0:
        return None
    if variant in ("pause", "batch"):
        s = s.replace(every_s=s.updates.every_s + p.update.stall_s)
        p = plan(s, variant)
    steps = int(max(PERIODS * s.updates.every_s / p.step(p.slots), 2 * s.lengths.high))
    return simulate(p.slots, p.step, p.update, s.lengths, steps=steps, seed=0, warmup_steps=s.lengths.high)


def link_rows(s: Scenario, links: list[LinkSpec], sparse_ratio: float) -> list[dict]:
    """Per link and wire (dense, sparse): each mode's tokens/s against none, its stall, the
    in-flight variant chosen, and the winner with its margin over the runner-up."""
    none = _run(s, "none")
    out = []
    for link in links:
        for wire, ratio in (("dense", 1.0), ("sparse", sparse_ratio)):
            at = over(s, link, ratio)
            runs = {m: _run(at, m) for m in ("pause", "batch")}
            fits = {v: r for v in INFLIGHT if (r := _run(at, v)) is not None}
            best = max(fits, key=lambda v: fits[v].tok_s, default=None)
            runs["inflight"] = fits.get(best)
            row = {"scenario": s.name, "link": link.name, "wire": wire, "engine_gbps": round(link.engine_gbps(s), 3),
                   "every_s": round(at.updates.every_s, 1),
                   "transfer_s": round(plan(at, best).update.stage_s, 1) if best else None, "inflight_variant": best}
            for m, r in runs.items():
                row[m] = round(r.tok_s / none.tok_s, 3) if r is not None and none is not None else None
                stall = plan(at, best if m == "inflight" else m).update.stall_s if r else None
                row[f"{m}_stall_s"] = round(stall, 3) if r else None
                row[f"{m}_per_hour"] = (round(3600 / (at.updates.every_s + (stall if m != "inflight" else 0.0)), 2)
                                        if r else None)
            ranked = sorted((m for m in MODES if row[m]), key=lambda m: -row[m])
            row["winner"] = ranked[0] if ranked else None
            row["margin"] = round(row[ranked[0]] / row[ranked[1]], 3) if len(ranked) > 1 else None
            out.append(row)
    return out


def links_table(rows: list[dict]) -> tuple[list[str], list[list[object]]]:
    """The markdown table of ``link_rows`` (head, body)."""
    head = ["scenario", "link", "wire", "GB/s per engine", "in-flight: updates / h, vs none (variant)",
            "pause: stall s, updates / h, vs none", "batch: vs none", "winner, x runner-up"]
    body, last = [], None
    for r in rows:
        body.append([r["scenario"].split(",")[0] if r["scenario"] != last else "", r["link"], r["wire"],
                     r["engine_gbps"],
                     f"{r['inflight_per_hour']}, {r['inflight']} ({r['inflight_variant']})" if r["inflight"]
                     else "does not fit",
                     f"{r['pause_stall_s']}, {r['pause_per_hour']}, {r['pause']}", r["batch"],
                     f"{r['winner']}, x{r['margin']}"])
        last = r["scenario"]
    return head, body


def plot_links(rows: list[dict], png: Path) -> None:
    """One panel per link: tokens/s against none per scenario and mode, dense (solid) and
    sparse (hatched)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(r["link"] for r in rows))
    names = list(dict.fromkeys(r["scenario"] for r in rows))
    fig, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 4.5), sharey=True)
    width = 0.8 / (2 * len(MODES))
    for ax, link in zip(axes, links):
        for j, (mode, wire) in enumerate((m, w) for w in ("dense", "sparse") for m in MODES):
            ys = [next((r[mode] or 0.0) for r in rows if r["scenario"] == n and r["link"] == link and r["wire"] == wire)
                  for n in names]
            xs = [i + (j - (2 * len(MODES) - 1) / 2) * width for i in range(len(names))]
            ax.bar(xs, ys, width=width, color=f"C{MODES.index(mode)}", hatch="//" if wire == "sparse" else None,
                   edgecolor="white", label=f"{mode} ({wire})")
        ax.set_xticks(range(len(names)), [n.split(",")[0] for n in names], fontsize=8)
        ax.set_title(link)
        ax.set_ylim(0, 1.05)
    axes[0].set_ylabel("rollout tokens/s relative to no updates")
    axes[0].legend(fontsize=7, ncol=2, loc="lower left")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
