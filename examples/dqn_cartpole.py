"""n-step Double DQN on CartPole-v1: asyncio collectors fill an episode buffer, a learner samples.

Collector tasks write episodes into one ``EpisodeReplayBuffer`` while a learner task trains on
its ``sample_n_step`` batches (``--prioritized``: PER). Turns go by count: a seed gives one run.

    python examples/dqn_cartpole.py [--prioritized]    # full run; --help lists every knob
    python examples/dqn_cartpole.py --total-steps 300 --learning-starts 100 --eval-episodes 2 \
        --eval-every 100 --out-dir /tmp/smoke           # smoke test
"""

import argparse
import asyncio
import copy
import dataclasses
import time
from pathlib import Path

import gymnasium as gym
import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn

from replaybuf import EpisodeReplayBuffer


def knob(default, doc: str):
    return dataclasses.field(default=default, metadata={"help": doc})


@dataclasses.dataclass
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
    prioritized: bool = knob(False, "prioritized replay: draw windows by |TD error|^alpha")
    alpha: float = knob(0.6, "PER's priority exponent (with --prioritized)")
    beta_start: float = knob(0.4, "PER's importance-weight exponent, annealed linearly to 1")
    eval_every: int = knob(2_000, "env steps between evaluations (and printed curve lines)")
    eval_episodes: int = knob(20, "greedy episodes per evaluation")
    target_return: float = knob(475.0, "solved: the evaluation mean reaches this ...")
    solved_evals: int = knob(2, "... in this many evaluations in a row; then the run stops")
    out_dir: str = knob("", "folder for the PNG plot ('' = next to this file)")


