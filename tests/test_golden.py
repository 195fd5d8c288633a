"""Golden IR dumps: the quickstart's and one transformer layer's files are checked
in and compared as text.
Regenerate with ``pytest tests/test_golden.py --regen-golden`` after a deliberate change."""
import pathlib

import pytest

import shardprop as sp
from tests import golden_nets

GOLDEN = pathlib.Path(__file__).parent / "golden"
CASES = {
    "quickstart_mindspore_form": (golden_nets.seed_net, golden_nets.seed_args, dict(fuse_reduce_scatter=False)),
    "quickstart_fused": (golden_nets.seed_net, golden_nets.seed_args, dict()),
    "transformer_layer": (golden_nets.transformer_layer, golden_nets.transformer_args, dict()),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_dumps_match_golden(case, tmp_path, request):
    fn, args, options = CASES[case]
    sp.parallelize(fn, mesh=8, dump_dir=str(tmp_path), **options).plan(*args())
    produced = {p.relative_to(tmp_path).as_posix(): p.read_text() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    target = GOLDEN / case
    if request.config.getoption("--regen-golden"):
        for rel, text in produced.items():
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            (target / rel).write_text(text)
    expected = {p.relative_to(target).as_posix(): p.read_text() for p in sorted(target.rglob("*")) if p.is_file()}
    assert sorted(produced) == sorted(expected), "the set of dump files changed"
    for rel in expected:
        assert produced[rel] == expected[rel], f"{case}/{rel} differs from the golden file"
