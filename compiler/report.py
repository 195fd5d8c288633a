"""The plan report: one self-contained HTML page (inline script and style, the
plan's data inline; no network, no server: it opens from file://).

The page is drawn in the browser from the plan data (runtime/plan_data.py), so
``plan.to_html(path)`` and ``shardprop report DUMP_DIR -o path`` (which reads the
dump's ``plan.json``) make the same page. The page's own code is beside this
module: report_page.html (the frame), report_page.css and report_page.js.
This module only renders plan data; ``sp.report(plan_or_dump_dir, path)`` is in api.py.
"""
from __future__ import annotations

import html
import importlib.resources

from ..runtime.plan_data import to_json

_ASSETS = ("report_page.html", "report_page.css", "report_page.js")


def _asset(name: str) -> str:
    return importlib.resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def render_html(data: dict) -> str:
    """The page for this plan data."""
    page, css, js = (_asset(n) for n in _ASSETS)
    title = f"shardprop plan: {data.get('program', '')}"
    # '</' would end the script element early; '<\/' is the same JSON string
    payload = to_json(data).replace("</", "<\\/")
    parts = {"__TITLE__": html.escape(title), "/*__CSS__*/": css, "/*__JS__*/": js.replace("</", "<\\/"),
             "__DATA__": payload}
    out = page
    for marker in ("__TITLE__", "/*__CSS__*/", "/*__JS__*/", "__DATA__"):   # the data last: it may hold anything
        head, sep, tail = out.partition(marker)
        if not sep:
            raise AssertionError(f"report template has no {marker}")
        out = head + parts[marker] + tail
    return out


def write_html(data: dict, path: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(data))
    return path



# ---------------------------------------------------------------- pipeline plans
# A pipelined step (compiler/pipeline_step.py) is one program over ticks, not a graph of
# sharded ops: its report is a page of its own kind, in the same style (report_page.css),
# drawn here from ``PipelineInfo.to_data()``: the schedule as a timeline (ranks x ticks,
# one cell per action with its micro-batch, bubbles blank), the stages (rank, devices,
# ops, state) and each rank's program. Static HTML: it needs no script to read; its
# rules are the ones under body.pipeline in report_page.css.
_KIND_LETTER = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}


def _ops_text(names: list) -> str:
    """``["dot_general", "tanh", "dot_general"]`` -> ``"dot_general x2, tanh"``."""
    counts = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    return ", ".join(n if c == 1 else f"{n} ×{c}" for n, c in counts.items()) or "none"


def render_pipeline_html(data: dict) -> str:
    """The report page of a pipeline plan (``PipelineInfo.to_data()``)."""
    css = _asset("report_page.css")
    e = html.escape
    m, ticks = data["microbatches"], data["ticks"]
    chips = [f"<b>{len(data['stages'])}</b> model stages", f"<b>{len(data['ranks'])}</b> ranks",
             f"<b>{m}</b> micro-batches", f"<b>{ticks}</b> ticks",
             f"modeled bubble <b>{data['bubble']:.3f}</b> (unit costs {data['unit_bubble']:.3f})",
             f"modeled step <b>{data['step_time'] * 1e3:.3f} ms</b>", f"<b>{data['slots']}</b> activation slots / rank"]
    head = "".join(f"<th>{t}</th>" for t in range(ticks))
    rows = []
    for d, row in zip(data["ranks"], data["timeline"]):
        cells = []
        for a in row:
            if a is None:
                cells.append('<td class="bubble" title="bubble: this rank computes nothing"></td>')
            else:
                chunk = f", chunk {a['chunk']}" if a["chunk"] else ""
                cells.append(f'<td class="act-{e(a["kind"])}" title="{e(a["kind"])}, micro-batch {a["microbatch"]}'
                             f'{chunk}">{e(a["label"])}</td>')
        rows.append(f'<tr><th>rank {d}</th>{"".join(cells)}</tr>')
    kinds = sorted({a["kind"] for row in data["timeline"] for a in row if a is not None},
                   key=list(_KIND_LETTER).index)
    legend = "".join(f'<span class="act-{k}">{_KIND_LETTER[k]}i: {k.replace("_", " ")} of micro-batch i</span>'
                     for k in kinds) + '<span class="bubble-key">blank: bubble</span>'
    stages = []
    for s in data["stages"]:
        state = ", ".join(f"{e(path)} {list(shape)}" for path, shape in s["params"]) or "none"
        stages.append(f"<tr><td class='num'>{s['index']}</td><td class='num'>{s['rank']}</td>"
                      f"<td class='num'>{s['chunk']}</td><td>{e(str(list(s['devices'])))}</td>"
                      f"<td>{e(_ops_text(s['forward_ops']))}</td><td>{e(_ops_text(s['backward_ops']))}</td>"
                      f"<td>{e(_ops_text(s['once_ops']))}</td><td class='mono'>{state}</td></tr>")
    search = ""
    if data.get("search"):
        cand = "".join(f"<tr><td class='num'>{t * 1e3:.3f}</td><td class='num'>{mb}</td><td>{e(name)}</td>"
                       f"<td class='num'>{b}</td></tr>" for t, mb, name, b in data["search"])
        search = ("<h3>Schedules searched (fastest first)</h3><table><tr><th class='num'>modeled ms</th>"
                  f"<th class='num'>micro-batches</th><th>schedule</th><th class='num'>bytes / device</th></tr>{cand}"
                  "</table>")
    ranks = "".join(f"<details><summary>rank {d}</summary><pre class='rank'>{e(t)}</pre></details>"
                    for d, t in zip(data["ranks"], data["rank_texts"]))
    title = f"shardprop pipeline: {data['schedule']}"
    payload = to_json(data).replace("</", "<\\/")
    return (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>{e(title)}</title>\n"
            f"<link rel=\"icon\" href=\"data:,\">\n<style>\n{css}\n</style>\n</head>\n<body class=\"pipeline\">\n"
            f"<header id=\"top\"><div class=\"title\"><b>shardprop pipeline</b> <span id=\"schedule\">"
            f"{e(data['schedule'])}</span></div><div class=\"counts\">"
            + "".join(f'<span class="chip">{c}</span>' for c in chips) + "</div></header>\n<main>\n"
            f"<h3>Schedule</h3><p class=\"legend\">{legend}</p>\n<table class=\"timeline\" id=\"timeline\">"
            f"<tr><th>tick</th>{head}</tr>{''.join(rows)}</table>\n"
            "<h3>Stages</h3><table class=\"stages\" id=\"stages\"><tr><th class='num'>stage</th><th class='num'>rank"
            "</th><th class='num'>chunk</th><th>devices</th><th>forward ops</th><th>backward ops</th><th>once ops"
            f"</th><th>state owned</th></tr>{''.join(stages)}</table>\n{search}"
            f"<h3>Each rank's program</h3>{ranks}\n</main>\n"
            f"<script id=\"pipeline-data\" type=\"application/json\">{payload}</script>\n</body>\n</html>\n")


def write_pipeline_html(data: dict, path: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_pipeline_html(data))
    return path
