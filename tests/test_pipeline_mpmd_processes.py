"""``sp.Pipeline(lowering="mpmd")`` over several processes (runtime/pipeline_mpmd.py,
runtime/pipeline_mpmd_procs.py): ``shardprop launch`` starts two processes; each runs
its own ranks' programs, values cross between processes by a move both take part in.
Every case is checked against one device (losses, parameters, optimizer state).

This file is also the launched script: ``python -m shardprop.runtime.launch --nproc 2
--devices-per-proc 4 tests/test_pipeline_mpmd_processes.py OUT CASE...`` runs each CASE
and writes, per process, the losses and the state leaves that process holds to
``OUT/<case>.<process>.npz`` (the ``spanning`` case: the error to ``OUT/spanning.txt``);
the test merges the two and compares. One launch runs every case: each launch pays
for starting two processes and joining them."""
import re
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


def cases():
    """name -> (mesh, Pipeline kwargs, parallelize kwargs, builder of (step, args, train):
    the step and its arguments, and whether it returns (state..., loss)). On 2 processes x
    4 devices, the pipeline axis first: ranks of the first half of the mesh in process 0."""
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

    pp_dp = ((4, 2), ("pp", "dp"))
    return {
        "pp8_1f1b": (((8,), ("pp",)), dict(schedule="1f1b"), {}, lambda: mlp_case(8, 8)),   # cut 3|4 crosses
        "pp4_dp2_1f1b": (pp_dp, dict(schedule="1f1b"), {}, lambda: mlp_case(4, 4)),
        # the SPMD lowering's packed state read back on the process that holds its row
        "pp4_dp2_1f1b_spmd": (pp_dp, dict(schedule="1f1b", lowering="spmd"), {}, lambda: mlp_case(4, 4)),
        "pp4_dp2_forward": (pp_dp, dict(schedule="gpipe"), {}, forward),
        # the wrap-around from rank 3 to rank 0 crosses processes
        "pp4_dp2_interleaved": (pp_dp, dict(schedule="interleaved", virtual_stages=2), {},
                                lambda: mlp_case(8, 8)),
        # the tied embedding's gradients are summed between ranks 0 and 3
        "pp4_dp2_tied_gpt": (pp_dp, dict(schedule="1f1b", microbatches=2), dict(batch_argnums=(2, 3)), tied_gpt),
        # tensor parallel and ZeRO-1 over the sub-mesh beside pp
        "pp2_dp2_mp2_zero1": (((2, 2, 2), ("pp", "dp", "mp")), dict(schedule="1f1b", microbatches=2),
                              dict(batch_argnums=(2, 3), shard_optimizer_state=True), tp),
    }


def run_case(name, out_dir):
    """One case in this process of the launched run: STEPS steps, then its files."""
    import jax

    import shardprop as sp
    if name == "spanning":
        spanning(out_dir)
        return
    if name == "resumed":
        resumed(out_dir)
        return
    mesh, pipe, kw, build = cases()[name]
    step, args, train = build()
    pipe = dict(dict(microbatches=4, lowering="mpmd"), **pipe)
    pstep = sp.parallelize(step, mesh=mesh, pipeline=sp.Pipeline(**pipe), **kw)
    losses, outs = [], None
    for _ in range(STEPS if train else 1):
        outs = pstep(*args)
        if train:
            *state, loss = outs
            args = tuple(state) + tuple(args[len(state):])
            losses.append(float(sp.to_numpy(loss)))
    from shardprop.runtime.pipeline_lower import PackedLeaf
    held = {}
    for n, x in enumerate(jax.tree.leaves(outs)):
        # what this process holds: a stage's state lies on its rank's process alone
        if isinstance(x, jax.Array) and x.is_fully_addressable:
            held[f"leaf{n}"] = np.asarray(x)
        elif isinstance(x, jax.Array) and x.sharding.is_fully_replicated and x.addressable_shards:
            held[f"leaf{n}"] = np.asarray(x.addressable_data(0))
        elif isinstance(x, PackedLeaf) and x.addressable:
            held[f"leaf{n}"] = np.asarray(x)
        # and every value on every process (every process calls it)
        held[f"full{n}"] = sp.to_numpy(x)
    np.savez(Path(out_dir) / f"{name}.{jax.process_index()}.npz", losses=np.asarray(losses), **held)


def reference(name):
    """One device's losses and output leaves for case ``name``, and whether it trains."""
    import jax
    _, _, _, build = cases()[name]
    step, args, train = build()
    ref, losses = jax.jit(step), []
    for _ in range(STEPS if train else 1):
        outs = ref(*args)
        if train:
            *state, loss = outs
            args = tuple(state) + tuple(args[len(state):])
            losses.append(float(loss))
    return losses, [np.asarray(x) for x in jax.tree.leaves(outs)], train


