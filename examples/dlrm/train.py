"""Train TorchRec's DLRM on Criteo click logs with a self-tuning input pipeline (Lightning).

By default the data are generated (:mod:`examples.dlrm.generate`, cached in ``--cache-dir``):
a training set and a held-out set drawn from the same synthetic click model. ``--data`` trains
on real Criteo files instead (``--val-data`` names the held-out files; by default the last
file of ``--data`` is held out). A :class:`~torchtune_pipe.integrations.lightning.TuningCallback`
runs ``--tuner`` while training. The pipeline first keeps the tuner's starting allocation (the
heuristic even split of the CPUs) for ``--warmup-s`` plus ``--baseline-s`` seconds of data
flow and measures its throughput over the last ``--baseline-s`` of them, so each run measures
its own baseline; the script ends by printing what the tuner reached against it.

Usage::

    python -m examples.dlrm.train --tuner intune --time-budget-s 90
    python -m examples.dlrm.train --data 'criteo/day_*.gz' --val-data criteo/day_23.gz --epochs 1
    python -m examples.dlrm.train --ray --tuner heuristic   # feature stages on Ray actors
    python -m examples.dlrm.train --ray auto                # the tuner splits them
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import logging
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from examples.dlrm import generate as gen
from examples.dlrm.criteo import default_table_sizes
from examples.dlrm.model import DLRMConfig, DLRMModule
from examples.dlrm.pipeline import DLRMPipelineConfig, build_loader
from torchtune_pipe.tuning.base import Allocation, Observation
from torchtune_pipe.tuning.registry import TUNERS, make_tuner

MiB = 1 << 20
DEMO_ARGS = ("--tuner", "intune", "--time-budget-s", "90", "--val-batches", "100")
"""Arguments of a demo run: about two minutes on 2 CPU cores (plus data generation once)."""


@dataclass(frozen=True)
class TrainResult:
    """What a run reached.

    Attributes:
        auroc: AUROC on the held-out split.
        samples: training samples seen.
        train_s: wall seconds of training (from the first to the last batch).
        samples_per_s: ``samples / train_s``.
        baseline_samples_per_s: pipeline throughput under the starting allocation.
        tuned_samples_per_s: pipeline throughput over the last ``baseline_s`` seconds.
        stages: stage names.
        allocation: the final allocation (None when no tuning step ran).
        changes: allocation changes applied.
        log_dir: where the logger wrote.
    """

    auroc: float
    samples: int
    train_s: float
    samples_per_s: float
    baseline_samples_per_s: float
    tuned_samples_per_s: float
    stages: tuple[str, ...]
    allocation: Allocation | None
    changes: int
    log_dir: str


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description="Train DLRM on Criteo with a tuned input pipeline.")
    p.add_argument("--data", help="Criteo files or glob (default: generated data)")
    p.add_argument("--val-data", help="held-out Criteo files (default: last file of --data)")
    p.add_argument("--cache-dir", default=None, help="where generated data are kept")
    p.add_argument("--rows", type=int, default=1_000_000, help="generated training rows")
    p.add_argument("--val-rows", type=int, default=100_000, help="generated held-out rows")
    p.add_argument("--tuner", default="intune", choices=TUNERS)
    p.add_argument("--interval-s", type=float, default=1.0, help="seconds between tuning steps")
    p.add_argument("--baseline-s", type=float, default=10.0,
                   help="seconds the starting allocation is held and measured (0: none)")  # fmt: skip
    p.add_argument("--warmup-s", type=float, default=5.0,
                   help="seconds of data flow before the baseline is measured")  # fmt: skip
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--time-budget-s", type=float, default=None, help="stop training after this")
    p.add_argument("--val-batches", type=int, default=None, help="cap held-out batches")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--chunk-rows", type=int, default=128)
    p.add_argument("--table-cap", type=int, default=100_000, help="max rows per table")
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--noise-std", type=float, default=0.0, help="dense noise augmentation")
    p.add_argument("--extra-cost-ns", type=int, default=20_000,
                   help="CPU ns per row of the extra-cost UDF (0: no such stage)")  # fmt: skip
    p.add_argument("--logger", choices=("csv", "tensorboard", "none"), default="csv")
    p.add_argument("--log-dir", default="out/dlrm")
    p.add_argument("--log-every-n-steps", type=int, default=20)
    p.add_argument("--print-every-s", type=float, default=5.0)
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ray",
        nargs="?",
        const="ray",
        choices=("ray", "auto"),
        help="run the feature stages on Ray actors: on the cluster RAY_ADDRESS names, "
        "else on a local one started here (pip install torchtune-pipe[ray]); '--ray auto': "
        "start them local and let the tuner move workers onto the cluster and back",
    )
    args = p.parse_args(argv)
    for name in ("rows", "val_rows", "batch_size", "chunk_rows", "epochs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def _cache_dir(args: argparse.Namespace) -> Path:
    if args.cache_dir:
        return Path(args.cache_dir)
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "torchtune_pipe" / "criteo_generated"


def _generate_once(path: Path, rows: int, seed: int) -> Path:
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    t0 = time.perf_counter()
    gen.generate(tmp, rows, seed=seed)
    tmp.replace(path)  # atomic: a concurrent run never reads half a file
    print(f"generated {rows:,} rows in {path} ({time.perf_counter() - t0:.1f} s)")
    return path


def prepare_data(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Training and held-out files: real ones from ``--data``, or generated and cached."""
    if args.data:
        import glob

        files = sorted(glob.glob(args.data)) or [args.data]
        if args.val_data:
            return files, sorted(glob.glob(args.val_data)) or [args.val_data]
        if len(files) < 2:
            raise SystemExit(
                f"--data matches one file ({files[0]}); pass --val-data for the held-out split"
            )
        return files[:-1], files[-1:]
    cache = _cache_dir(args)
    train = _generate_once(cache / f"train_{args.rows}_s{args.seed}.txt", args.rows, args.seed)
    val_seed = args.seed + 1000  # a different draw of the same synthetic world
    val = _generate_once(cache / f"val_{args.val_rows}_s{val_seed}.txt", args.val_rows, val_seed)
    return [str(train)], [str(val)]


