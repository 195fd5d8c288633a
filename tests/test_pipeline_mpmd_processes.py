"""``sp.Pipeline(lowering="mpmd")`` over several processes (runtime/pipeline_mpmd.py,
runtime/pipeline_mpmd_procs.py): ``shardprop launch`` starts two processes; each runs
its own ranks' programs, values cross between processes by a move both take part in.
Every case is checked against one device (losses, parameters, optimizer state).

This file is also the launched script: ``python -m shardprop.runtime.launch --nproc 2
--devices-per-proc K tests/test_pipeline_mpmd_processes.py OUT CASE...`` runs each CASE
and writes, per process, the losses and the state leaves that process holds to
``OUT/<case>.<process>.npz``; the tests below merge the two and compare."""
import re
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


def cases():
    """name -> (devices per process, mesh, Pipeline kwargs, parallelize kwargs, builder of
    (step, args, train): the step and its arguments, and whether it returns (state..., loss))."""
    from tests.test_pipeline_compose import tp_mlp
    from tests.test_pipeline_lowering import even_cuts, forward_only_case, gpt_pipeline_case, mlp

    def mlp_case(layers, stages):
        step, params, opt_state, batch = mlp(layers, even_cuts(layers, stages))
        return step, (params, opt_state, batch), True

    def forward():
        infer, ws, x = forward_only_case()
        return infer, (ws, x), False

    def tied_gpt():
        step, params, state, data = gpt_pipeline_case(4, 8, 4, tied=True)
        return step, (params, state) + tuple(data), True

    def tp():
        step, params, opt_state, data = tp_mlp()
        return step, (params, opt_state) + tuple(data), True

    return {
        # 2 processes x 4 devices: ranks 0-3 in process 0, 4-7 in process 1
        "pp8_1f1b": (4, ((8,), ("pp",)), dict(schedule="1f1b"), {}, lambda: mlp_case(8, 8)),
        "pp4_dp2_1f1b": (4, ((4, 2), ("pp", "dp")), dict(schedule="1f1b"), {}, lambda: mlp_case(4, 4)),
        "pp4_dp2_forward": (4, ((4, 2), ("pp", "dp")), dict(schedule="gpipe"), {}, forward),
        # 2 processes x 2 devices
        "pp2_mp2_1f1b": (2, ((2, 2), ("pp", "mp")), dict(schedule="1f1b", microbatches=2),
                         dict(batch_argnums=(2, 3)), tp),
        "pp4_interleaved": (2, ((4,), ("pp",)), dict(schedule="interleaved", virtual_stages=2),
                            {}, lambda: mlp_case(8, 8)),
        "pp4_tied_gpt": (2, ((4,), ("pp",)), dict(schedule="1f1b"), dict(batch_argnums=(2, 3)), tied_gpt),
    }


def run_case(name, out_dir):
    """One case in this process of the launched run: STEPS steps, then its files."""
    import jax

    import shardprop as sp
    _, mesh, pipe, kw, build = cases()[name]
    step, args, train = build()
    pipe = dict(dict(microbatches=4), **pipe)
    pstep = sp.parallelize(step, mesh=mesh, pipeline=sp.Pipeline(lowering="mpmd", **pipe), **kw)
    losses, outs = [], None
    for _ in range(STEPS if train else 1):
        outs = pstep(*args)
        if train:
            *state, loss = outs
            args = tuple(state) + tuple(args[len(state):])
            losses.append(float(sp.to_numpy(loss)))
    held = {}
    for n, x in enumerate(jax.tree.leaves(outs)):
        # what this process holds: a stage's state lies on its rank's process alone
        if isinstance(x, jax.Array) and x.is_fully_addressable:
            held[f"leaf{n}"] = np.asarray(x)
        elif isinstance(x, jax.Array) and x.sharding.is_fully_replicated and x.addressable_shards:
            held[f"leaf{n}"] = np.asarray(x.addressable_data(0))
    np.savez(Path(out_dir) / f"{name}.{jax.process_index()}.npz", losses=np.asarray(losses), **held)


