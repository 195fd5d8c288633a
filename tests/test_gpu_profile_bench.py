"""bench/gpu_profile.py: the GPU profile checked against the device in hand. On a CPU it
runs at tiny sizes (--small), which keeps the script working between GPU runs."""
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_profile_is_named_after_the_device():
    sys.path.insert(0, str(ROOT))
    from bench.gpu_profile import profile_for
    assert profile_for(SimpleNamespace(device_kind="NVIDIA H200")) == "h200-141gb"
    assert profile_for(SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")) == "h100-80gb"
    assert profile_for(SimpleNamespace(device_kind="Tesla V100-SXM2-32GB")) == "v100-32gb"
    assert profile_for(SimpleNamespace(device_kind="NVIDIA A100-SXM4-80GB")) == "a100-80gb"


@pytest.mark.slow
def test_the_bench_prints_measured_beside_modeled():
    run = subprocess.run([sys.executable, "bench/gpu_profile.py", "--small", "--reps", "1", "--profile", "h200-141gb",
                          "--parts"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-3000:]
    text = run.stdout
    assert "profile h200-141gb" in text
    rows = re.findall(r"bfloat16 \[(\d+),\d+\]@\[\d+,\d+\] +[\d.]+ +([\d.]+)ms .* ([\d.]+)$", text, re.M)
    assert [r[0] for r in rows] == ["64", "128"] and all(float(r[2]) > 0 for r in rows)
    assert re.search(r"HBM streaming .* measured [\d.]+ TB/s, profile 4\.80 TB/s", text)
    gpt = re.findall(r"^GPT L1 h64 s32 b2 bfloat16( remat)? (forward|forward\+backward|step) +[\d.]+ +([\d.]+)ms "
                     r"+([\d.]+)ms", text, re.M)
    assert [(r, part) for r, part, _, _ in gpt] == [(r, part) for r in ("", " remat")
                                                   for part in ("forward", "forward+backward", "step")]
    assert all(float(m) > 0 and float(p) > 0 for _, _, m, p in gpt)
