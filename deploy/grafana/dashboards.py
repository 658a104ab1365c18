"""The Grafana dashboards as code (grafanalib): Speculation and Serving.

    python deploy/grafana/dashboards.py            # (make dashboards) rewrites the JSON
    python deploy/grafana/dashboards.py --check    # exit 1 when the committed JSON is stale

The generated ``*.json`` is committed in ``services/specserve/grafana/`` (``OUT``), not beside
this file: the ``specserve`` package ships it as package data, so ``specserve dashboards push``
finds it beside its own module and loads it into a Grafana; the Helm chart ships the same files
as ConfigMaps (read through ``helm/specserve/files/grafana``, a link to that folder).

Every query uses the ``specserve:`` metrics of ``docs/METRICS.md``; variables: data source,
namespace, unit, method (``All`` = ``.*``, which also matches series without the label, as in
the local setup where there is no namespace).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafanalib._gen import DashboardEncoder
from grafanalib.core import Dashboard as _Dashboard
from grafanalib.core import (
    GridPos,
    RowPanel,
    Stat,
    Target,
    Template,
    Templating,
    TimeSeries,
)

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "services" / "specserve" / "grafana"  # package data of specserve (see the docstring)
DS = "${datasource}"
NS = 'namespace=~"$namespace"'
UNIT = f'{NS}, unit=~"$unit", method=~"$method"'
RATE = "$__rate_interval"


def q(expr: str, legend: str = "", ref: str = "A") -> Target:
    return Target(expr=expr, legendFormat=legend, refId=ref, datasource=DS)


def quantiles(metric: str, by: str = "") -> list[Target]:
    group = f"{by}, le" if by else "le"
    return [q(f"histogram_quantile({p}, sum by ({group}) (rate({metric}_bucket{{{NS}}}[{RATE}])))",
              f"p{int(p * 100)}", ref) for p, ref in ((0.5, "A"), (0.9, "B"), (0.99, "C"))]


def series(title: str, targets: list[Target], pos: tuple[int, int, int, int], unit: str = "short",
           description: str = "", **kw) -> TimeSeries:
    x, y, w, h = pos
    return TimeSeries(title=title, description=description, dataSource=DS, targets=targets,
                      gridPos=GridPos(h=h, w=w, x=x, y=y), unit=unit, **kw)


def stat(title: str, expr: str, pos: tuple[int, int, int, int], unit: str = "short",
         description: str = "", decimals: int = 2) -> Stat:
    x, y, w, h = pos
    return Stat(title=title, description=description, dataSource=DS, targets=[q(expr)],
                gridPos=GridPos(h=h, w=w, x=x, y=y), format=unit, decimals=decimals,
                reduceCalc="lastNotNull")


def variables() -> Templating:
    def label(name: str, metric: str) -> Template:
        return Template(name=name, label=name, dataSource=DS, type="query",
                        query=f"label_values({metric}, {name})", includeAll=True, multi=True,
                        allValue=".*", default="$__all", refresh=2, sort=1)

    return Templating(list=[
        Template(name="datasource", label="data source", type="datasource", query="prometheus",
                 default="Prometheus"),
        label("namespace", "specserve:num_slots"),
        label("unit", f'specserve:num_slots{{{NS}}}'),
        label("method", f'specserve:num_slots{{{NS}}}'),
    ])


def dashboard(title: str, uid: str, description: str, panels: list) -> _Dashboard:
    return _Dashboard(title=title, uid=uid, description=description, tags=["specserve"],
                      timezone="utc", refresh="10s", editable=True, panels=panels,
                      templating=variables(), schemaVersion=39).auto_panel_ids()


def _mean(histogram: str) -> str:
    """Mean observation of a histogram over the rate window."""
    return (f"sum(rate({histogram}_sum{{{UNIT}}}[{RATE}])) / "
            f"sum(rate({histogram}_count{{{UNIT}}}[{RATE}]))")


def speculation() -> _Dashboard:
    accepted = f"sum(rate(specserve:spec_decode_num_accepted_tokens_total{{{UNIT}}}[{RATE}]))"
    drafted = f"sum(rate(specserve:spec_decode_num_draft_tokens_total{{{UNIT}}}[{RATE}]))"
    drafts = f"sum(rate(specserve:spec_decode_num_drafts_total{{{UNIT}}}[{RATE}]))"
    tpot = "sum(rate(specserve:time_per_output_token_seconds_{part}{{{ns}, speculation=\"{s}\"}}[{r}]))"
    mean_tpot = lambda s: (f"({tpot.format(part='sum', ns=NS, s=s, r=RATE)} / "  # noqa: E731
                           f"{tpot.format(part='count', ns=NS, s=s, r=RATE)})")
    panels = [
        stat("Acceptance rate", f"{accepted} / {drafted}", (0, 0, 6, 4), "percentunit",
             "Accepted / drafted tokens."),
        stat("Mean acceptance length", f"1 + {accepted} / {drafts}", (6, 0, 6, 4),
             description="Tokens emitted per verified draft: 1 + accepted / drafts."),
        stat("K now", f"avg(specserve:speculation_length_current{{{UNIT}}})", (12, 0, 6, 4),
             description="The K the coordinators draft for adaptive requests now."),
        stat("Estimated speedup", f"avg(specserve:estimated_speedup{{{UNIT}}})", (18, 0, 6, 4),
             description="The cost model's predicted throughput at K over K = 0."),
        RowPanel(title="Acceptance", gridPos=GridPos(h=1, w=24, x=0, y=4)),
        series("Acceptance rate and mean acceptance length",
               [q(f"{accepted} / {drafted}", "acceptance rate", "A"),
                q(f"1 + {accepted} / {drafts}", "mean acceptance length", "B")],
               (0, 5, 12, 8), description="Per unit filter; acceptance rate on the left axis scale "
                                          "0-1, length in tokens."),
        series("Acceptance by position",
               [q(f"sum by (position) (rate(specserve:spec_decode_num_accepted_tokens_per_pos_total"
                  f"{{{UNIT}}}[{RATE}])) / ignoring(position) group_left {drafts}", "position {{position}}")],
               (12, 5, 12, 8), "percentunit",
               "Share of drafts whose token at this position was accepted (0 = first drafted)."),
        series("Mean acceptance length by proposer",
               [q(f"1 + sum by (proposer) (rate(specserve:proposer_num_accepted_tokens_total{{{UNIT}}}"
                  f"[{RATE}])) / sum by (proposer) (rate(specserve:proposer_num_drafts_total{{{UNIT}}}"
                  f"[{RATE}]))", "{{proposer}}")],
               (0, 13, 12, 8), description="Tokens per verified draft, per proposer that drafted "
                                           "(a hybrid's parts apart: suffix in front of EAGLE)."),
        series("Drafts by proposer",
               [q(f"sum by (proposer) (rate(specserve:proposer_num_drafts_total{{{UNIT}}}[{RATE}]))",
                  "{{proposer}}")],
               (12, 13, 12, 8), "ops", "Verified drafts per second, per proposer that drafted them "
                                       "(which part of a hybrid serves the traffic)."),
        RowPanel(title="Speculation length and speedup", gridPos=GridPos(h=1, w=24, x=0, y=21)),
        series("K chosen",
               [q(f"sum(rate(specserve:speculation_length_sum{{{UNIT}}}[{RATE}])) / "
                  f"sum(rate(specserve:speculation_length_count{{{UNIT}}}[{RATE}]))", "mean K per step", "A"),
                q(f"specserve:speculation_length_current{{{UNIT}}}", "current K {{unit}}", "B")],
               (0, 22, 12, 8), description="Mean K drafted per decoding sequence per step "
                                           "(0 = target-only), and each unit's current K."),
        series("Estimated vs measured speedup",
               [q(f"avg(specserve:estimated_speedup{{{UNIT}}})", "estimated (cost model)", "A"),
                q(f"{mean_tpot('off')} / {mean_tpot('on')}", "measured (TPOT off / on)", "B")],
               (12, 22, 12, 8), description="Measured: mean time per output token of requests "
                                            "served without speculation over those with it."),
        RowPanel(title="Router and draft", gridPos=GridPos(h=1, w=24, x=0, y=30)),
        series("Router decisions by reason",
               [q(f"sum by (decision, reason) (rate(specserve:router_decisions_total{{{UNIT}}}[{RATE}]))",
                  "{{decision}}: {{reason}}")],
               (0, 31, 12, 8), "reqps", "Per-request speculation decisions per second."),
        series("Draft fallbacks and availability",
               [q(f"sum(increase(specserve:draft_fallbacks_total{{{UNIT}}}[{RATE}]))", "fallbacks", "A"),
                q(f"min(specserve:draft_available{{{UNIT}}})", "draft available (min over units)", "B")],
               (12, 31, 12, 8), description="Times a unit lost its draft group, and whether "
                                            "every unit has it now (1)."),
        RowPanel(title="Token trees", gridPos=GridPos(h=1, w=24, x=0, y=39)),
        series("Tree size and accepted depth",
               [q(_mean("specserve:spec_decode_tree_size"), "mean nodes per tree", "A"),
                q(_mean("specserve:spec_decode_tree_accepted_depth"), "mean accepted depth", "B")],
               (0, 40, 8, 8), description="Nodes drafted per verified token tree (the budget the "
                                          "cost model chose, or fewer) and how deep its kept path "
                                          "went: the tree's accepted tokens (no data: no trees)."),
        series("Accepted depth",
               [q(f"sum by (le) (rate(specserve:spec_decode_tree_accepted_depth_bucket{{{UNIT}}}"
                  f"[{RATE}]))", "depth <= {{le}}")],
               (8, 40, 8, 8), "ops", "Verified trees per second whose kept path reached at most "
                                     "this depth (cumulative buckets)."),
        series("Accepted sibling rank",
               [q(f"1 - sum(rate(specserve:spec_decode_tree_accepted_rank_bucket{{{UNIT}, le=\"0.0\"}}"
                  f"[{RATE}])) / sum(rate(specserve:spec_decode_tree_accepted_rank_count{{{UNIT}}}"
                  f"[{RATE}]))", "kept nodes off the first choice", "A"),
                q(f"sum by (le) (rate(specserve:spec_decode_tree_accepted_rank_bucket{{{UNIT}}}"
                  f"[{RATE}]))", "rank <= {{le}}", "B")],
               (16, 40, 8, 8), description="Share of kept tree nodes that were not their parent's "
                                           "first drafted child (what a chain would have lost), "
                                           "and kept nodes per second by rank (cumulative)."),
    ]
    return dashboard("specserve / Speculation", "specserve-speculation",
                     "Acceptance, speculation length, speedup and router decisions.", panels)


def serving() -> _Dashboard:
    panels = [
        stat("Requests/s", f"sum(rate(specserve:requests_total{{{NS}}}[{RATE}]))", (0, 0, 6, 4), "reqps"),
        stat("Output tokens/s", f"sum(rate(specserve:generation_tokens_total{{{NS}}}[{RATE}]))",
             (6, 0, 6, 4), decimals=1),
        stat("Running", f"sum(specserve:num_requests_running{{{UNIT}}})", (12, 0, 6, 4), decimals=0),
        stat("Waiting", f"sum(specserve:num_requests_waiting{{{UNIT}}})", (18, 0, 6, 4), decimals=0),
        RowPanel(title="Traffic", gridPos=GridPos(h=1, w=24, x=0, y=4)),
        series("Requests/s by status",
               [q(f"sum by (route, status) (rate(specserve:requests_total{{{NS}}}[{RATE}]))",
                  "{{route}} {{status}}")], (0, 5, 12, 8), "reqps"),
        series("Output tokens/s",
               [q(f"sum by (route) (rate(specserve:generation_tokens_total{{{NS}}}[{RATE}]))", "{{route}}")],
               (12, 5, 12, 8)),
        RowPanel(title="Latency", gridPos=GridPos(h=1, w=24, x=0, y=13)),
        series("Time to first token", quantiles("specserve:time_to_first_token_seconds"), (0, 14, 8, 8), "s"),
        series("Inter-token latency", quantiles("specserve:inter_token_latency_seconds"), (8, 14, 8, 8), "s",
               "Gap between a request's outputs: one engine step, several tokens with speculation."),
        series("End-to-end latency", quantiles("specserve:e2e_request_latency_seconds"), (16, 14, 8, 8), "s"),
        RowPanel(title="Capacity and errors", gridPos=GridPos(h=1, w=24, x=0, y=22)),
        series("Running / waiting",
               [q(f"sum by (unit) (specserve:num_requests_running{{{UNIT}}})", "running {{unit}}", "A"),
                q(f"sum by (unit) (specserve:num_requests_waiting{{{UNIT}}})", "waiting {{unit}}", "B")],
               (0, 23, 8, 8)),
        series("Free KV slots",
               [q(f"sum by (unit) (specserve:free_slots{{{UNIT}}})", "free {{unit}}", "A"),
                q(f"sum by (unit) (specserve:num_slots{{{UNIT}}})", "all {{unit}}", "B")],
               (8, 23, 8, 8)),
        series("Errors/s",
               [q(f'sum by (status) (rate(specserve:requests_total{{{NS}, status=~"4..|5.."}}[{RATE}]))',
                  "{{status}}")], (16, 23, 8, 8), "reqps", "4xx (bad requests, 429 when full) and 5xx."),
        RowPanel(title="Between the groups", gridPos=GridPos(h=1, w=24, x=0, y=31)),
        series("Bytes to the coordinator per reply",
               [q(f"sum by (source) (rate(specserve:unit_received_bytes_total{{{UNIT}}}[{RATE}])) / "
                  f"sum by (source) (rate(specserve:unit_received_messages_total{{{UNIT}}}[{RATE}]))",
                  "from {{source}}", "A")],
               (0, 32, 12, 8), "bytes", "What one verify forward (target rank 0: kept tokens, "
                                        "never logits) or one draft step (ids, top-k q) sends "
                                        "the coordinator, averaged over the replies."),
        series("Bytes/s to the coordinator",
               [q(f"sum by (source) (rate(specserve:unit_received_bytes_total{{{UNIT}}}[{RATE}]))",
                  "from {{source}}", "A")],
               (12, 32, 12, 8), "Bps"),
        RowPanel(title="The prompt: KV blocks, prefix cache, chunked prefill",
                 gridPos=GridPos(h=1, w=24, x=0, y=40)),
        series("Prefix cache hit rate",
               [q(f"sum by (unit) (rate(specserve:prefix_cache_hits_total{{{UNIT}}}[{RATE}])) / "
                  f"sum by (unit) (rate(specserve:prefix_cache_queries_total{{{UNIT}}}[{RATE}]))",
                  "{{unit}}", "A")],
               (0, 41, 8, 8), "percentunit", "Prompt tokens found cached over prompt tokens looked "
                                             "up (kv_cache.layout paged; empty with slots)."),
        series("KV blocks in use",
               [q(f"1 - sum by (unit) (specserve:kv_blocks_free{{{UNIT}}}) / "
                  f"sum by (unit) (specserve:kv_blocks_total{{{UNIT}}})", "{{unit}}", "A")],
               (8, 41, 8, 8), "percentunit", "Blocks held by sequences over the pool; cached "
                                             "prefixes no sequence holds count as free."),
        series("Prefill chunks and preemptions",
               [q(f"sum by (unit) (rate(specserve:prefill_chunks_total{{{UNIT}}}[{RATE}]))",
                  "chunks/s {{unit}}", "A"),
                q(f"sum by (unit) (rate(specserve:preemptions_total{{{UNIT}}}[{RATE}]))",
                  "preemptions/s {{unit}}", "B")],
               (16, 41, 8, 8), "short", "Chunks: prompts longer than a step's budget "
                                        "(chunked_prefill_size). Preemptions: sequences sent back "
                                        "to wait because the KV pool ran short."),
        RowPanel(title="Units and autoscaling", gridPos=GridPos(h=1, w=24, x=0, y=49)),
        series("Units",
               [q(f"sum(ray_specserve_autoscaling_units_running{{{NS}}})", "running", "A"),
                q(f"sum(ray_specserve_autoscaling_units_target{{{NS}}})", "target", "B"),
                q(f"sum(ray_specserve_autoscaling_units_wanted{{{NS}}})", "wanted by the rule", "C")],
               (0, 50, 8, 8), "short", "With autoscaling (policy: speculation): units running, the "
                                       "count Serve scales to once the delay held, and the rule's "
                                       "count before the delays (serve/autoscaling.py)."),
        series("Autoscaling load",
               [q(f"max(ray_specserve_autoscaling_signal{{{NS}}})", "each unit (the policy)", "A"),
                q(f"max by (unit) (specserve:autoscaling_load{{{UNIT}}})", "{{unit}}", "B")],
               (8, 50, 8, 8), "percentunit", "The rule's load: a unit's fuller resource, KV blocks "
                                             "or slots priced at speculation's cost; the policy "
                                             "holds it near target_utilization."),
        series("Scale events",
               [q(f"sum(changes(ray_specserve_autoscaling_units_target{{{NS}}}[1h]))",
                  "in the last hour", "A")],
               (16, 50, 8, 8), "short", "Changes of the units' target count."),
    ]
    return dashboard("specserve / Serving", "specserve-serving",
                     "Requests, tokens/s, latency percentiles, running / waiting, free slots, "
                     "errors, KV blocks and the prefix cache.", panels)


DASHBOARDS = {"speculation.json": speculation, "serving.json": serving}


def render(build) -> str:
    return json.dumps(build().to_json_data(), cls=DashboardEncoder, sort_keys=True, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail when the committed JSON is stale")
    args = p.parse_args(argv)
    stale = []
    for name, build in DASHBOARDS.items():
        path, text = OUT / name, render(build)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    if stale:
        print(f"stale dashboard JSON: {', '.join(stale)}; run `make dashboards`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
