"""How big the plan report is and how fast it opens, for GPT training steps.

Builds the GPT training step of examples/gpt_megatron.py (forward, backward, Adam;
Megatron annotations, 8-way tensor parallel, params and state donated) as
bench/propagation.py does, writes ``plan.to_html``, and opens it in headless
Chromium (Debian's package, driven by Playwright) from file://. Prints per size:
ops, collectives, seconds to make the page in Python (the plan data, then the
HTML), the file size, and in the browser: the page's own clock from navigation
start to drawn-and-interactive, the wall time of the load as the driver sees it,
and the time from clicking an op to its panel drawn (medians of --repeat loads).

    python bench/report.py                        # 12 and 48 layers
    python bench/report.py --layers 12 --repeat 5
    python bench/report.py --seed-screenshot bench/results/seed_report.png
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import numpy as np  # noqa: E402

import gpt_megatron as M  # noqa: E402
import shardprop as sp  # noqa: E402
from bench.browser import chromium, open_report, why_no_browser  # noqa: E402


def gpt_step_plan(layers: int):
    cfg = M.Config(layers=layers)
    params = M.init_params(cfg)
    tokens, targets = M.make_batch(cfg)
    step, opt = M.make_train_step(M.Parallelism.tensor(8), cfg)
    pstep = sp.parallelize(step, mesh=8, donate_argnums=(0, 1), progress=False)
    return pstep.plan(params, opt.init(params), tokens, targets)


def click_ms(opened, op: int) -> float:
    """From a click on op ``op``'s row to its panel drawn (the page's clock)."""
    page = opened.page
    page.evaluate(f"window.shardpropReport.reveal({op})")   # scrolls its row into view
    page.evaluate("window.shardpropReport.select(null)")
    return page.evaluate(f"""() => {{
        const t0 = performance.now();
        document.querySelector("#program-view .row[data-op='{op}']").click();
        if (!document.getElementById("origin-line")) throw new Error("no panel");
        return performance.now() - t0;
    }}""")


def measure(browser, layers: int, repeat: int, out_dir: str) -> dict:
    t0 = time.perf_counter()
    plan = gpt_step_plan(layers)
    t1 = time.perf_counter()
    plan.data
    t2 = time.perf_counter()
    path = plan.to_html(os.path.join(out_dir, f"gpt{layers}.html"))
    t3 = time.perf_counter()
    loads = []
    for _ in range(repeat):
        opened = open_report(browser, path)
        assert not opened.errors, opened.errors
        target = plan.data["plan_ops"][len(plan.ops) // 2]
        loads.append((opened.ready_ms, opened.wall_s * 1000, click_ms(opened, target)))
        opened.page.close()
    ready, wall, click = (statistics.median(x) for x in zip(*loads))
    return dict(layers=layers, ops=len(plan.ops), collectives=len(plan.collectives), compile_s=t1 - t0,
                data_s=t2 - t1, html_s=t3 - t2, bytes=os.path.getsize(path), ready_ms=ready, wall_ms=wall,
                click_ms=click)


def seed_screenshot(browser, out: str) -> None:
    """The quickstart's network (examples/quickstart.py), its second matmul selected."""
    import quickstart
    rng = np.random.default_rng(1)
    x = rng.random((16, 32), dtype=np.float32)
    w1 = rng.standard_normal((32, 16)).astype(np.float32)
    w2 = rng.standard_normal((16, 16)).astype(np.float32)
    plan = sp.parallelize(quickstart.net, mesh=8, progress=False).plan(x, w1, w2)
    with tempfile.TemporaryDirectory() as d:
        opened = open_report(browser, plan.to_html(os.path.join(d, "seed.html")))
        page = opened.page
        page.click(f"#program-view .row[data-op='{plan.data['plan_ops'][2]}']")
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        page.screenshot(path=out)
        assert not opened.errors, opened.errors
    print(f"wrote {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[12, 48])
    ap.add_argument("--repeat", type=int, default=3, help="page loads per size; medians are reported")
    ap.add_argument("--seed-screenshot", metavar="PNG", help="only write a 1280x800 screenshot of the seed network's report")
    args = ap.parse_args()
    reason = why_no_browser()
    if reason:
        sys.exit(f"bench/report.py needs a browser: {reason}")
    with chromium() as browser:
        if args.seed_screenshot:
            seed_screenshot(browser, args.seed_screenshot)
            return
        with tempfile.TemporaryDirectory() as out_dir:
            for n in args.layers:
                r = measure(browser, n, args.repeat, out_dir)
                print(f"{r['layers']:3d} layers  {r['ops']:6d} ops  {r['collectives']:4d} collectives  | "
                      f"plan data {r['data_s']:.2f}s, html {r['html_s']:.2f}s, {r['bytes'] / 2**20:.2f} MiB | "
                      f"Chromium: interactive {r['ready_ms']:.0f} ms after navigation start "
                      f"(load {r['wall_ms']:.0f} ms as the driver sees it), click to panel {r['click_ms']:.0f} ms",
                      flush=True)
    print(f"medians of {args.repeat} loads; goal: the 12-layer step interactive in under 2 s")


if __name__ == "__main__":
    main()
