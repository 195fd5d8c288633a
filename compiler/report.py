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

