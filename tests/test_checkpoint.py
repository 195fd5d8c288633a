"""Checkpoints: written once, never taken from a cut-off write, and resuming (after
a killed run, or on another mesh) gives exactly the losses of an uninterrupted run."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shardprop as sp
from tests import training_setup as T

ROOT = Path(__file__).resolve().parents[1]
EPOCHS = 3


def uninterrupted(mesh=8):
    return T.make_model(mesh).train(EPOCHS, T.batches())


def resume_and_finish(ckpt_dir, mesh):
    model = T.make_model(mesh)
    x, y = T.batches()[0]
    model.restore(sp.Checkpointer(str(ckpt_dir)), x, y)
    return model.position, model.train(EPOCHS, T.batches())


@pytest.mark.multiprocess
@pytest.mark.timeout(420)   # its worker may take up to 300 s
def test_kill_mid_run_then_resume_gives_the_same_losses(tmp_path):
    ckpt = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "tests.resume_worker", str(ckpt), "6", "8"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]          # it really was killed (SIGKILL)
    assert sp.Checkpointer(str(ckpt)).latest_step() == 6
    position, rest = resume_and_finish(ckpt, 8)
    assert position == (2, 2)                                    # epoch 2, step 2 of 4
    full = uninterrupted()
    np.testing.assert_allclose(rest, full[6:], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_resume_on_a_different_mesh(tmp_path):
    ckpt = tmp_path / "ckpt"
    model = T.make_model(8)
    import shardprop as sp
    model.train(1, T.batches(), callbacks=[sp.ModelCheckpoint(str(ckpt), save_steps=4)])
    position, rest = resume_and_finish(ckpt, 4)                   # 8 devices -> 4 devices
    assert position == (1, 4)
    np.testing.assert_allclose(rest, uninterrupted()[4:], rtol=1e-5, atol=1e-6)


def test_cut_off_write_is_never_taken(tmp_path):
    ckpt = tmp_path / "ckpt"
    model = T.make_model(8)
    c = sp.Checkpointer(str(ckpt))
    c.save(1, model.state(1, 1))
    # a save cut off midway leaves orbax's temporary folder behind
    (ckpt / "2.orbax-checkpoint-tmp-123").mkdir()
    (ckpt / "2.orbax-checkpoint-tmp-123" / "partial").write_text("half")
    assert sp.Checkpointer(str(ckpt)).latest_step() == 1
    x, y = T.batches()[0]
    fresh = T.make_model(8)
    fresh.restore(sp.Checkpointer(str(ckpt)), x, y)
    assert fresh.position == (1, 1)


@pytest.mark.slow
@pytest.mark.parametrize("lowering", ["spmd", "mpmd"])
def test_pipeline_state_saved_restored_and_stepped_equals_one_device(tmp_path, lowering):
    """A pipelined step's state (the SPMD lowering's packed leaves, the MPMD lowering's
    arrays on each rank's devices, Adam's step count) through a save and a restore into
    the layouts it came from, then stepped: as one device's. The restored step count is
    an array committed to the device it was saved from, which the SPMD lowering's program
    once refused beside its packed state (incompatible devices)."""
    import jax

    from tests.test_pipeline_lowering import mlp
    step, params, opt_state, batch = mlp(4, {0, 1, 2})
    pstep = sp.parallelize(step, mesh=((4, 2), ("pp", "dp")),
                           pipeline=sp.Pipeline(microbatches=2, lowering=lowering))
    ref = jax.jit(step)
    *state, _ = pstep(params, opt_state, batch)
    *want, _ = ref(params, opt_state, batch)
    ckpt = sp.Checkpointer(str(tmp_path / "ckpt"))
    ckpt.save(1, tuple(state))
    state = ckpt.restore(tuple(state))
    *state, loss = pstep(*state, batch)
    *want, want_loss = ref(*want, batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(tuple(state)), jax.tree.leaves(tuple(want))):
        np.testing.assert_allclose(sp.to_numpy(a), np.asarray(b), atol=1e-5, rtol=1e-4)