def assert_cases_equal_one_device(tmp_path, names):
    for name in names:
        files = [np.load(tmp_path / f"{name}.{p}.npz") for p in (0, 1)]
        losses, leaves, train = reference(name)
        for f in files:     # both processes read the loss (replicated on every device)
            np.testing.assert_allclose(f["losses"], losses, rtol=1e-5)
        held = [{k for k in f.files if k.startswith("leaf")} for f in files]
        assert held[0] | held[1] == {f"leaf{n}" for n in range(len(leaves))}, name
        for f in files:   # sp.to_numpy gives every value whole on every process
            assert {k for k in f.files if k.startswith("full")} == {f"full{n}" for n in range(len(leaves))}, name
        if train:   # a stage's state lies on its rank's process alone
            assert held[0] - held[1] and held[1] - held[0], name
        else:       # a forward's outputs are replicated on every device, as the SPMD lowering returns them
            assert held[0] == held[1], name
        for f in files:
            for key in set(f.files) - {"losses"}:
                np.testing.assert_allclose(f[key], leaves[int(key[4:])], atol=1e-5, rtol=1e-4,
                                           err_msg=f"{name} {key}")


def resumed_steps():
    """The ``resumed`` case: the tied GPT (its embedding kept by ranks 0 and 3, in
    different processes), (step, params, opt_state, the data of its 3 steps): the second
    step's batch is half the first's (a new compiled signature), the third the first's
    again (the first signature, given the second's outputs)."""
    from tests.test_pipeline_lowering import gpt_pipeline_case
    step, params, opt_state, (tokens, targets) = gpt_pipeline_case(4, 16, 4, tied=True)
    half = (tokens[:8], targets[:8])
    return step, params, opt_state, [(tokens, targets), half, (tokens, targets)]


def resumed(out_dir):
    """State that no call of this compiled step returned: after the first step the state
    is saved with ``sp.Checkpointer`` and restored (into the layouts it was saved from),
    the second step runs on half the batch (another signature, whose program has not seen
    that state), the third on the first signature again, given the second's outputs."""
    import jax

    import shardprop as sp
    step, params, opt_state, data = resumed_steps()
    pstep = sp.parallelize(step, mesh=((4, 2), ("pp", "dp")), batch_argnums=(2, 3),
                           pipeline=sp.Pipeline(microbatches=2, schedule="1f1b", lowering="mpmd"))
    state, losses = (params, opt_state), []
    for n, batch in enumerate(data):
        *state, loss = pstep(*state, *batch)
        losses.append(float(sp.to_numpy(loss)))
        if n == 0:
            ckpt = sp.Checkpointer(str(Path(out_dir) / "ckpt"))
            ckpt.save(1, tuple(state))
            state = ckpt.restore(tuple(state))
            ckpt.close()
    leaves = jax.tree.leaves(tuple(state))
    np.savez(Path(out_dir) / f"resumed.{jax.process_index()}.npz", losses=np.asarray(losses),
             **{f"full{n}": sp.to_numpy(x) for n, x in enumerate(leaves)})


def assert_resumed_equals_one_device(tmp_path):
    import jax
    step, params, opt_state, data = resumed_steps()
    ref, state, losses = jax.jit(step), (params, opt_state), []
    for batch in data:
        *state, loss = ref(*state, *batch)
        losses.append(float(loss))
    leaves = jax.tree.leaves(tuple(state))
    for p in (0, 1):
        f = np.load(tmp_path / f"resumed.{p}.npz")
        np.testing.assert_allclose(f["losses"], losses, rtol=1e-5)
        assert len(f.files) == len(leaves) + 1
        for n, want in enumerate(leaves):
            np.testing.assert_allclose(f[f"full{n}"], np.asarray(want), atol=2e-5, rtol=1e-4,
                                       err_msg=f"resumed leaf {n} on process {p}")


def spanning(out_dir):
    """The pipeline axis last: each rank's two devices lie in different processes."""
    import jax

    import shardprop as sp
    from tests.test_pipeline_lowering import mlp
    step, params, opt_state, batch = mlp(4, {0, 1, 2})
    pstep = sp.parallelize(step, mesh=((2, 4), ("dp", "pp")), pipeline=sp.Pipeline(microbatches=4, lowering="mpmd"))
    try:
        pstep(params, opt_state, batch)
        message = "no error"
    except sp.ShardingError as e:
        message = str(e)
    if jax.process_index() == 0:
        (Path(out_dir) / "spanning.txt").write_text(message)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)   # its launch waits up to 240 s, twice if the first hangs
def test_two_processes_equal_one_device(tmp_path):
    from tests.test_launch import launch_once_more_if_hung
    names = list(cases())
    proc = launch_once_more_if_hung(["--nproc", 2, "--devices-per-proc", 4, Path(__file__), tmp_path, "spanning",
                                     "resumed"] + names, cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_cases_equal_one_device(tmp_path, names)
    assert_resumed_equals_one_device(tmp_path)
    # a rank over two processes is refused, naming the rank, its stage, its devices, the fix
    msg = (tmp_path / "spanning.txt").read_text()
    # (jax numbers the second process's CPU devices from 2048)
    assert re.search(r'^Pipeline\(lowering="mpmd"\): pipeline rank 0 \(stage 0\) runs on devices \[0, \d+\]', msg)
    assert "belong to processes [0, 1]" in msg and "the pipeline axis first in the mesh" in msg
    assert 'lowering="spmd"' in msg


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    for case in sys.argv[2:]:
        run_case(case, sys.argv[1])
