"""The plan report: plan.json in dumps, plan.to_html / ``shardprop report`` (one page
from one data), plan.explain, repeated layers, and the page itself in a headless
Chromium (skipped, with the reason, where no browser is found)."""
import json
import re
import sys
from pathlib import Path

import pytest

import shardprop as sp
from bench.browser import chromium, open_report, why_no_browser
from shardprop.compiler.cli import main as cli
from shardprop.runtime.plan_data import load_plan_data, to_json
from shardprop.ir.repeats import find_repeats
from tests import golden_nets

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gpt_megatron as M  # noqa: E402

NO_BROWSER = why_no_browser()


@pytest.fixture(scope="module")
def seed_plan():
    return sp.parallelize(golden_nets.seed_net, mesh=8).plan(*golden_nets.seed_args())


@pytest.fixture(scope="module")
def gpt_plan():
    """A 2-layer GPT training step on a named dp x mp mesh: repeated layers, and
    collective groups that differ from rank to rank."""
    cfg = M.Config(layers=2)
    params = M.init_params(cfg)
    tokens, targets = M.make_batch(cfg)
    step, opt = M.make_train_step(M.Parallelism.data_and_tensor(), cfg)
    pstep = sp.parallelize(step, mesh=((2, 4), ("dp", "mp")), donate_argnums=(0, 1), progress=False)
    return pstep.plan(params, opt.init(params), tokens, targets)


def origin_line(text: str) -> str:
    return next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.strip().startswith("origin:"))


# -- the data -------------------------------------------------------------------

def test_dump_holds_plan_json_and_the_cli_draws_the_same_page(tmp_path):
    dump = tmp_path / "saved_graph"
    plan = sp.parallelize(golden_nets.seed_net, mesh=8, dump_dir=str(dump)).plan(*golden_nets.seed_args())
    assert to_json(load_plan_data(str(dump))) == to_json(plan.data)
    out = tmp_path / "from_cli.html"
    assert cli(["report", str(dump), "-o", str(out)]) == 0
    assert out.read_text() == plan.to_html() == Path(plan.to_html(tmp_path / "from_plan.html")).read_text()


def test_cli_report_errors(tmp_path, capsys):
    assert cli(["report", str(tmp_path / "missing")]) == 1
    assert "no such dump folder" in capsys.readouterr().err
    (tmp_path / "old").mkdir()
    assert cli(["report", str(tmp_path / "old")]) == 1
    assert "compile again with a dump_dir" in capsys.readouterr().err


@pytest.mark.parametrize("which", ["seed_plan", "gpt_plan"])
def test_data_is_the_plan(which, request):
    plan = request.getfixturevalue(which)
    data = plan.data
    assert [data["ops"][i]["kind"] for i in data["plan_ops"]] == [o.primitive for o in plan.ops]
    assert len(data["collectives"]) == len(plan.collectives) and plan.collectives
    sets = data["group_sets"]
    for c, pc in zip(data["collectives"], plan.collectives):
        assert (c["kind"], tuple(c["in_shape"]), tuple(c["out_shape"]), c["bytes"]) == \
               (pc.kind, pc.in_shape, pc.out_shape, pc.bytes)
        assert tuple(map(tuple, sets[c["groups"]])) == pc.groups
        assert data["ops"][c["op"]]["kind"] == pc.kind
    layouts = data["layouts"]
    for i, o in zip(data["plan_ops"], plan.ops):
        op = data["ops"][i]
        assert [_layout_str(layouts[l]) for l in op["out_layouts"]] == list(o.out_layouts)
        for n, l in enumerate(op["in_layouts"]):   # None: a literal operand
            assert l is None or _layout_str(layouts[l]) == o.in_layouts[n]


def _layout_str(l: dict) -> str:
    s = "[" + ", ".join("{" + ",".join(d) + "}" for d in l["dims"]) + "]"
    return s + (f" partial_{l['partial_op']}{{{','.join(l['partial'])}}}" if l["partial"] else "")


