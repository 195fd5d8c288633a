"""python -m tests.fuzz --n 10000 --seed 7 [--jobs 2] [--features a,b] [--without c] [--index I]"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def _names(values) -> set:
    return {x.strip() for v in values or () for x in v.split(",") if x.strip()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fuzz", description="Differential fuzzer: random programs, "
                                 "parallel against one device (see tests/fuzz/__init__.py).")
    ap.add_argument("--n", type=int, default=100, help="number of programs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="first program index")
    ap.add_argument("--index", type=int, action="append", help="run only these indices (repeatable); prints "
                    "each program and shrinks it if it fails")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--features", action="append", help="only these features (comma separated)")
    ap.add_argument("--without", action="append", help="all features but these (comma separated)")
    ap.add_argument("--list-features", action="store_true")
    ap.add_argument("--no-shrink", action="store_true")
    ap.add_argument("--shrink-budget", type=float, default=120.0, help="seconds per failure signature")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per program")
    ap.add_argument("--out", default="fuzz_failures", help="where shrunk repros are written")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)

    from .runner import configure_devices
    configure_devices()
    from .generate import FEATURES
    if a.list_features:
        print(" ".join(FEATURES))
        return 0
    features = _names(a.features) or set(FEATURES)
    unknown = (features | _names(a.without)) - set(FEATURES)
    if unknown:
        ap.error(f"unknown features {sorted(unknown)}; known: {' '.join(FEATURES)}")
    features -= _names(a.without)

    from .runner import run_many
    if a.index:
        from .generate import generate
        from .render import render
        for i in a.index:
            print(render(generate(a.seed, i, tuple(sorted(features)))).source)
    report = run_many(a.seed, a.n, sorted(features), jobs=a.jobs, start=a.start, shrink=not a.no_shrink,
                      out_dir=a.out, shrink_budget=a.shrink_budget, timeout=a.timeout, progress=not a.quiet,
                      indices=a.index)
    print(report.text())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
