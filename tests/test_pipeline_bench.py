"""bench/pipeline.py prints issue 26's four CPU criteria, each figure beside its target
(run as a script on a tiny model: the bench sets its own XLA flags before jax starts)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_prints_the_four_criteria(tmp_path):
    out = tmp_path / "pipeline.txt"
    run = subprocess.run([sys.executable, "bench/pipeline.py", "--width", "16", "--layers", "4", "--batch", "16",
                          "--pp", "2", "--microbatches", "4", "--reps", "1", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    text = out.read_text()
    for head in ("1. work on bubble ticks", "2. step time / the stages' work", "3. compiled memory",
                 "4. step time / the cost model's"):
        assert head in text
    assert text.count("computes nothing: True") == 2                       # gpipe and 1f1b
    assert "activations 0.50 (target p/m = 0.50)" in text                  # 2 slots against 4
    for name in ("gpipe", "1f1b"):
        assert re.search(rf"{name} +step +[\d.]+ ms, stages' work +[\d.]+ ms .*\): +[\d.]+ ", text)
        assert re.search(rf"{name} +step +[\d.]+ ms, modeled +[\d.]+ ms: +[\d.]+ ", text)