def test_explain_seed(seed_plan):
    plan = seed_plan
    relu_matmul = plan.ops[2]
    text = plan.explain(relu_matmul)
    assert text == plan.explain(2)
    assert f"strategy:     {relu_matmul.in_strategy} -> {relu_matmul.out_strategy}" in text
    # back to the user's mark, through the relu
    assert origin_line(text) == ("forward from max at golden_nets.py:13, forward from shard(matmul) at "
                                 "golden_nets.py:12 (its partial all-reduced whole, not scattered: the whole plan "
                                 "then models 5.0 us in 1 redistribution against 10.0 us in 2 redistributions), "
                                 "forward from dot_general at golden_nets.py:12 (the user's mark)")
    assert "not recorded" in text   # rejected alternatives: propagation does not keep them
    assert "before: slice over d2" in text
    line = plan.explain("golden_nets.py:13")
    assert line.startswith("golden_nets.py:13: 1 operators, 1 collectives") and "max at golden_nets.py:13" in line
    assert plan.explain("examples/golden_nets.py:13") == line
    coll = plan.explain(plan.collectives[0])
    assert "all_reduce over d1,d2 (8, 16) -> (8, 16) per device, 768 bytes, groups 0-1-2-3 4-5-6-7" in coll
    with pytest.raises(ValueError, match="golden_nets.py:12, golden_nets.py:13, golden_nets.py:14"):
        plan.explain("golden_nets.py:99")
    with pytest.raises(IndexError, match="3 operators"):
        plan.explain(3)
    with pytest.raises(TypeError, match="source line"):
        plan.explain(1.5)


def test_find_repeats():
    assert [(r.start, r.period, r.count) for r in find_repeats([1, 2, 3] * 3 + [9])] == [(0, 3, 3)]
    assert find_repeats(list(range(20))) == []
    # a layer that itself repeats a block inside: the layer first, the inner run within it
    layer = [7, 8, 8, 8, 8, 8, 9]
    reps = find_repeats([0] + layer * 4 + [1], min_saved=3)
    assert [(r.start, r.period, r.count) for r in reps] == [(1, 7, 4)]
    assert [(r.start, r.period, r.count) for r in reps[0].inner] == [(1, 1, 5)]


def test_gpt_layers_are_found(gpt_plan):
    root = gpt_plan.data["graphs"][0]
    counts = [r["count"] for r in root["repeats"]]
    assert counts.count(2) >= 2    # the forward layers and the backward layers
    hidden = sum(r["period"] * (r["count"] - 1) for r in root["repeats"])
    assert hidden > len(root["ops"]) / 4


def test_page_is_self_contained(seed_plan):
    page = seed_plan.to_html()
    assert not re.search(r"<script[^>]+src=|<link[^>]+stylesheet|@import|url\(", page)
    assert set(re.findall(r"https?://[^\s\"')]+", page)) <= {"http://www.w3.org/2000/svg"}   # a namespace, not a fetch


# -- in a browser -------------------------------------------------------------------

browser_test = pytest.mark.skipif(NO_BROWSER is not None, reason=f"no browser for the report test: {NO_BROWSER}")


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


@browser_test
@pytest.mark.browser
def test_seed_report_in_browser(seed_plan, browser, tmp_path):
    plan = seed_plan
    path = plan.to_html(tmp_path / "seed.html")
    opened = open_report(browser, path)
    page = opened.page
    assert page.inner_text("#count-ops") == str(len(plan.ops))
    assert page.inner_text("#count-collectives") == str(len(plan.collectives))
    # the relu's matmul: click it, read where its strategy came from
    op = plan.data["plan_ops"][2]
    page.click(f"#program-view .row[data-op='{op}']")
    assert page.inner_text("#origin-line") == origin_line(plan.explain(2))
    assert "(4, 1), (1, 2)" in page.inner_text("#panel")
    # its operands drawn over the mesh: the first operand in 4 row blocks (split over d0, d2)
    assert page.locator("#panel .grid").first.locator(".cell").count() == 4
    # the collectives are there, highlighted, with their groups
    rows = page.locator("#program-view .row.coll")
    assert rows.count() == len(plan.collectives)
    assert "groups 0-3 4-7" in rows.first.inner_text()
    page.screenshot(path=str(tmp_path / "seed_report.png"))
    assert (tmp_path / "seed_report.png").stat().st_size > 10_000
    assert opened.errors == []


