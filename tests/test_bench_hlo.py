"""bench/hlo.py: the HLO collective parser the XLA comparison relies on, on literal snippets."""
from bench.hlo import collectives, group_size, shape_bytes


def test_shapes_and_tuples():
    assert shape_bytes("f32[8,16]{1,0}") == 512
    assert shape_bytes("(f32[8,16]{1,0}, bf16[4]{0})") == 512 + 8
    assert shape_bytes("f32[]") == 4


def test_explicit_and_iota_groups():
    assert group_size("x = f32[8] all-reduce(y), replica_groups={{0,1,2,3},{4,5,6,7}}", 8) == 4
    assert group_size("x = f32[8] all-reduce(y), replica_groups=[2,4]<=[8]", 8) == 4
    assert group_size("x = f32[8] all-gather(y), replica_groups=[4,2]<=[2,4]T(1,0)", 8) == 2
    assert group_size("x = f32[8] all-reduce(y), replica_groups={}", 8) == 8


def test_counts_and_bytes():
    hlo = """
  %all-reduce = f32[8,16]{1,0} all-reduce(%a), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %rs = f32[8,4]{1,0} reduce-scatter(%b), replica_groups=[2,4]<=[8], dimensions={1}, to_apply=%add
  %ag-start = (f32[2,8]{1,0}, f32[16,8]{1,0}) all-gather-start(%c), replica_groups=[1,8]<=[8], dimensions={0}
  %ag-done = f32[16,8]{1,0} all-gather-done(%ag-start)
  %t = (f32[4]{0}, f32[4]{0}) all-reduce(%d, %e), replica_groups={{0,1}}, to_apply=%add
  ROOT %cp = f32[4]{0} collective-permute(%f), source_target_pairs={{0,1},{1,0}}
"""
    c = collectives(hlo, 8)
    assert dict(c.counts) == {"all-reduce": 2, "reduce-scatter": 1, "all-gather": 1, "collective-permute": 1}
    expected = 2 * 3 / 4 * 512 + 3 * 128 + 7 * 512 / 8 + 2 * 1 / 2 * 32 + 16
    assert abs(c.bytes - expected) < 1e-6
