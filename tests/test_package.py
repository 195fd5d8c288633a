"""The package behaves like one: ``import shardprop`` is the API, and the
repository's folders are not installed as generic top-level modules."""
import subprocess
import sys

import shardprop as sp


def test_public_api_is_shardprop():
    for name in ("shard", "parallelize", "ShardingError", "Model", "LossMonitor", "Checkpointer", "DataLoader"):
        assert hasattr(sp, name), name
    assert sp.parallelize.__module__ == "shardprop.compiler.api"


def test_generic_names_are_not_installed(tmp_path):
    # run from an empty folder so the repository's own folders are not on sys.path
    for name in ("compiler", "ir", "passes", "runtime"):
        r = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path, capture_output=True, text=True)
        assert r.returncode != 0 and "No module named" in r.stderr, (name, r.stderr)
    r = subprocess.run([sys.executable, "-c", "import shardprop.passes.rules"], cwd=tmp_path, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