@browser_test
@pytest.mark.browser
def test_rank_view_is_the_rank_dump(browser, tmp_path):
    """Each rank's view shows what rank_<r>/execute.ir runs: its collective groups, its
    slice offsets, where its blocks of the inputs start (MindSpore's form: all_reduce + slice)."""
    plan = sp.parallelize(golden_nets.seed_net, mesh=8, fuse_reduce_scatter=False).plan(*golden_nets.seed_args())
    plan.dump(str(tmp_path / "dump"))
    page = open_report(browser, plan.to_html(tmp_path / "ms.html")).page
    for r in range(plan.mesh.size):
        text = (tmp_path / "dump" / f"rank_{r}" / "execute.ir").read_text()
        want = [f"group {m[1]}" if m[0] == "all_reduce" else f"begin ({m[2]})"
                for m in re.findall(r"= (all_reduce|slice)\(%\d+\) \{(?:group_ranks=([\d-]+)|begin=\(([\d, ]+)\))", text)]
        offsets = re.findall(r"offsets=\(([\d, ]+)\)", text)
        page.select_option("#rank", str(r))
        shown = page.locator("#program-view .row.coll .strat").all_inner_texts()
        assert len(shown) == len(want) == 3
        assert all(w in s for w, s in zip(want, shown)), (r, want, shown)
        inputs = page.locator("#program-view .row[data-value] .strat").all_inner_texts()
        assert [f"offsets ({o})" in s for o, s in zip(offsets, inputs)] == [True] * len(offsets) == [True] * 3


@browser_test
@pytest.mark.browser
def test_gpt_report_in_browser(gpt_plan, browser, tmp_path):
    plan, data = gpt_plan, gpt_plan.data
    opened = open_report(browser, plan.to_html(tmp_path / "gpt.html"))
    page = opened.page
    assert page.inner_text("#count-ops") == str(len(plan.ops))
    assert page.inner_text("#count-collectives") == str(len(plan.collectives))
    # layers start collapsed into blocks with their repeat count
    blocks = page.locator("#program-view .row.block")
    assert blocks.count() >= 1 and "×2 repeated" in blocks.first.inner_text()
    # search by source line: as many hits as ops from that line, Enter goes to the first
    line = next(c["source"] for c in data["collectives"] if c["source"])
    n = sum(1 for o in data["ops"] if o["source"] is not None and data["strings"][o["source"]] == line)
    page.fill("#search", line)
    page.wait_for_selector("#search-results:not([hidden]) .head")
    assert page.inner_text("#search-results .head").startswith(f"{n} match")
    page.press("#search", "Enter")
    first = int(page.get_attribute("#search-results .hit", "data-goto"))
    page.wait_for_selector(f"#program-view .row.sel[data-op='{first}']")
    # the program rank 5 executes: its own group in each collective
    page.select_option("#rank", "5")
    ci = data["ops"][first].get("collective")
    if ci is None:
        ci = 0
        page.evaluate(f"window.shardpropReport.reveal({data['collectives'][0]['op']})")
    group = next(g for g in data["group_sets"][data["collectives"][ci]["groups"]] if 5 in g)
    row = page.locator(f"#program-view .row[data-op='{data['collectives'][ci]['op']}']")
    assert "group " + "-".join(map(str, group)) in row.inner_text()
    # the summary: bytes by kind
    page.click("#tabs button[data-tab=summary]")
    assert f"{plan.count('all_reduce')}" in page.locator("#summary-view table").first.inner_text()
    page.screenshot(path=str(tmp_path / "gpt_report.png"))
    assert opened.errors == []


