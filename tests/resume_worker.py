"""A training run that checkpoints every step and can be killed mid-run (SIGKILL
itself after a given step), for the save / kill / resume tests.

    python -m tests.resume_worker CKPT_DIR KILL_AFTER_STEP MESH
"""
import os
import signal
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import shardprop as sp  # noqa: E402
from tests.training_setup import make_model, batches  # noqa: E402


class DieAfter(sp.Callback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, info):
        if info.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    ckpt, kill_after, mesh = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model = make_model(mesh)
    model.train(3, batches(), callbacks=[sp.ModelCheckpoint(ckpt, save_steps=1, max_to_keep=None), DieAfter(kill_after)])