class HoldStart:
    """Wraps a tuner: keeps its starting allocation for ``warmup_s + hold_s`` seconds of data
    flow (counted from the first observation with throughput), then lets it tune. The
    throughput seen in the last ``hold_s`` seconds of the hold is the run's baseline; the
    warm-up (worker start, first model steps) is left out of it."""

    def __init__(self, tuner: Any, hold_s: float, warmup_s: float = 0.0):
        self.tuner = tuner
        self.name = str(getattr(tuner, "name", type(tuner).__name__))
        self.hold_s = hold_s
        self.warmup_s = warmup_s
        self.held: list[float] = []
        self._first_t: float | None = None
        self._start: Allocation | None = None

    def reset(self, obs: Observation, **kw: Any) -> Allocation:
        self._start = self.tuner.reset(obs, **kw)
        return self._start

    def step(self, obs: Observation) -> Allocation:
        if self._first_t is None:
            if obs.throughput > 0:
                self._first_t = obs.t  # this interval still holds worker start-up
            return self._start
        flowing = obs.t - self._first_t
        if flowing <= self.warmup_s + self.hold_s:
            if flowing > self.warmup_s:
                self.held.append(obs.throughput)
            return self._start
        return self.tuner.step(obs)

    def state_dict(self) -> dict:
        sd = getattr(self.tuner, "state_dict", None)
        return sd() if callable(sd) else {}

    def load_state_dict(self, state: dict) -> None:
        if hasattr(self.tuner, "load_state_dict"):
            self.tuner.load_state_dict(state)


def _logger(args: argparse.Namespace) -> Any:
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    if args.logger == "none":
        return False
    if args.logger == "tensorboard":
        if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
            return TensorBoardLogger(args.log_dir, name="dlrm")
        print("tensorboard is not installed; logging to CSV instead")
    return CSVLogger(args.log_dir, name="dlrm")


