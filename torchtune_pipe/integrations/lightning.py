"""Lightning integration: :class:`TuningCallback` tunes the train loader while ``Trainer.fit`` runs.

The callback steers a :class:`~torchtune_pipe.Loader` or :class:`~torchtune_pipe.DataLoader`
in any mode (``num_workers`` an int or ``"auto"``); a loader that runs a tuner of its own
hands it over at fit start (:meth:`~torchtune_pipe.Loader.release_tuner`), so the callback's
tuner is the only one. A :class:`~torchtune_pipe.tuning.TuningLoop` runs on its pipeline
with the model's step time as the consumer latency, the pipeline is logged to
``trainer.loggers``, and checkpoints keep the allocation and the tuner's state.

Lightning creates the first epoch's iterator (the worker pools) between ``on_fit_start`` and
``on_train_start``, so the loop starts at the first hook that finds the pipeline running. It
pauses while the train pipeline idles (epoch end, validation) and stops on ``on_fit_end``,
``on_exception`` and ``teardown``; a loop error is raised in training at the next batch.

Mid-epoch resume: Lightning pre-fetches one batch from loaders without a length, so at a
checkpoint the loader has handed over one batch more than the model consumed. The callback
writes the loader's state as of the consumed batches into the checkpoint instead, so a
resumed fit neither repeats nor skips samples.

Example:
    >>> loader = DataLoader(dataset, batch_size=64, num_workers="auto")  # doctest: +SKIP
    >>> trainer = L.Trainer(callbacks=[TuningCallback()])                # doctest: +SKIP
    >>> trainer.fit(model, train_dataloaders=loader)                     # doctest: +SKIP
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from torchtune_pipe.integrations._steering import Session, Steering
from torchtune_pipe.loader.core import Loader
from torchtune_pipe.tuning.base import Allocation, Observation, Tuner
from torchtune_pipe.tuning.registry import make_tuner

log = logging.getLogger(__name__)

_EMA = 0.2  # weight of the newest model step in the step-time average
_SNAPSHOTS = 4  # loader states kept to undo Lightning's pre-fetch


@dataclass(frozen=True)
class AllocationChange:
    """An allocation the tuner applied, as the training loop noticed it.

    Attributes:
        step: ``trainer.global_step`` when it was noticed.
        allocation: workers and buffer bytes per stage.
        stages: stage names, in the allocation's order.
        throughput: items (batches) per second in the tuner's last observation.
    """

    step: int
    allocation: Allocation
    stages: tuple[str, ...]
    throughput: float


def find_loader(obj: Any) -> Loader | None:
    """The :class:`~torchtune_pipe.Loader` behind a train/val loader object (None if none)."""
    if isinstance(obj, Loader):
        return obj
    inner = getattr(obj, "loader", None)  # torchtune_pipe.DataLoader exposes its Loader
    return inner if isinstance(inner, Loader) else None


class TuningCallback(Callback):
    """Tunes the train loader's pipeline during ``Trainer.fit``.

    Args:
        tuner: a tuner name from :data:`~torchtune_pipe.tuning.TUNERS` or a
            :class:`~torchtune_pipe.tuning.Tuner`.
        interval_s: seconds between tuning steps.
        log_every_n_steps: log the pipeline every this many optimizer steps (default: the
            trainer's ``log_every_n_steps``).
        tune_val: also tune the validation loaders while validation runs (needs a tuner name:
            they get their own tuner instance, not saved in checkpoints).
        log_path: file to append the tuner's decisions to (JSON lines).
        on_change: called in the training process with each :class:`AllocationChange`.

    Attributes:
        changes: every :class:`AllocationChange` noticed so far.
        history: the observations the train tuner stepped on (this rank's view).

    Raises:
        ValueError: an argument is invalid.
    """

    def __init__(
        self,
        tuner: str | Tuner = "intune",
        interval_s: float = 1.0,
        log_every_n_steps: int | None = None,
        tune_val: bool = False,
        log_path: str | None = None,
        on_change: Callable[[AllocationChange], None] | None = None,
    ):
        if not interval_s > 0:
            raise ValueError(f"TuningCallback: interval_s must be positive, got {interval_s}")
        if log_every_n_steps is not None and (
            not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise ValueError(
                f"TuningCallback: log_every_n_steps must be a positive int or None, got "
                f"{log_every_n_steps!r}"
            )
        if tune_val and not isinstance(tuner, str):
            raise ValueError("TuningCallback: tune_val=True needs the tuner by name, got an object")
        if not isinstance(tuner, str) and not (hasattr(tuner, "reset") and hasattr(tuner, "step")):
            raise ValueError(f"TuningCallback: tuner must be a name or a Tuner, got {tuner!r}")
        self.tuner_name = tuner if isinstance(tuner, str) else None
        self.tuner: Tuner = make_tuner(tuner) if isinstance(tuner, str) else tuner
        self.interval_s = float(interval_s)
        self.log_every_n_steps = log_every_n_steps
        self.tune_val = tune_val
        self.log_path = log_path
        self.on_change = on_change
        self.changes: list[AllocationChange] = []
        self.history: collections.deque[Observation] = collections.deque(maxlen=100_000)
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._train: Steering | None = None
        self._val: Steering | None = None
        self._train_loader: Loader | None = None
        self._share = 1
        self._step_s = 0.0
        self._t0: float | None = None
        self._seen: Allocation | None = None
        self._logged: Observation | None = None
        self._snapshots: collections.deque = collections.deque(maxlen=_SNAPSHOTS)

    def __getstate__(self) -> dict:
        # Pickled by spawn-based strategies before a fit: loops and locks stay behind.
        state = self.__dict__.copy()
        state.update(_train=None, _val=None, _train_loader=None)
        return state

    # ------------------------------------------------------------------------ public state
    @property
    def allocation(self) -> Allocation | None:
        """The train pipeline's allocation as last decided (None before the first decision)."""
        return self._train.allocation if self._train is not None else None

    @property
    def model_step_s(self) -> float:
        """The model's mean step time per batch, as fed to the tuner."""
        return self._step_s

    # ------------------------------------------------------------------------ lifecycle
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._train = Steering(Session(self.tuner), self.interval_s, self.log_path)
        if self.tune_val:
            name = self.tuner_name or ""  # tune_val=True requires the tuner by name
            self._val = Steering(Session(make_tuner(name)), self.interval_s, None)
        # Ranks on one host split its CPUs and memory between their pipelines.
        self._share = max(1, int(trainer.num_devices)) if trainer.world_size > 1 else 1

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._ensure_train(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._ensure_train(trainer)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._snapshot()

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._ensure_train(trainer)
        self._t0 = _now(pl_module)

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._t0 is not None:
            dt = _now(pl_module) - self._t0
            self._step_s = dt if self._step_s == 0 else _EMA * dt + (1 - _EMA) * self._step_s
            self._t0 = None
        self._snapshot()
        self._notice_change(trainer)
        every = self.log_every_n_steps or max(1, int(getattr(trainer, "log_every_n_steps", 50)))
        if trainer.global_step % every == 0:
            self._log(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pause_train()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pause_train()  # the train pipeline idles while validation runs

    def on_validation_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._val is None or trainer.sanity_checking:
            return
        loaders = trainer.val_dataloaders
        if isinstance(loaders, (list, tuple)):
            loaders = loaders[dataloader_idx] if dataloader_idx < len(loaders) else None
        loader = find_loader(loaders)
        if loader is not None:
            if loader.tuner is not None:
                loader.release_tuner()  # the callback's val tuner steers it instead
            self._val.ensure(loader, self._share, lambda: 0.0, collections.deque(maxlen=1))

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._val is not None:
            self._val.stop(raise_error=True)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop(raise_error=True)

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._stop(raise_error=False)  # the loop's own error, if any, is logged by the loop

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop(raise_error=False)

    # ------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The allocation and the tuner's state (e.g. InTune's agent weights)."""
        state: dict[str, Any] = {}
        session = self._train.session if self._train is not None else None
        lock = session.lock if session is not None else threading.Lock()
        with lock:
            alloc = self.allocation
            if alloc is not None:
                state["allocation"] = {k: list(v) for k, v in dataclasses.asdict(alloc).items()}
            saved = self.tuner.state_dict() if hasattr(self.tuner, "state_dict") else None
            if saved:
                state["tuner"] = saved
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the tuner's state; the allocation is applied when tuning starts."""
        if "tuner" in state_dict and hasattr(self.tuner, "load_state_dict"):
            self.tuner.load_state_dict(state_dict["tuner"])
        alloc = state_dict.get("allocation")
        if alloc is not None:
            restored = Allocation(
                tuple(alloc["workers"]),
                tuple(alloc["buffer_bytes"]),
                tuple(alloc.get("concurrency", ())),
                tuple(alloc.get("fused", ())),
                tuple(alloc.get("remote", ())),
                tuple(alloc.get("threads", ())),
            )
            if self._train is None:
                self._train = Steering(Session(self.tuner), self.interval_s, self.log_path)
            self._train.session.restored = restored

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Replace the loader's state with its state as of the batches the model consumed."""
        loader = self._train_loader
        if loader is None:
            return
        try:
            states = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
        except (KeyError, TypeError):
            return
        current = loader.state_dict()
        consumed = getattr(trainer.fit_loop.epoch_loop.batch_progress.current, "processed", 0)
        if current.get("finished") or current.get("delivered", 0) <= consumed:
            return
        fixed = None
        for snap in self._snapshots:
            if snap.get("epoch") == current.get("epoch") and snap.get("delivered") == consumed:
                fixed = snap
        if fixed is None:
            log.warning(
                "TuningCallback: no loader state for %d consumed batches (epoch %s); the "
                "resumed epoch skips the %d pre-fetched batch(es)",
                consumed, current.get("epoch"), current["delivered"] - consumed,
            )  # fmt: skip
            return
        for i, s in enumerate(states):
            if s == current:
                states[i] = fixed

    # ------------------------------------------------------------------------ internals
    def _ensure_train(self, trainer: Trainer) -> None:
        if self._train is None:
            return
        loader = find_loader(trainer.train_dataloader)
        if loader is None:
            return
        if loader is not self._train_loader:
            self._check_loader(trainer, loader)
            self._train_loader = loader
        self._train.ensure(loader, self._share, lambda: self._step_s, self.history)

    def _check_loader(self, trainer: Trainer, loader: Loader) -> None:
        if loader.tuner is not None:
            # One tuner per pipeline: the callback's, which sees the model's step time and is
            # saved in checkpoints. The loader's own (e.g. the "heuristic" that
            # DataLoader(num_workers="auto") runs) stops and leaves its allocation in place.
            own = loader.release_tuner()
            log.info(
                "TuningCallback: took over the train loader's tuning (%s -> %s)",
                getattr(own, "name", type(own).__name__), self.tuner_name or type(self.tuner).__name__,
            )  # fmt: skip
        source_ws = getattr(loader.pipeline.source, "world_size", None)
        if trainer.world_size > 1 and source_ws not in (None, trainer.world_size):
            log.warning(
                "TuningCallback: %d ranks train but the loader's source is sharded for %s; "
                "build it with rank=trainer.global_rank, world_size=trainer.world_size",
                trainer.world_size, source_ws,
            )  # fmt: skip

    def _pause_train(self) -> None:
        if self._train is not None:
            self._train.stop(raise_error=True)
        self._t0 = None

    def _stop(self, raise_error: bool) -> None:
        for steering in (self._train, self._val):
            if steering is not None:
                steering.stop(raise_error=raise_error)

    def _snapshot(self) -> None:
        if self._train_loader is not None:
            self._snapshots.append(self._train_loader.state_dict())

    def _stage_names(self) -> tuple[str, ...]:
        loader = self._train_loader
        return tuple(s.name for s in loader.pipeline.stages) if loader is not None else ()

    def _notice_change(self, trainer: Trainer) -> None:
        alloc = self.allocation
        if alloc is None or alloc == self._seen:
            return
        self._seen = alloc
        view = self._train.view if self._train is not None else None
        thr = view.last.throughput if view is not None and view.last is not None else 0.0
        change = AllocationChange(trainer.global_step, alloc, self._stage_names(), thr)
        self.changes.append(change)
        log.info(
            "step %d: allocation workers=%s buffers_mib=%s", change.step, list(alloc.workers),
            [round(b / (1 << 20), 1) for b in alloc.buffer_bytes],
        )  # fmt: skip
        if self.on_change is not None:
            self.on_change(change)

    def _log(self, trainer: Trainer) -> None:
        view = self._train.view if self._train is not None else None
        obs = view.last if view is not None else None
        if obs is None or obs is self._logged or not trainer.loggers:
            return
        self._logged = obs
        metrics = pipeline_metrics(obs, self._stage_names(), self._step_s)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


def pipeline_metrics(
    obs: Observation, names: tuple[str, ...] = (), model_step_s: float = 0.0
) -> dict[str, float]:
    """Flat metrics of an observation: throughput, memory, the model's step and the share of
    the training loop's time spent waiting for data (``pipeline/data_wait_share``, 0..1: near
    1 training is stalled on data; left out where not measured), and workers/busy/buffer per
    stage (0 workers for a stage fused into the one before)."""
    metrics = {
        "pipeline/throughput": obs.throughput,
        "pipeline/cpus": obs.cpus,
        "pipeline/memory_used_mib": obs.memory_used_bytes / (1 << 20),
        "pipeline/memory_limit_mib": obs.memory_limit_bytes / (1 << 20),
        "pipeline/model_step_ms": model_step_s * 1e3,
    }
    if obs.data_wait_share is not None:
        metrics["pipeline/data_wait_share"] = obs.data_wait_share
    for i, st in enumerate(obs.stages):
        name = names[i] if i < len(names) else st.name
        metrics[f"pipeline/workers/{name}"] = 0.0 if st.fused else float(st.workers)
        metrics[f"pipeline/busy/{name}"] = st.busy
        metrics[f"pipeline/buffer_mib/{name}"] = st.buffer_bytes / (1 << 20)
    return metrics


def _now(pl_module: LightningModule) -> float:
    # Kernels run asynchronously on CUDA: wait for them so the time is the model's step.
    if pl_module.device.type == "cuda":
        torch.cuda.synchronize(pl_module.device)
    return time.perf_counter()
