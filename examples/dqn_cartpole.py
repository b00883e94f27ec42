"""n-step Double DQN on CartPole-v1: asyncio collectors fill an episode buffer, a learner samples.

One file, top to bottom (CleanRL style). Several collector tasks, each with its own gymnasium
env, write their episodes step by step into one ``EpisodeReplayBuffer``
(``start_episode`` / ``append_observation_action_reward`` / ``end_episode``, with
``terminated`` and ``truncated`` kept apart); a learner task waits for ``learning_starts`` steps
with ``wait_for_steps`` and then trains on ``sample_n_step(batch, n=3, gamma)``, whose
``reward`` is the discounted n-step return and whose ``next_discount`` is γ^m (0 after a
termination) for the bootstrap from ``next_observation``. Windows never cross an episode.

The tasks take turns in a fixed order (env step s belongs to collector s % num_collectors, and
the learner takes one gradient step per ``train_frequency`` env steps), so nothing depends on
timing and a seed gives one run. Every ``eval_every`` env steps the greedy policy plays
``eval_episodes`` episodes; the run stops once their mean reaches ``target_return`` in
``solved_evals`` evaluations in a row (two by default: an early greedy policy sometimes balances
the pole for 500 steps by luck and loses it again). It prints the learning curve and writes a
plot of return vs env steps (``dqn_cartpole.png``).

With the defaults (seed 1) it is solved after 26,000 env steps and 24,997 gradient steps, greedy
return 500.0 ± 0.0 over 20 episodes: 66 s on a 2-core CPU VM at load average 1.7 (182 s at 7).
Seeds 2, 3 and 4 solve it after 38,000, 38,000 and 34,000 env steps. With ``--prioritized``
(PER, alpha 0.6, beta annealed from 0.4 to 1: each window's loss scaled by its importance
weight, its |TD error| sent back through ``update_priorities``) seed 1 is solved after 28,000
env steps: 90 s at load average 1.0 (TorchRL's segment trees, torch 2.14.1).

    python examples/dqn_cartpole.py                  # full run (stops once solved)
    python examples/dqn_cartpole.py --prioritized    # prioritized replay (PER)
    python examples/dqn_cartpole.py --help           # every knob
    python examples/dqn_cartpole.py --total-steps 300 --learning-starts 100 --eval-episodes 2 \
        --eval-every 100 --out-dir /tmp/smoke        # smoke test
"""

import argparse
import asyncio
import copy
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from replaybuf import EpisodeReplayBuffer


def knob(default, doc: str):
    """A dataclass field with its command-line help."""
    return field(default=default, metadata={"help": doc})


@dataclass
class Args:
    seed: int = knob(1, "seeds torch, the buffer's sampler, every env and every epsilon draw")
    env_id: str = knob("CartPole-v1", "gymnasium env (discrete actions, vector observations)")
    num_collectors: int = knob(4, "asyncio collector tasks, each with its own env")
    total_steps: int = knob(60_000, "env steps at most (all collectors together)")
    learning_starts: int = knob(1_000, "valid steps stored before the first gradient step")
    train_frequency: int = knob(1, "env steps per gradient step (a fixed ratio)")
    buffer_size: int = knob(100_000, "max_steps of the EpisodeReplayBuffer")
    batch_size: int = knob(128, "n-step transitions per gradient step")
    n_step: int = knob(3, "n of the n-step return (windows stop at episode ends)")
    gamma: float = knob(0.99, "discount")
    learning_rate: float = knob(5e-4, "Adam learning rate")
    hidden: int = knob(128, "units in each of the Q-network's two hidden layers")
    target_update: int = knob(500, "gradient steps between hard target-network updates")
    double_dqn: bool = knob(True, "pick the next action with the online net (Double DQN)")
    max_grad_norm: float = knob(10.0, "gradient clipping norm")
    prioritized: bool = knob(False, "prioritized replay: draw windows by |TD error|^alpha")
    alpha: float = knob(0.6, "PER's priority exponent (with --prioritized)")
    beta_start: float = knob(0.4, "PER's importance-weight exponent, annealed linearly ...")
    beta_end: float = knob(1.0, "... to this at total_steps (with --prioritized)")
    start_e: float = knob(1.0, "epsilon at the start")
    end_e: float = knob(0.05, "epsilon at the end of the schedule")
    exploration_steps: int = knob(10_000, "env steps to anneal epsilon over")
    eval_every: int = knob(2_000, "env steps between evaluations (and printed curve lines)")
    eval_episodes: int = knob(20, "greedy episodes per evaluation")
    target_return: float = knob(475.0, "solved: the evaluation mean reaches this ...")
    solved_evals: int = knob(2, "... in this many evaluations in a row; then the run stops")
    out_dir: str = knob("", "folder for the PNG plot ('' = next to this file)")
    threads: int = knob(1, "torch CPU threads (1 is fastest for these small nets)")