# -- a pipeline plan's report -------------------------------------------------------

@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved", 2)])
def test_pipeline_report_draws_the_stages_and_the_schedule_as_a_timeline(schedule, v, tmp_path):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    p, m, opt = 2, 4, optax.sgd(0.1)

    def loss_fn(params, batch):
        h = batch[0]
        for i, w in enumerate(params):
            h = jnp.tanh(h @ w["w"] + w["b"])
            if i + 1 < len(params):
                h = sp.stage_boundary(h)     # p * v stages of one layer each
        return jnp.mean((h - batch[1]) ** 2)

    def step(params, opt_state, batch):
        loss, g = jax.value_and_grad(loss_fn)(params, batch)
        up, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, up), opt_state, loss

    rng = np.random.default_rng(0)
    params = [{"w": rng.standard_normal((8, 8)).astype(np.float32), "b": np.zeros(8, np.float32)}
              for _ in range(p * v)]
    batch = tuple(rng.standard_normal((8, 8)).astype(np.float32) for _ in range(2))
    opt_state = opt.init(params)
    dump = tmp_path / "dump"
    pstep = sp.parallelize(step, mesh=((p,), ("pp",)), dump_dir=str(dump),
                           pipeline=sp.Pipeline(microbatches=m, schedule=schedule, virtual_stages=v))
    plan = pstep.plan(params, opt_state, batch)
    page = plan.to_html()
    assert (dump / "pipeline.html").read_text() == page == Path(plan.to_html(tmp_path / "p.html")).read_text()
    assert not re.search(r"<script[^>]+src=|<link[^>]+stylesheet|@import|url\(|https?://", page)
    info = plan.pipeline
    # the timeline: one row per rank, one cell per tick; an action's cell holds its
    # micro-batch (and chunk), a bubble's cell is blank
    timeline = re.search(r'<table class="timeline".*?</table>', page, re.S).group(0)
    rows = re.findall(r'<tr><th>rank (\d+)</th>(.*?)</tr>', timeline)
    assert [int(d) for d, _ in rows] == list(range(p))
    for d, cells in rows:
        cells = re.findall(r'<td class="([\w-]+)"[^>]*>([^<]*)</td>', cells)
        assert len(cells) == info.ticks
        for t, (cls, label) in enumerate(cells):
            a = info.schedule.get((t, int(d)))
            assert (cls, label) == (("bubble", "") if a is None else (f"act-{a.kind}", str(a)))
        labels = [label for _, label in cells if label]
        assert len(labels) == len(set(labels)) == 2 * m * v       # F and B of every micro-batch, each chunk, once
        assert {f"F{i}" for i in range(m)} <= set(labels)
    blanks = sum(label == "" for _, cells in rows for label in re.findall(r"<td[^>]*>([^<]*)</td>", cells))
    assert blanks == p * info.ticks - 2 * m * v * p
    # the stages: rank, chunk, devices, ops and the state each owns
    stages = re.findall(r"<tr><td class='num'>(\d+)</td><td class='num'>(\d+)</td><td class='num'>(\d+)</td>"
                        r"<td>(\[[\d, ]*\])</td><td>([^<]*)</td>", page)
    assert [(int(k), int(d), int(c)) for k, d, c, _, _ in stages] == [(s.index, s.rank, s.chunk) for s in info.stages]
    assert all("dot_general" in fwd and "tanh" in fwd for *_, fwd in stages)
    assert all(path in page for s in info.stages for path, _ in s.params)
    # the data under the page is the plan's
    data = json.loads(re.search(r'<script id="pipeline-data" type="application/json">(.*?)</script>', page,
                                re.S).group(1).replace("<\\/", "</"))
    assert data == json.loads(to_json(info.to_data()))
