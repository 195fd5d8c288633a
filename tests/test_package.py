"""The package behaves like one: ``import shardprop`` is the API, and the
repository's folders are not installed as generic top-level modules."""
import subprocess
import sys

import pytest

import shardprop as sp


def test_public_api_is_shardprop():
    for name in ("shard", "parallelize", "ShardingError", "Model", "LossMonitor", "Checkpointer", "DataLoader",
                 "report"):
        assert hasattr(sp, name), name
    assert sp.parallelize.__module__ == "shardprop.compiler.api"


@pytest.mark.multiprocess
def test_generic_names_are_not_installed(tmp_path):
    # run from an empty folder so the repository's own folders are not on sys.path
    for name in ("compiler", "ir", "passes", "runtime"):
        r = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path, capture_output=True, text=True)
        assert r.returncode != 0 and "No module named" in r.stderr, (name, r.stderr)
    r = subprocess.run([sys.executable, "-c", "import shardprop.passes.rules"], cwd=tmp_path, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr


def test_report_of_a_plan_and_of_its_dump_folder_are_the_same_page(tmp_path):
    import jax.numpy as jnp
    import numpy as np
    x = np.ones((8, 8), np.float32)
    plan = sp.parallelize(lambda x: jnp.tanh(x) @ x, mesh=8, dump_dir=str(tmp_path / "dump")).plan(x)
    a = sp.report(plan, tmp_path / "a.html")
    b = sp.report(tmp_path / "dump", tmp_path / "b.html")
    assert open(a).read() == open(b).read() and "<html" in open(a).read()