def _console_callback(args: argparse.Namespace, module: DLRMModule, tuning: Any) -> Any:
    import lightning.pytorch as pl

    class Console(pl.Callback):
        """Prints training throughput every ``--print-every-s`` seconds."""

        def __init__(self) -> None:
            self.t0 = self.t_last = 0.0
            self.t_end = 0.0
            self.samples_last = 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            now = time.perf_counter()
            self.t_end = now
            if not self.t0:
                self.t0 = self.t_last = now
                self.samples_last = module.samples
                return
            if now - self.t_last < args.print_every_s:
                return
            rate = (module.samples - self.samples_last) / (now - self.t_last)
            self.t_last, self.samples_last = now, module.samples
            alloc = tuning.allocation
            workers = list(alloc.workers) if alloc is not None else "-"
            print(
                f"[{now - self.t0:6.1f} s] step {trainer.global_step:6d}  {rate:9,.0f} samples/s"
                f"  model {tuning.model_step_s * 1e3:6.1f} ms/batch  workers {workers}",
                flush=True,
            )

    return Console()


def train(args: argparse.Namespace) -> TrainResult:
    """Runs one training job and its held-out evaluation."""
    import lightning.pytorch as pl

    from torchtune_pipe.integrations.lightning import AllocationChange, TuningCallback

    pl.seed_everything(args.seed, verbose=False)
    train_files, val_files = prepare_data(args)
    tables = default_table_sizes(args.table_cap)
    pipe_config = DLRMPipelineConfig(
        batch_size=args.batch_size, chunk_rows=args.chunk_rows, table_sizes=tables,
        noise_std=args.noise_std, extra_cost_ns_per_row=args.extra_cost_ns, seed=args.seed,
        **_placement(args),
    )  # fmt: skip
    dim = args.embedding_dim
    model_config = DLRMConfig(
        table_sizes=tables, embedding_dim=dim, dense_arch=(64, dim), over_arch=(64, 32, 1),
        lr=args.lr,
    )  # fmt: skip
    module = DLRMModule(model_config)
    tuner = HoldStart(make_tuner(args.tuner), args.baseline_s, args.warmup_s)
    stage_names: list[str] = []

    def on_change(change: AllocationChange) -> None:
        stage_names[:] = change.stages
        parts = describe_allocation(change.stages, change.allocation)
        print(f"  allocation @ step {change.step}: {' '.join(parts)}", flush=True)

    tuning = TuningCallback(tuner, interval_s=args.interval_s, on_change=on_change)
    console = _console_callback(args, module, tuning)
    budget = datetime.timedelta(seconds=args.time_budget_s) if args.time_budget_s else None
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=1, max_epochs=args.epochs,
        max_steps=args.max_steps, max_time=budget, callbacks=[tuning, console],
        logger=_logger(args), limit_val_batches=0, num_sanity_val_steps=0,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        log_every_n_steps=args.log_every_n_steps, default_root_dir=args.log_dir,
    )  # fmt: skip
    print(
        f"DLRM: {len(train_files)} training file(s), tuner {args.tuner}, batch "
        f"{args.batch_size}, {trainer.num_devices} {trainer.accelerator.__class__.__name__}"
        f" device(s), {torch.get_num_threads()} torch threads",
        flush=True,
    )
    loader = build_loader(
        train_files, pipe_config, rank=trainer.global_rank, world_size=trainer.world_size
    )
    _check_weights(args.tuner, len(loader.pipeline.stages))
    with loader:
        trainer.fit(module, train_dataloaders=loader)
    train_s = max(1e-9, console.t_end - console.t0)
    val_config = DLRMPipelineConfig(**{**pipe_config.__dict__, "noise_std": 0.0,
                                       "extra_cost_ns_per_row": 0})  # fmt: skip
    with build_loader(val_files, val_config, tuner="heuristic", shuffle=False) as val_loader:
        evaluator = pl.Trainer(
            accelerator=args.accelerator, devices=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=args.val_batches or 1.0,
        )  # fmt: skip
        metrics = evaluator.validate(module, dataloaders=val_loader, verbose=False)
    auroc = float(metrics[0]["val/auroc"]) if metrics else float("nan")
    names = tuple(stage_names) or tuple(s.name for s in loader.pipeline.stages)
    window = max(args.baseline_s, 3 * args.interval_s)
    last_t = tuning.history[-1].t if tuning.history else 0.0
    tail = [o.throughput for o in tuning.history if o.t >= last_t - window]
    result = TrainResult(
        auroc=auroc,
        samples=module.samples,
        train_s=train_s,
        samples_per_s=module.samples / train_s,
        baseline_samples_per_s=_mean(tuner.held) * args.batch_size,
        tuned_samples_per_s=_mean(tail) * args.batch_size,
        stages=names,
        allocation=tuning.allocation,
        changes=len(tuning.changes),
        log_dir=str(getattr(trainer.logger, "log_dir", None) or args.log_dir),
    )
    _report(result, args)
    return result