def parse_args(argv: list[str] | None = None) -> Args:
    """Every field of Args becomes a --flag (bools get --flag / --no-flag)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in dataclasses.fields(Args):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=f.default,
                help=f.metadata["help"],
            )
        else:
            parser.add_argument(flag, type=f.type, default=f.default, help=f.metadata["help"])
    args = Args(**vars(parser.parse_args(argv)))
    for name in ("beta_start", "beta_end"):  # refused here, not at the first gradient step
        if not 0 <= getattr(args, name) <= 1:
            parser.error(f"--{name.replace('_', '-')} must lie in [0, 1]")
    return args


def q_network(obs_dim: int, n_actions: int, hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(obs_dim, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, n_actions),
    )


def beta(args: Args, step: int) -> float:
    """PER's importance-weight exponent: linear from beta_start to beta_end over total_steps."""
    return args.beta_start + (args.beta_end - args.beta_start) * min(1.0, step / args.total_steps)


def epsilon(args: Args, step: int) -> float:
    """Linear from start_e to end_e over exploration_steps, then flat."""
    span = max(1, args.exploration_steps)
    return args.end_e + (args.start_e - args.end_e) * max(0.0, 1.0 - step / span)


class Pace:
    """Who moves next, decided by counts only (never by timing), so a seed gives one run.

    One env step at a time, round-robin: step s belongs to collector ``s % collectors``. Once
    the learner has started, collectors may take step s only while ``s < base + updates *
    train_frequency``; the learner takes its next gradient step when no env step is in flight
    and that allowance is used up. So each gradient step sees the same data in every run.
    """

    def __init__(self, collectors: int, train_frequency: int, total_steps: int) -> None:
        self.collectors = collectors
        self.train_frequency = train_frequency
        self.total_steps = total_steps
        self.cond = asyncio.Condition()
        self.step = 0  # env steps completed
        self.updates = 0  # gradient steps completed
        self.busy = False  # an env step is in flight
        self.base: int | None = None  # env steps when learning started
        self.stopped = False

    def done(self) -> bool:
        return self.stopped or self.step >= self.total_steps

    def _allowance(self) -> float:
        return (
            float("inf") if self.base is None else self.base + self.updates * self.train_frequency
        )

    async def begin_env_step(self, collector: int) -> int | None:
        """Wait for this collector's turn; the global step index, or None when training ends."""
        async with self.cond:
            await self.cond.wait_for(
                lambda: (
                    self.done()
                    or (
                        not self.busy
                        and self.step % self.collectors == collector
                        and self.step < self._allowance()
                    )
                )
            )
            if self.done():
                return None
            self.busy = True
            return self.step

    async def end_env_step(self) -> None:
        async with self.cond:
            self.busy, self.step = False, self.step + 1
            self.cond.notify_all()

    async def begin_update(self) -> bool:
        """Wait until a gradient step is owed and no env step is in flight; False at the end."""
        async with self.cond:
            if self.base is None:
                self.base = self.step + int(self.busy)
            await self.cond.wait_for(
                lambda: self.done() or (not self.busy and self.step >= self._allowance())
            )
            return not self.done()

    async def end_update(self) -> None:
        async with self.cond:
            self.updates += 1
            self.cond.notify_all()

    async def stop(self) -> None:
        async with self.cond:
            self.stopped = True
            self.cond.notify_all()


async def collector(
    index: int,
    args: Args,
    buf: EpisodeReplayBuffer,
    pace: Pace,
    q: nn.Module,
    episodes: list[tuple[int, float]],
) -> None:
    """Play one env: epsilon-greedy on the current Q-network, every step into the buffer."""
    env = gym.make(args.env_id)
    rng = np.random.default_rng(args.seed * 1_000 + index)  # this collector's epsilon draws
    obs, _ = env.reset(seed=args.seed * 1_000 + index)
    episode = await buf.start_episode(agent_id=f"collector-{index}")
    episode_return = 0.0
    while (step := await pace.begin_env_step(index)) is not None:
        if rng.random() < epsilon(args, step):
            action = int(rng.integers(env.action_space.n))
        else:
            with torch.no_grad():
                action = int(q(torch.from_numpy(obs)).argmax())
        next_obs, reward, terminated, truncated, _ = env.step(action)
        await buf.append_observation_action_reward(
            episode, torch.from_numpy(obs), action=action, reward=float(reward)
        )
        episode_return += float(reward)
        if terminated or truncated:
            status = "terminated" if terminated else "truncated"  # a time limit bootstraps
            await buf.end_episode(episode, status, final_observation=torch.from_numpy(next_obs))
            episodes.append((step + 1, episode_return))
            next_obs, _ = env.reset()
            episode = await buf.start_episode(agent_id=f"collector-{index}")
            episode_return = 0.0
        obs = next_obs
        await pace.end_env_step()
    env.close()  # the episode in progress stays in the buffer; closing the buffer drops it


