"""A training loop in the shape users know (MindSpore's ``Model.train``, Keras'
``fit``), built on ``parallelize``: sugar over a plain loop, not a second engine.

    model = Model(net, loss_fn, optax.sgd(0.2, momentum=0.1), params, mesh=8)
    model.train(5, dataset, callbacks=[LossMonitor()])

``net(params, inputs) -> outputs`` and ``loss_fn(outputs, labels) -> scalar``
are single-device code; the whole step (forward, backward, update) is one
parallel program, with params and optimizer state donated and kept in place.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import jax
import numpy as np
import optax

from ..compiler import parallelize
from .distributed import initialize


def scalar(x) -> float:
    """A replicated scalar as a Python float, on every process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return float(np.asarray(x))


@dataclass
class StepInfo:
    epoch: int            # 1-based, as MindSpore prints it
    step: int             # 1-based within the epoch
    global_step: int
    steps_per_epoch: Optional[int]
    loss: float
    model: "Model"


class Callback:
    def on_train_begin(self, model: "Model") -> None: ...
    def on_step_end(self, info: StepInfo) -> None: ...
    def on_epoch_end(self, info: StepInfo) -> None: ...
    def on_train_end(self, model: "Model") -> None: ...


class LossMonitor(Callback):
    """Prints ``epoch: 3 step: 2, loss is 0.3673...`` like MindSpore's LossMonitor (on process 0)."""

    def __init__(self, per_print_times: int = 1, file=None):
        self.per_print_times, self.file = per_print_times, file
        self.history: list[tuple[int, int, float]] = []

    def on_step_end(self, info: StepInfo) -> None:
        self.history.append((info.epoch, info.step, info.loss))
        if info.global_step % self.per_print_times == 0 and jax.process_index() == 0:
            print(f"epoch: {info.epoch} step: {info.step}, loss is {info.loss}", file=self.file or sys.stdout,
                  flush=True)


class ProgressBar(Callback):
    """A one-line text progress display per epoch."""

    def __init__(self, width: int = 30, file=None):
        self.width, self.file = width, file

    def on_step_end(self, info: StepInfo) -> None:
        if jax.process_index() != 0 or not info.steps_per_epoch:
            return
        done = int(self.width * info.step / info.steps_per_epoch)
        end = "\n" if info.step == info.steps_per_epoch else "\r"
        print(f"epoch {info.epoch} [{'#' * done}{'.' * (self.width - done)}] {info.step}/{info.steps_per_epoch} "
              f"loss {info.loss:.6f}", end=end, file=self.file or sys.stderr, flush=True)


class ModelCheckpoint(Callback):
    """Saves params, optimizer state and the position in training every ``save_steps``."""

    def __init__(self, directory: str, save_steps: int = 1, max_to_keep: Optional[int] = 3):
        from .checkpoint import Checkpointer
        self.checkpointer = Checkpointer(directory, max_to_keep)
        self.save_steps = save_steps

    def on_step_end(self, info: StepInfo) -> None:
        if info.global_step % self.save_steps == 0:
            self.checkpointer.save(info.global_step, info.model.state(info.epoch, info.step))

    def on_train_end(self, model: "Model") -> None:
        self.checkpointer.close()


class Model:
    def __init__(self, net: Callable, loss_fn: Callable, optimizer: optax.GradientTransformation, params: Any, *,
                 mesh, **parallel_options):
        initialize()   # (a multi-process run: join it before optimizer.init makes arrays)
        self.net, self.loss_fn, self.optimizer = net, loss_fn, optimizer
        self.params = params
        self.opt_state = optimizer.init(params)
        self.position = (0, 0)   # (epoch, step) reached, for resuming

        def train_step(params, opt_state, inputs, labels):
            loss, grads = jax.value_and_grad(lambda p: loss_fn(net(p, inputs), labels))(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
        self.train_step = train_step
        if parallel_options.get("mode") == "data_parallel":
            parallel_options.setdefault("batch_argnums", (2, 3))   # inputs and labels
        if mesh is None:   # the same script on one device: shard() marks are plain calls
            self.parallel_step = jax.jit(train_step)
        else:
            self.parallel_step = parallelize(train_step, mesh=mesh, donate_argnums=(0, 1), **parallel_options)

    def state(self, epoch: int = 0, step: int = 0) -> dict:
        return {"params": self.params, "opt_state": self.opt_state,
                "position": np.asarray([epoch, step], np.int64)}

    def restore(self, checkpointer, inputs, labels, step: Optional[int] = None) -> None:
        """Load a checkpoint into the layouts this model's parallel step wants (any mesh);
        ``inputs``/``labels`` are an example batch (their shapes select the compiled step)."""
        shardings = self.parallel_step.input_shardings(self.params, self.opt_state, inputs, labels)
        like = self.state()
        target = {"params": shardings[0], "opt_state": shardings[1], "position": None}
        restored = checkpointer.restore(like, step, jax.tree_util.tree_map(
            lambda x, s: s, like, target, is_leaf=lambda x: x is None))
        self.params, self.opt_state = restored["params"], restored["opt_state"]
        self.position = tuple(int(v) for v in np.asarray(restored["position"]))

    def train(self, epochs: int, dataset, callbacks: Sequence[Callback] = ()) -> list[float]:
        """Run ``epochs`` epochs over ``dataset``: an iterable of ``(inputs, labels)`` batches
        (re-iterated each epoch; a DataLoader's sampler is told the epoch), or a function
        ``epoch -> iterable``. Continues from ``self.position`` after a restore."""
        losses = []
        start_epoch, start_step = self.position
        global_step = 0
        for cb in callbacks:
            cb.on_train_begin(self)
        for epoch in range(1, epochs + 1):
            batches = self._batches(dataset, epoch)
            steps = len(batches) if hasattr(batches, "__len__") else None
            info = None
            for step, (inputs, labels) in enumerate(batches, 1):
                global_step += 1
                if (epoch, step) <= (start_epoch, start_step):
                    continue   # already trained before the checkpoint we resumed from
                self.params, self.opt_state, loss = self.parallel_step(self.params, self.opt_state, inputs, labels)
                self.position = (epoch, step)
                info = StepInfo(epoch, step, global_step, steps, scalar(loss), self)
                losses.append(info.loss)
                for cb in callbacks:
                    cb.on_step_end(info)
            if info is not None:
                for cb in callbacks:
                    cb.on_epoch_end(info)
        for cb in callbacks:
            cb.on_train_end(self)
        return losses

    @staticmethod
    def _batches(dataset, epoch: int) -> Iterable:
        if callable(dataset):
            return dataset(epoch)
        sampler = getattr(dataset, "sampler", None)
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        return dataset