def _placement(args: argparse.Namespace) -> dict[str, Any]:
    """The feature stages' placement: with ``--ray``, connect to (or start) a Ray cluster and
    share its CPUs among the feature stages as their bound on actors (one CPU each: an actor
    the cluster has no room for would wait, and its stage fail after a timeout)."""
    if not args.ray:
        return {}
    import ray

    if not ray.is_initialized():
        ray.init(logging_level="WARNING")  # RAY_ADDRESS, a running local cluster, or a new one
    cpus = int(ray.cluster_resources().get("CPU", 1))
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    print(f"Ray: feature stages on {nodes} node(s), {cpus} CPU(s)", flush=True)
    remote_stages = 1 + (args.noise_std > 0) + (args.extra_cost_ns > 0)
    return {"placement": args.ray, "ray_max_workers": max(1, cpus // remote_stages)}


def _check_weights(tuner: str, n_stages: int) -> None:
    """Fail before training when InTune has no pre-trained weights for this pipeline length."""
    if tuner != "intune":
        return
    from torchtune_pipe.tuning.intune.agent import weights_path

    path = weights_path(n_stages)
    if not path.is_file():
        raise SystemExit(
            f"no InTune weights for {n_stages} stages at {path}; pre-train them "
            f"(`python -m torchtune_pipe.tuning.intune.pretrain --stages {n_stages} --out DIR`) or pick another --tuner"
        )


def _mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


def describe_allocation(stages: Sequence[str], a: Allocation) -> list[str]:
    """Per stage, ``name=<workers>w/<buffer>MiB``, with ``+<k>ray`` for the workers of it on
    the Ray cluster, ``(x<c>)`` for calls in flight per worker above 1, and ``fused`` for a stage
    run in the previous stage's workers."""
    out = []
    for i, (name, w, b) in enumerate(zip(stages, a.workers, a.buffer_bytes, strict=False)):
        remote = min(a.remote[i], w) if i < len(a.remote) else 0  # more: all of them
        if i < len(a.fused) and a.fused[i]:
            out.append(f"{name}=fused")
            continue
        part = f"{name}={w - remote}w"
        if remote:
            part += f"+{remote}ray"
        if i < len(a.concurrency) and a.concurrency[i] > 1:
            part += f"(x{a.concurrency[i]})"
        out.append(f"{part}/{b / MiB:.0f}MiB")
    return out


def _report(r: TrainResult, args: argparse.Namespace) -> None:
    print("-" * 72)
    print(f"held-out AUROC       {r.auroc:.4f}")
    print(f"samples trained      {r.samples:,} in {r.train_s:.1f} s = {r.samples_per_s:,.0f}/s")
    if r.allocation is not None:
        print(f"final allocation     {' '.join(describe_allocation(r.stages, r.allocation))}")
    if r.baseline_samples_per_s > 0:
        gain = r.tuned_samples_per_s / r.baseline_samples_per_s
        print(
            f"pipeline throughput  {r.baseline_samples_per_s:,.0f} samples/s at the heuristic "
            f"start -> {r.tuned_samples_per_s:,.0f} with {args.tuner} ({gain:.2f}x, "
            f"{r.changes} allocation changes)"
        )
    else:
        print("pipeline throughput  the run ended before the baseline window was measured")
    print(f"logs                 {r.log_dir}")


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; see the module docstring."""
    args = parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    train(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