def evaluate(args: Args, q: nn.Module, episodes: int, seed: int) -> np.ndarray:
    """Returns of ``episodes`` greedy episodes, played side by side (one batched forward)."""
    envs = [gym.make(args.env_id) for _ in range(episodes)]
    obs = [env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]
    returns = np.zeros(episodes)
    running = list(range(episodes))
    while running:
        with torch.no_grad():
            actions = q(torch.from_numpy(np.stack([obs[i] for i in running]))).argmax(1).tolist()
        still = []
        for i, action in zip(running, actions, strict=True):
            obs[i], reward, terminated, truncated, _ = envs[i].step(action)
            returns[i] += reward
            if not (terminated or truncated):
                still.append(i)
        running = still
    for env in envs:
        env.close()
    return returns


async def learner(
    args: Args,
    buf: EpisodeReplayBuffer,
    pace: Pace,
    q: nn.Module,
    episodes: list[tuple[int, float]],
) -> list[dict]:
    """Sample n-step batches and take (Double) DQN steps; evaluate, print the curve, stop."""
    target = copy.deepcopy(q)
    optimizer = torch.optim.Adam(q.parameters(), lr=args.learning_rate)
    curve: list[dict] = []
    start = time.perf_counter()
    next_eval = args.eval_every
    loss = float("nan")
    in_a_row = 0  # consecutive evaluations at or above target_return

    def evaluation_point(updates: int) -> dict:
        """Evaluate the greedy policy, print one line of the curve and keep it."""
        returns = evaluate(args, q, args.eval_episodes, seed=10_000 + args.seed * 1_000)
        recent = [r for _, r in episodes[-20:]]
        point = {
            "step": pace.step,
            "updates": updates,
            "episodes": len(episodes),
            "recent": float(np.mean(recent)) if recent else float("nan"),
            "eval_mean": float(returns.mean()),
            "eval_std": float(returns.std()),
            "loss": loss,
            "epsilon": epsilon(args, pace.step),
            "wall": time.perf_counter() - start,
        }
        curve.append(point)
        print(
            f"step {point['step']:>7}  episodes {point['episodes']:>5}  "
            f"recent return {point['recent']:6.1f}  "
            f"eval {point['eval_mean']:6.1f} ± {point['eval_std']:5.1f}  "
            f"loss {loss:7.4f}  eps {point['epsilon']:.3f}  wall {point['wall']:6.1f}s",
            flush=True,
        )
        return point

    await buf.wait_for_steps(args.learning_starts)  # learning starts
    print(f"learning starts after {pace.step} env steps ({len(buf)} valid steps stored)")
    while await pace.begin_update():
        batch = await buf.sample_n_step(args.batch_size, n=args.n_step, gamma=args.gamma)
        with torch.no_grad():
            next_obs = batch["next_observation"]
            if args.double_dqn:
                best = q(next_obs).argmax(1, keepdim=True)
                next_q = target(next_obs).gather(1, best).squeeze(1)
            else:
                next_q = target(next_obs).max(1).values
            # reward: discounted n-step return; next_discount: γ^m, or 0 after a termination
            td_target = batch["reward"] + batch["next_discount"] * next_q
        q_taken = q(batch["observation"]).gather(1, batch["action"].unsqueeze(1)).squeeze(1)
        if args.prioritized:  # each window's loss scaled by its importance weight
            per_window = F.smooth_l1_loss(q_taken, td_target, reduction="none")
            loss_t = (batch["weight"] * per_window).mean()
        else:
            loss_t = F.smooth_l1_loss(q_taken, td_target)
        optimizer.zero_grad()
        loss_t.backward()
        nn.utils.clip_grad_norm_(q.parameters(), args.max_grad_norm)
        optimizer.step()
        loss = float(loss_t.detach())
        if args.prioritized:  # new priority |TD error| (the buffer adds eps); anneal beta
            await buf.update_priorities(batch["index"], (q_taken - td_target).abs().detach())
            await buf.set_beta(beta(args, pace.step))
        if (pace.updates + 1) % args.target_update == 0:
            target.load_state_dict(q.state_dict())
        if pace.step >= next_eval:  # no env step is in flight here
            next_eval = (pace.step // args.eval_every + 1) * args.eval_every
            point = evaluation_point(pace.updates + 1)
            in_a_row = in_a_row + 1 if point["eval_mean"] >= args.target_return else 0
            if in_a_row >= args.solved_evals:
                print(
                    f"solved: eval mean {point['eval_mean']:.1f} ± {point['eval_std']:.1f} over "
                    f"{args.eval_episodes} episodes >= {args.target_return} "
                    f"({in_a_row} evaluations in a row) after {point['step']} env steps, "
                    f"{point['updates']} gradient steps, {point['wall']:.1f}s"
                )
                await pace.stop()
        await pace.end_update()
    if not curve or curve[-1]["step"] != pace.step:  # the budget ended between evaluations
        evaluation_point(pace.updates)
    return curve


def plot(args: Args, curve: list[dict], episodes: list[tuple[int, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    if episodes:
        steps, returns = zip(*episodes, strict=True)
        ax.plot(steps, returns, ".", ms=2, alpha=0.3, color="tab:blue", label="training episode")
        window = 20
        if len(returns) >= window:
            smooth = np.convolve(returns, np.ones(window) / window, mode="valid")
            ax.plot(steps[window - 1 :], smooth, color="tab:blue", label=f"mean of last {window}")
    if curve:
        ax.errorbar(
            [p["step"] for p in curve],
            [p["eval_mean"] for p in curve],
            yerr=[p["eval_std"] for p in curve],
            fmt="o-",
            color="tab:red",
            capsize=3,
            label=f"greedy eval (mean ± std of {args.eval_episodes})",
        )
    ax.axhline(args.target_return, ls="--", color="gray", lw=1, label="target")
    ax.set_xlabel("env steps")
    ax.set_ylabel("return")
    per = ", prioritized replay" if args.prioritized else ""
    ax.set_title(
        f"{args.n_step}-step {'Double ' if args.double_dqn else ''}DQN{per}, {args.env_id}"
    )
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def train(args: Args) -> tuple[list[dict], list[tuple[int, float]]]:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    probe = gym.make(args.env_id)
    q = q_network(probe.observation_space.shape[0], probe.action_space.n, args.hidden)
    probe.close()
    pace = Pace(args.num_collectors, args.train_frequency, args.total_steps)
    episodes: list[tuple[int, float]] = []  # (env step at its end, return), in order of ending
    async with EpisodeReplayBuffer(
        max_steps=args.buffer_size,
        seed=args.seed,
        prioritized=args.prioritized,
        alpha=args.alpha,
        beta=args.beta_start,
    ) as buf:
        collectors = [
            asyncio.create_task(collector(i, args, buf, pace, q, episodes))
            for i in range(args.num_collectors)
        ]
        curve = await learner(args, buf, pace, q, episodes)
        await pace.stop()
        await asyncio.gather(*collectors)
        stats = await buf.stats()
        print(
            f"buffer: {stats['episodes']} episodes ({stats['terminated']} terminated, "
            f"{stats['truncated']} truncated at the time limit, {stats['in_progress']} in "
            f"progress) from {len(stats['agents'])} collectors, {stats['valid_steps']} valid steps"
        )
        if stats["prioritized"]:
            print(
                f"prioritized replay: backend {stats['priority_backend']}, alpha "
                f"{stats['alpha']}, beta annealed to {stats['beta']:.2f}"
            )
    return curve, episodes


def main(args: Args) -> None:
    logging.getLogger("torchrl").setLevel(logging.WARNING)  # its storage-allocation INFO line
    began = time.perf_counter()
    curve, episodes = asyncio.run(train(args))
    wall = time.perf_counter() - began
    out_dir = Path(args.out_dir) if args.out_dir else Path(__file__).resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "dqn_cartpole.png"
    plot(args, curve, episodes, path)
    if curve:
        last = curve[-1]
        print(
            f"final: step {last['step']}  eval {last['eval_mean']:.1f} ± {last['eval_std']:.1f}  "
            f"after {last['updates']} gradient steps"
        )
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"wall {wall:.1f}s from start to stop (load average {load}); plot written to {path}")


if __name__ == "__main__":
    main(parse_args())