def reference(name):
    """One device's losses and output leaves for case ``name``, and whether it trains."""
    import jax
    _, _, _, _, build = cases()[name]
    step, args, train = build()
    ref, losses = jax.jit(step), []
    for _ in range(STEPS if train else 1):
        outs = ref(*args)
        if train:
            *state, loss = outs
            args = tuple(state) + tuple(args[len(state):])
            losses.append(float(loss))
    return losses, [np.asarray(x) for x in jax.tree.leaves(outs)], train


def launch_cases(tmp_path, names):
    from tests.test_launch import launch_once_more_if_hung
    per_proc = {cases()[n][0] for n in names}
    assert len(per_proc) == 1
    return launch_once_more_if_hung(["--nproc", 2, "--devices-per-proc", per_proc.pop(), Path(__file__), tmp_path]
                                    + list(names), cwd=tmp_path, timeout=240)


def assert_cases_equal_one_device(tmp_path, names):
    for name in names:
        files = [np.load(tmp_path / f"{name}.{p}.npz") for p in (0, 1)]
        losses, leaves, train = reference(name)
        for f in files:     # both processes read the loss (replicated on every device)
            np.testing.assert_allclose(f["losses"], losses, rtol=1e-5)
        held = [set(f.files) - {"losses"} for f in files]
        assert held[0] | held[1] == {f"leaf{n}" for n in range(len(leaves))}, name
        if train:   # a stage's state lies on its rank's process alone
            assert held[0] - held[1] and held[1] - held[0], name
        else:       # a forward's outputs are replicated on every device, as the SPMD lowering returns them
            assert held[0] == held[1], name
        for f in files:
            for key in set(f.files) - {"losses"}:
                np.testing.assert_allclose(f[key], leaves[int(key[4:])], atol=1e-5, rtol=1e-4,
                                           err_msg=f"{name} {key}")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_two_processes_of_four_devices_equal_one_device(tmp_path):
    """pp=8 (the cut between ranks 3 and 4 crosses processes), pp=4 x dp=2, and a
    forward-only pipeline whose batched output comes back on every process."""
    names = ["pp8_1f1b", "pp4_dp2_1f1b", "pp4_dp2_forward"]
    proc = launch_cases(tmp_path, names)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_cases_equal_one_device(tmp_path, names)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_two_processes_of_two_devices_equal_one_device(tmp_path):
    """pp=2 x mp=2 (each rank a tensor-parallel pair in its process), interleaved v=2
    (the wrap-around from rank 3 to rank 0 crosses processes), and a tied embedding
    whose gradients are summed between ranks 0 and 3, in different processes."""
    names = ["pp2_mp2_1f1b", "pp4_interleaved", "pp4_tied_gpt"]
    proc = launch_cases(tmp_path, names)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_cases_equal_one_device(tmp_path, names)


SPANNING = """
import jax, shardprop as sp
from tests.test_pipeline_lowering import mlp
step, params, opt_state, batch = mlp(4, {0, 1, 2})
pstep = sp.parallelize(step, mesh=((2, 4), ("dp", "pp")), pipeline=sp.Pipeline(microbatches=4, lowering="mpmd"))
try:
    pstep(params, opt_state, batch)
except sp.ShardingError as e:
    print("refused:", e)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_rank_over_two_processes_is_refused(tmp_path):
    """The pipeline axis last: each rank's two devices lie in different processes."""
    from tests.test_launch import launch_once_more_if_hung
    script = tmp_path / "spanning.py"
    script.write_text(f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" + SPANNING)
    proc = launch_once_more_if_hung(["--nproc", 2, "--devices-per-proc", 4, script], cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    msg = proc.stdout
    # (jax numbers the second process's CPU devices from 2048)
    assert re.search(r'refused: Pipeline\(lowering="mpmd"\): pipeline rank 0 \(stage 0\) runs on devices \[0, \d+\]', msg)
    assert "belong to processes [0, 1]" in msg and "the pipeline axis first in the mesh" in msg
    assert 'lowering="spmd"' in msg


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    for case in sys.argv[2:]:
        run_case(case, sys.argv[1])
