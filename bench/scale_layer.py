"""The layer-granular commit at scale: ``python -m inflight.bench.scale``'s table of ``inflight_layer``
and ``inflight_host_layer`` beside the modes they would replace.

The engine's ``commit_unit="layer"`` commits an update one layer group at a time
(``inflight.layer_groups``), so a rank stages ``staged_groups`` groups instead of its shard and
the stall is spread over one small commit per group. What that buys shows only against the
other modes at the same cadence: device staging that costs a few GB of KV cache instead of
the shard (x 2 with rollback), and a stall of G fixed costs plus one copy of the shard instead
of a PCIe copy of it. So each row is the layer mode's, with its tokens/s over pause's and over
each shard mode's (the whole-model commit of the same boxes), from ``scale.scenario_rows``.
"""

from __future__ import annotations

from inflight.bench.scale_fleet import GB, LAYERED, Scenario, layer_groups_by_rank, plan
from inflight.bench.scale_shapes import group_names

COMPARED = ("pause", "inflight_shard", "inflight_host_shard")  # tokens/s ratios against these


def layer_rows(s: Scenario, rows: list[dict]) -> list[dict]:
    """One row per layer variant of scenario ``s``, from its ``scenario_rows`` (``rows``): its
    groups and the largest (a rank's staging slot), KV lost, the stall of an update and of one
    commit, how long an update takes, and tokens/s against none, pause and the shard modes
    (None where either side does not fit)."""
    by = {r["variant"]: r for r in rows if r["scenario"] == s.name}
    most = [max(g) for g in zip(*layer_groups_by_rank(s))]  # a boundary waits for the slowest rank
    big = max(range(len(most)), key=most.__getitem__)
    out = []
    for v in LAYERED:
        r, stalls = by[v], plan(s, v).update.group_stall_s
        row = {"scenario": s.name, "variant": v, "fits": r["fits"], "note": r["note"], "groups": len(most),
               "largest_group": group_names(s.arch)[big], "group_gb_rank": round(most[big] / GB, 3),
               "staging_gb_gpu": r["staging_gb_gpu"], "host_gb_node": r["host_gb_node"], "kv_lost": r["kv_lost"],
               "stall_s": r["stall_s"], "commit_ms_mean": round(1e3 * sum(stalls) / len(stalls), 2),
               "commit_ms_max": round(1e3 * max(stalls), 2), "span_s": r.get("span_s"), "vs_none": r.get("vs_none")}
        for other in COMPARED:
            o = by[other]
            row[f"vs_{other}"] = round(r["tok_s"] / o["tok_s"], 3) if r["fits"] and o["fits"] else None
        out.append(row)
    return out


def layer_table(layer: list[dict]) -> tuple[list[str], list[list[object]]]:
    """The markdown table of ``layer_rows`` (head, body); a comparison with a mode that does not
    fit reads "-"."""
    head = ["scenario", "mode", "groups: largest, GB / rank", "staging GB / GPU", "KV lost", "stall s / update",
            "per commit ms: mean / max", "update takes s", "vs none", "vs pause"] + [f"vs {c}" for c in COMPARED[1:]]
    body, last = [], None
    for r in layer:
        fits = r["fits"]
        body.append([r["scenario"] if r["scenario"] != last else "", r["variant"],
                     f"{r['groups']}: {r['largest_group']}, {r['group_gb_rank']}", r["staging_gb_gpu"],
                     f"{100 * r['kv_lost']:.0f}%" if fits else r["note"], r["stall_s"],
                     f"{r['commit_ms_mean']} / {r['commit_ms_max']}", r["span_s"] if fits else "",
                     r["vs_none"]] + ["-" if r[f"vs_{c}"] is None else r[f"vs_{c}"] for c in COMPARED])
        last = r["scenario"]
    return head, body