def parse_args() -> Args:
    """Every field of Args becomes a --flag (bools get --flag / --no-flag)."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=fmt)
    for f in dataclasses.fields(Args):
        kind = {"action": argparse.BooleanOptionalAction} if f.type is bool else {"type": f.type}
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(flag, default=f.default, help=f.metadata["help"], **kind)
    return Args(**vars(parser.parse_args()))  # the buffer checks alpha and beta


def epsilon(step: int) -> float:
    """Exploration: from 1 at the start down to 0.05 at env step 10,000, then 0.05."""
    return 0.05 + 0.95 * max(0.0, 1.0 - step / 10_000)


class Turns:
    """Who moves next, by counts alone: env step s is collector ``s % num_collectors``'s; from
    env step ``base`` on, the learner moves every ``train_frequency`` steps (none in flight)."""

    def __init__(self, args: Args) -> None:
        self.args, self.cond = args, asyncio.Condition()
        self.step = self.updates = 0  # env steps, gradient steps completed
        self.busy = self.stopped = False  # busy: an env step is in flight
        self.base: int | None = None  # env steps taken when learning started

    def done(self) -> bool:
        return self.stopped or self.step >= self.args.total_steps

    def my_turn(self, index: int | None) -> bool:
        a = self.args
        owed = self.base is not None and self.step >= self.base + self.updates * a.train_frequency
        mine = owed if index is None else not owed and self.step % a.num_collectors == index
        return not self.busy and mine

    async def wait_turn(self, index: int | None) -> bool:
        """Wait until collector ``index`` (None: the learner) moves next; False at the end."""
        async with self.cond:
            if index is None and self.base is None:
                self.base = self.step + int(self.busy)  # a step in flight counts as taken
            await self.cond.wait_for(lambda: self.done() or self.my_turn(index))
            self.busy = index is not None and not self.done()
            return not self.done()

    async def set(self, **counts) -> None:
        """Change the counts and wake every task to check whose turn it is."""
        async with self.cond:
            vars(self).update(counts)
            self.cond.notify_all()


async def collector(index, args, buf, turns: Turns, q: nn.Module, episodes: list) -> None:
    """Play one env epsilon-greedily on the current Q-network, every step into the buffer."""
    env = gym.make(args.env_id)
    rng = np.random.default_rng(args.seed * 1_000 + index)  # this collector's epsilon draws
    obs = torch.from_numpy(env.reset(seed=args.seed * 1_000 + index)[0])
    ep, episode_return = await buf.start_episode(agent_id=f"collector-{index}"), 0.0
    while await turns.wait_turn(index):
        step = turns.step
        if rng.random() < epsilon(step):
            action = int(rng.integers(env.action_space.n))
        else:
            with torch.no_grad():
                action = int(q(obs).argmax())
        next_obs, reward, terminated, truncated, _ = env.step(action)
        await buf.append_observation_action_reward(ep, obs, action=action, reward=float(reward))
        episode_return += float(reward)
        if terminated or truncated:  # a time limit is a truncation: its window bootstraps
            status = "terminated" if terminated else "truncated"
            await buf.end_episode(ep, status, final_observation=torch.from_numpy(next_obs))
            episodes.append((step + 1, episode_return))
            next_obs, _ = env.reset()
            ep, episode_return = await buf.start_episode(agent_id=f"collector-{index}"), 0.0
        obs = torch.from_numpy(next_obs)
        await turns.set(busy=False, step=step + 1)


def evaluate(args: Args, q: nn.Module) -> np.ndarray:
    """Returns of ``eval_episodes`` greedy episodes, played side by side (one batched forward)."""
    envs = gym.make_vec(args.env_id, args.eval_episodes, vectorization_mode="sync")
    obs, _ = envs.reset(seed=10_000 + args.seed * 1_000)  # env i: this seed + i
    returns, running = np.zeros(args.eval_episodes), np.ones(args.eval_episodes, dtype=bool)
    actions = np.zeros(args.eval_episodes, dtype=np.int64)  # a finished env's is ignored
    while running.any():
        with torch.no_grad():
            actions[running] = q(torch.from_numpy(obs[running])).argmax(1).numpy()
        obs, reward, terminated, truncated, _ = envs.step(actions)
        returns += np.where(running, reward, 0.0)
        running &= ~(terminated | truncated)
    return returns


async def train(args: Args) -> tuple[list, list]:
    """Start the collectors, then train Double DQN on n-step batches until the budget ends."""
    env = gym.make(args.env_id)
    obs_dim, n_actions, h = env.observation_space.shape[0], env.action_space.n, 128  # h: hidden
    torch.manual_seed(args.seed)
    q = nn.Sequential(
        nn.Linear(obs_dim, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, n_actions)
    )
    target = copy.deepcopy(q)
    optimizer = torch.optim.Adam(q.parameters(), lr=args.learning_rate)
    turns, episodes = Turns(args), []  # episodes: (env step at its end, return)
    curve, start, next_eval, loss, in_a_row = [], time.perf_counter(), args.eval_every, np.nan, 0

    def evaluation() -> float:
        returns = evaluate(args, q)
        recent = np.mean([r for _, r in episodes[-20:]]) if episodes else np.nan
        print(
            f"step {turns.step:>7}  episodes {len(episodes):>5}  recent return {recent:6.1f}  "
            f"eval {returns.mean():6.1f} ± {returns.std():5.1f}  loss {loss:7.4f}  "
            f"eps {epsilon(turns.step):.3f}  wall {time.perf_counter() - start:6.1f}s",
            flush=True,
        )
        curve.append((turns.step, returns.mean(), returns.std()))
        return returns.mean()

    per = {"prioritized": args.prioritized, "alpha": args.alpha, "beta": args.beta_start}
    async with EpisodeReplayBuffer(max_steps=args.buffer_size, seed=args.seed, **per) as buf:
        tasks = (collector(i, args, buf, turns, q, episodes) for i in range(args.num_collectors))
        collectors = [asyncio.create_task(task) for task in tasks]
        await buf.wait_for_steps(args.learning_starts)
        print(f"learning starts after {turns.step} env steps ({len(buf)} valid steps stored)")
        while await turns.wait_turn(None):
            batch = await buf.sample_n_step(args.batch_size, n=args.n_step, gamma=args.gamma)
            with torch.no_grad():  # Double DQN: the online net picks, the target net rates
                best = q(batch["next_observation"]).argmax(1, keepdim=True)
                next_q = target(batch["next_observation"]).gather(1, best).squeeze(1)
                # reward: discounted n-step return; next_discount: γ^m, or 0 after a termination
                td_target = batch["reward"] + batch["next_discount"] * next_q
            q_taken = q(batch["observation"]).gather(1, batch["action"].unsqueeze(1)).squeeze(1)
            per_window = nn.functional.smooth_l1_loss(q_taken, td_target, reduction="none")
            weight = batch["weight"] if args.prioritized else 1.0  # PER: importance weights
            loss_t = (weight * per_window).mean()
            optimizer.zero_grad()
            loss_t.backward()
            nn.utils.clip_grad_norm_(q.parameters(), max_norm=10.0)
            optimizer.step()
            loss = float(loss_t.detach())
            if args.prioritized:  # new priority |TD error| (the buffer adds eps); beta to 1
                await buf.update_priorities(batch["index"], (q_taken - td_target).abs().detach())
                done = min(1.0, turns.step / args.total_steps)
                await buf.set_beta(args.beta_start + (1.0 - args.beta_start) * done)
            if (turns.updates + 1) % 500 == 0:  # a hard target-network update every 500 steps
                target.load_state_dict(q.state_dict())
            if turns.step >= next_eval:  # no env step is in flight here
                next_eval = (turns.step // args.eval_every + 1) * args.eval_every
                in_a_row = in_a_row + 1 if evaluation() >= args.target_return else 0
                if in_a_row >= args.solved_evals:
                    print(f"solved: {in_a_row} evaluations in a row >= {args.target_return}")
            await turns.set(updates=turns.updates + 1, stopped=in_a_row >= args.solved_evals)
        if not curve or curve[-1][0] != turns.step:  # the budget ended between evaluations
            evaluation()
        await turns.set(stopped=True)  # the collectors waiting for a turn return
        await asyncio.gather(*collectors)
        s = await buf.stats()
        print(
            f"buffer: {s['episodes']} episodes ({s['terminated']} terminated, {s['truncated']} "
            f"truncated at the time limit, {s['in_progress']} in progress) from "
            f"{len(s['agents'])} collectors, {s['valid_steps']} valid steps"
        )
        if s["prioritized"]:
            print(
                f"prioritized replay: backend {s['priority_backend']}, alpha {s['alpha']}, "
                f"beta annealed to {s['beta']:.2f}"
            )
    return curve, episodes


def plot(args: Args, curve: list, episodes: list, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps, returns = zip(*episodes, strict=True) if episodes else ((), ())
    ax.plot(steps, returns, ".", ms=2, alpha=0.3, color="tab:blue", label="training episode")
    if len(returns) >= 20:
        smooth = np.convolve(returns, np.ones(20) / 20, mode="valid")
        ax.plot(steps[19:], smooth, color="tab:blue", label="mean of last 20")
    x, mean, std = zip(*curve, strict=True)
    label = f"greedy eval (mean ± std of {args.eval_episodes})"
    ax.errorbar(x, mean, yerr=std, fmt="o-", color="tab:red", capsize=3, label=label)
    ax.axhline(args.target_return, ls="--", color="gray", lw=1, label="target")
    per = ", prioritized replay" if args.prioritized else ""
    ax.set(xlabel="env steps", ylabel="return", title=f"{args.n_step}-step Double DQN{per}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    args = parse_args()
    torch.set_num_threads(1)  # the fastest for these small networks
    curve, episodes = asyncio.run(train(args))
    out_dir = Path(args.out_dir) if args.out_dir else Path(__file__).resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(args, curve, episodes, path := out_dir / "dqn_cartpole.png")
    print(f"plot written to {path}")
