"""Offline pre-training of the InTune agent in the simulator, and its held-out evaluation.

One agent per pipeline length is trained on random generated workloads
(:func:`~torchtune_pipe.sim.workloads.generate`) with random batch sizes, random CPU counts
(8-128) that change during the episode (rescaling events), and random memory limits, some tight
enough to bind the worker count. The reward is normalised by the simulator's oracle for the
CPU count in force, so episodes on 8 and 128 CPUs weigh the same. Workload seeds are drawn
below :data:`HELDOUT_SEED`; seeds from it upwards are kept for :func:`evaluate_agent`.

Run ``python -m torchtune_pipe.tuning.intune.pretrain --stages 2-8 --episodes 150 --seed 0 --out DIR``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from torchtune_pipe.sim.model import SimPipeline, Workload
from torchtune_pipe.sim.workloads import generate, with_batch_size
from torchtune_pipe.tuning.base import Allocation, MiB, Observation, Tuner
from torchtune_pipe.tuning.intune.agent import ActionSpace, InTuneTuner, StateEncoder, weights_path
from torchtune_pipe.tuning.intune.dqn import DQNAgent, DQNConfig
from torchtune_pipe.tuning.loop import run_episode
from torchtune_pipe.tuning.oracle import best_static
from torchtune_pipe.tuning.planner import MEMORY_SHARE

logger = logging.getLogger(__name__)

HELDOUT_SEED = 10_000
CPU_CHOICES = (8, 12, 16, 24, 32, 48, 64, 96, 128)
BATCH_CHOICES = (256, 512, 1024, 2048, 4096, 8192)
WORKER_RSS = 150 * MiB  # the simulator's default worker memory


@dataclass(frozen=True)
class Episode:
    """One training or evaluation episode: a workload on a machine that may rescale."""

    workload: Workload
    cpus: tuple[tuple[float, float], ...]
    memory_limit_bytes: int
    steps: int
    seed: int


def _memory_for(workload: Workload, cpus: float) -> float:
    """Worst-case memory of an even split of ``cpus`` workers with 64 MiB buffers."""
    resident = sum(s.resident_bytes for s in workload.stages)
    n = len(workload.stages)
    return cpus * workload.worker_rss_bytes + resident + n * 64 * MiB


def sample_episode(
    n_stages: int,
    rng: random.Random,
    steps: int,
    heldout: bool = False,
    cpu_choices: Sequence[int] = CPU_CHOICES,
) -> Episode:
    """A random episode; workload seeds come from the held-out range only when asked."""
    seed = rng.randrange(HELDOUT_SEED, 2 * HELDOUT_SEED) if heldout else rng.randrange(HELDOUT_SEED)
    wl = generate(n_stages, seed)
    if rng.random() < 0.5:
        wl = with_batch_size(wl, rng.choice(BATCH_CHOICES))
    c0 = rng.choice(cpu_choices)
    sched = [(0.0, float(c0))]
    for _ in range(rng.choice((0, 1, 1, 2))):
        t = rng.uniform(0.25, 0.75) * steps
        others = [c for c in cpu_choices if c != sched[-1][1]] or list(cpu_choices)
        sched.append((round(t), float(rng.choice(others))))
        sched.sort()
    peak = max(c for _, c in sched)
    mem = int(_memory_for(wl, peak) * rng.choice((0.7, 1.0, 1.5, 3.0)))
    return Episode(wl, tuple(sched), mem, steps, seed)


def oracle_value(sim: SimPipeline, cpus: float, t: float | None = None) -> float:
    """Best static throughput on ``cpus`` CPUs now, or at time ``t``
    (:func:`~torchtune_pipe.tuning.oracle.best_static` on the simulator's steady state),
    every stage split or every stage that may be fused fused (``SimPipeline.widest_fusion``)."""
    widest = sim.widest_fusion()
    return best_static(
        lambda a: sim.evaluate(a, cpus=cpus, t=t),
        sim.n_stages,
        cpus,
        [s.max_workers for s in sim.workload.stages],
        fusion=((), widest) if any(widest) else ((),),
    )[1]


def _random_start(obs: Observation, rng: random.Random) -> Allocation:
    n, cpus = len(obs.stages), max(len(obs.stages), int(obs.cpus))
    weights = [rng.expovariate(1.0) for _ in range(n)]
    total = sum(weights)
    workers = [max(1, int(cpus * w / total)) for w in weights]
    buffers = [rng.choice((1, 4, 16, 64, 256)) * MiB for _ in range(n)]
    return Allocation(tuple(workers), tuple(buffers))


def simulate(ep: Episode) -> SimPipeline:
    """The episode's simulator, before its first interval."""
    return SimPipeline(ep.workload, list(ep.cpus), ep.memory_limit_bytes, seed=ep.seed)


def train_config(total_steps: int) -> DQNConfig:
    """Hyper-parameters for pre-training: epsilon decays over the first 60 % of steps."""
    return DQNConfig(
        hidden=128,
        lr=5e-4,
        gamma=0.9,
        batch_size=64,
        replay_size=50_000,
        tau=0.01,
        eps_start=1.0,
        eps_end=0.05,
        eps_decay_steps=int(total_steps * 0.6),
        warmup=min(500, max(64, total_steps // 10)),
    )


def pretrain(
    n_stages: int,
    episodes: int,
    seed: int = 0,
    steps: int = 100,
    cpu_choices: Sequence[int] = CPU_CHOICES,
) -> tuple[dict, dict[str, float]]:
    """Train one agent for ``n_stages``-stage pipelines.

    Args:
        n_stages: pipeline length (2..8).
        episodes: training episodes.
        seed: seeds episode sampling, exploration and weight initialisation.
        steps: tuning steps per episode.
        cpu_choices: CPU counts episodes draw from (and rescale between).

    Returns:
        (the tuner's state dict, training stats).
    """
    rng = random.Random(seed * 1000 + n_stages)
    config = train_config(episodes * steps)
    agent = DQNAgent(
        StateEncoder(n_stages).dim, ActionSpace(n_stages).n, config, seed=seed + n_stages
    )
    refs: dict[float, float] = {}
    tuner = InTuneTuner(
        {"n_stages": n_stages, "agent": agent.state_dict()},
        finetune=True,
        epsilon=None,
        config=config,
        reference=lambda obs: refs.get(obs.cpus, 0.0),
        learn_every=1,
        seed=seed + n_stages,
    )
    t0, rewards, ooms = time.perf_counter(), [], 0
    for k in range(episodes):
        ep = sample_episode(n_stages, rng, steps, cpu_choices=cpu_choices)
        probe = SimPipeline(ep.workload, list(ep.cpus), ep.memory_limit_bytes, seed=ep.seed)
        refs.clear()
        refs.update({c: oracle_value(probe, c) for _, c in ep.cpus})
        start = None
        if rng.random() < 0.5:
            start = _random_start(probe.observe(), rng)
        obs = run_episode(simulate(ep), tuner, ep.steps, start=start)
        ooms += obs[-1].oom
        rewards.append(tuner.episode_reward / max(1, len(obs)))
        if (k + 1) % 25 == 0:
            logger.info(
                "pretrain %d stages: episode %d/%d, mean reward %.3f, eps %.2f, %.0fs",
                n_stages, k + 1, episodes, statistics.fmean(rewards[-25:]),
                tuner.agent.epsilon(tuner.steps), time.perf_counter() - t0,
            )  # fmt: skip
    stats = {
        "episodes": episodes,
        "steps": tuner.steps,
        "seconds": time.perf_counter() - t0,
        "ooms": ooms,
        "final_reward": statistics.fmean(rewards[-max(1, episodes // 5) :]),
    }
    return tuner.state_dict(), stats


def _train_one(args: tuple[int, int, int, int, str]) -> tuple[int, dict[str, float]]:
    n, episodes, seed, steps, out = args
    state, stats = pretrain(n, episodes, seed, steps)
    path = weights_path(n, Path(out))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return n, stats


@dataclass(frozen=True)
class AgentReport:
    """What :func:`evaluate_agent` measured on held-out workloads.

    Attributes:
        steady_ratio: per run, intune's final static throughput / the oracle's (fixed CPUs).
        vs: per baseline name, per run, intune's time-averaged throughput over a rescaling
            schedule divided by the baseline's.
        recovery_steps: per rescale event, tuning steps until intune's allocation is within
            10 % of the new oracle (``steps`` when it never gets there).
        recovery_steps_reserve: the same against an oracle that keeps the memory reserve
            every tuner keeps (worst case within ``planner.MEMORY_SHARE`` of the limit): the
            plain oracle may fill the whole limit, which no tuner that must never cause an
            OOM does.
        ooms: OOMs intune caused over all runs.
    """

    steady_ratio: tuple[float, ...]
    vs: dict[str, tuple[float, ...]]
    recovery_steps: tuple[int, ...]
    ooms: int
    recovery_steps_reserve: tuple[int, ...] = ()

    def summary(self) -> dict[str, float]:
        """Medians of the ratios, worst recovery and the OOM count."""
        out = {"steady_vs_oracle_median": statistics.median(self.steady_ratio)}
        out |= {f"vs_{k}_median": statistics.median(v) for k, v in self.vs.items()}
        out |= {f"vs_{k}_geomean": statistics.geometric_mean(v) for k, v in self.vs.items()}
        rec = sorted(self.recovery_steps)
        out |= {
            "recovery_median": statistics.median(rec),
            "recovery_p90": rec[int(0.9 * (len(rec) - 1))],
            "recovery_within_30": sum(k <= 30 for k in rec) / len(rec),
        }
        if self.recovery_steps_reserve:
            res = self.recovery_steps_reserve
            out["recovery_reserve_within_30"] = sum(k <= 30 for k in res) / len(res)
        out["ooms"] = self.ooms
        return out


def _time_average(tuner: Tuner, ep: Episode) -> tuple[float, list[Observation], list]:
    """Mean throughput of an episode, its observations and, per observation, the allocation
    it was measured under."""
    sim = simulate(ep)
    allocs: list[Allocation] = []
    obs = run_episode(sim, tuner, ep.steps, on_step=lambda o: allocs.append(sim.allocation))
    return statistics.fmean(o.throughput for o in obs), obs, allocs


def evaluate_agent(
    make_intune: Callable[[], Tuner] = InTuneTuner,
    stages: Sequence[int] = range(2, 9),
    runs: int = 4,
    steps: int = 100,
    baselines: Sequence[str] = ("autotune", "plumber-adaptive", "heuristic"),
) -> AgentReport:
    """Compare intune with the oracle and with baselines on held-out generated workloads.

    Each run draws a workload from seeds >= :data:`HELDOUT_SEED` (never used in
    pre-training). Steady state: ``steps`` steps on a fixed CPU count, then the noiseless
    throughput of intune's allocation over the oracle's. Rescaling: a schedule that changes
    the CPU count twice (every ``steps`` steps); throughput is averaged over time for intune
    and each baseline, and intune's recovery after each change is counted in steps.
    """
    from torchtune_pipe.tuning.registry import make_tuner

    steady, recovery, reserve, ooms = [], [], [], 0
    vs: dict[str, list[float]] = {b: [] for b in baselines}
    for n in stages:
        rng = random.Random(HELDOUT_SEED + n)
        for r in range(runs):
            seed = HELDOUT_SEED + 100 * n + r
            wl = generate(n, seed)
            cpus = CPU_CHOICES[2 + (r * 3 + n) % (len(CPU_CHOICES) - 2)]
            mem = int(_memory_for(wl, 128) * 1.5)
            ep = Episode(wl, ((0.0, float(cpus)),), mem, steps, seed)
            _, obs, allocs = _time_average(make_intune(), ep)
            ooms += obs[-1].oom
            probe = SimPipeline(wl, cpus, mem, seed=seed)
            # Costs drift: the last allocation and the oracle are judged at the same time.
            at = obs[-1].t
            best = oracle_value(probe, cpus, at)
            steady.append(probe.evaluate(allocs[-1], t=at) / max(best, 1e-12))
            c = [rng.choice(CPU_CHOICES[1:]) for _ in range(3)]
            while c[1] == c[0] or c[2] == c[1]:
                c = [rng.choice(CPU_CHOICES[1:]) for _ in range(3)]
            sched = tuple((float(i * steps), float(x)) for i, x in enumerate(c))
            ep = Episode(wl, sched, int(_memory_for(wl, max(c)) * 1.5), 3 * steps, seed)
            mine, obs, allocs = _time_average(make_intune(), ep)
            ooms += obs[-1].oom
            for b in baselines:
                theirs, _, _ = _time_average(make_tuner(b), ep)
                vs[b].append(mine / max(theirs, 1e-12))
            # Judged under the episode's own memory limit: the oracle of a roomier machine
            # may hold more workers than this episode can afford.
            rescaled = SimPipeline(wl, list(ep.cpus), ep.memory_limit_bytes, seed=seed)
            kept = int(ep.memory_limit_bytes * MEMORY_SHARE)
            within = SimPipeline(wl, list(ep.cpus), kept, seed=seed)
            for t, x in sched[1:]:
                for oracle_sim, out in ((rescaled, recovery), (within, reserve)):
                    # The allocation of step k ran until obs[k] and is judged, like the
                    # new optimum, with the costs of that time. An OOM ends the episode early:
                    # steps never reached count as not back.
                    ahead = range(int(t), min(len(allocs), int(t) + steps))
                    back = (
                        j
                        for j, k in enumerate(ahead)
                        if rescaled.evaluate(allocs[k], cpus=x, t=obs[k].t)
                        >= 0.9 * oracle_value(oracle_sim, x, obs[k].t)
                    )
                    out.append(next(back, steps))
    return AgentReport(
        tuple(steady), {k: tuple(v) for k, v in vs.items()}, tuple(recovery), ooms, tuple(reserve)
    )


def _parse_stages(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    if not out or min(out) < 2 or max(out) > 8:
        raise argparse.ArgumentTypeError(f"--stages must lie in 2..8, got {text!r}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Pre-train one agent per pipeline length and write ``intune_{n}stages.pt`` files.

    Example:
        >>> main(["--stages", "2-8", "--episodes", "300", "--seed", "0", "--out", "weights"])
    """
    parser = argparse.ArgumentParser(prog="torchtune-pipe pretrain", description=__doc__)
    parser.add_argument("--stages", type=_parse_stages, default=_parse_stages("2-8"))
    parser.add_argument(
        "--episodes", type=int, default=300, help="episodes for 2 stages (+25%% per stage more)"
    )
    parser.add_argument("--steps", type=int, default=100, help="tuning steps per episode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--jobs", type=int, default=2, help="lengths trained in parallel")
    parser.add_argument("--evaluate", action="store_true", help="report held-out numbers")
    parser.add_argument(
        "--no-train",
        action="store_true",
        help="skip training: evaluate the weight files already in --out (implies --evaluate)",
    )
    args = parser.parse_args(argv)
    if args.episodes < 1 or args.steps < 1:
        parser.error("--episodes and --steps must be >= 1")
    missing = [str(weights_path(n, args.out)) for n in args.stages]
    missing = [p for p in missing if not Path(p).is_file()]
    if args.no_train and missing:
        parser.error(f"--no-train: no weight files at {', '.join(missing)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    # Longer pipelines have more actions and further to go: they get more episodes.
    jobs = [
        (n, args.episodes + args.episodes * (n - 2) // 4, args.seed, args.steps, str(args.out))
        for n in sorted(args.stages, reverse=True)
    ]
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=max(1, args.jobs), initializer=_init_worker
    ) as pool:
        run = pool.map if args.jobs > 1 else map  # one job: stay in this process
        if not args.no_train:
            for n, stats in run(_train_one, jobs):  # longest first: better packing
                print(f"{n} stages: {stats}")
        if args.evaluate or args.no_train:
            parts = list(run(_evaluate_one, [(n, str(args.out)) for n in args.stages]))
            for n, part in zip(args.stages, parts, strict=True):
                print(f"{n} stages held-out: {_fmt(part.summary())}")
            report = AgentReport(
                tuple(x for p in parts for x in p.steady_ratio),
                {k: tuple(x for p in parts for x in p.vs[k]) for k in parts[0].vs},
                tuple(x for p in parts for x in p.recovery_steps),
                sum(p.ooms for p in parts),
                tuple(x for p in parts for x in p.recovery_steps_reserve),
            )
            print(f"all held-out: {_fmt(report.summary())}")
    return 0


def _init_worker() -> None:
    torch.set_num_threads(1)  # one process per core; small nets gain nothing from threads
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")


def _fmt(summary: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.3f}" for k, v in summary.items())


def _evaluate_one(args: tuple[int, str]) -> AgentReport:
    n, out = args
    return evaluate_agent(lambda: InTuneTuner(out), stages=[n])


if __name__ == "__main__":
    raise SystemExit(main())
