"""A compile longer than the delay shows its stages; a quiet one shows nothing."""
import io
import re
import time

import jax.numpy as jnp
import numpy as np

import shardprop as sp
from shardprop.compiler import progress
from shardprop.compiler.progress import CompileProgress


def test_stages_shown_only_after_the_delay():
    out = io.StringIO()
    with CompileProgress("net", delay_s=0.05, stream=out) as p:
        p.stage("tracing")
        time.sleep(0.2)
        p.stage("lowering")
    text = out.getvalue()
    assert "shardprop: net: tracing" in text and "shardprop: net: lowering" in text
    # (at least the 0.2 s slept: on a loaded machine the sleep runs over)
    took = re.search(r"net compiled in [0-9.]+s \(tracing ([0-9.]+)s", text)
    assert took is not None and float(took.group(1)) >= 0.2, text

    quick = io.StringIO()
    with CompileProgress("net", delay_s=5, stream=quick) as p:
        p.stage("tracing")
    assert quick.getvalue() == ""


def test_parallelize_shows_every_stage_and_is_quiet_when_asked(monkeypatch, capsys):
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    x = np.ones((8, 8), np.float32)
    sp.parallelize(lambda x: jnp.tanh(x) @ x, mesh=8)(x)
    err = capsys.readouterr().err
    for stage in ("tracing", "propagate-sharding", "localize", "lowering", "XLA compile and first run"):
        assert stage in err, (stage, err)
    sp.parallelize(lambda x: jnp.tanh(x) @ x, mesh=8, progress=False)(x)
    monkeypatch.setenv("SHARDPROP_PROGRESS", "0")
    sp.parallelize(lambda x: jnp.sin(x) @ x, mesh=8)(x)
    assert capsys.readouterr().err == ""
