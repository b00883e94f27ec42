"""SAC on Pendulum-v1: episodes into a SyncEpisodeReplayBuffer, time limits kept as truncation.

Each episode ends at Pendulum's 200-step time limit as ``"truncated"``, so its last windows
bootstrap (``next_discount`` = γ^m, never 0) instead of learning the time limit as "the world
ends". Batches: ``sample_n_step`` on ``device`` (rows on the CPU), or ``iterate_epochs``.

    python examples/sac_pendulum.py                  # full run; --help lists every knob
    python examples/sac_pendulum.py --total-steps 300 --learning-starts 100 --eval-episodes 2 \
        --eval-every 100 --out-dir /tmp/smoke        # smoke test
"""

import argparse
import copy
import dataclasses
import math
import time
from pathlib import Path

import gymnasium as gym
import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn

from replaybuf import SyncEpisodeReplayBuffer


def knob(default, doc: str):
    return dataclasses.field(default=default, metadata={"help": doc})


@dataclasses.dataclass
class Args:
    seed: int = knob(1, "seeds torch, the buffer's sampler and the envs")
    env_id: str = knob("Pendulum-v1", "gymnasium env (continuous actions in a box)")
    device: str = knob("cuda" if torch.cuda.is_available() else "cpu", "for batches and networks")
    total_steps: int = knob(20_000, "env steps at most")
    learning_starts: int = knob(1_000, "random-action steps before the first gradient step")
    buffer_size: int = knob(100_000, "max_steps of the episode buffer")
    batch_size: int = knob(256, "transitions per gradient step")
    n_step: int = knob(1, "n of the n-step return (n > 1 skips the entropy terms inside it)")
    gamma: float = knob(0.99, "discount")
    tau: float = knob(0.005, "soft target-network update rate")
    hidden: int = knob(128, "units in each of the two hidden layers of every network")
    q_lr: float = knob(1e-3, "Adam learning rate of the two Q-networks")
    policy_lr: float = knob(3e-4, "Adam learning rate of the policy and of the entropy weight")
    policy_frequency: int = knob(2, "gradient steps between policy (and alpha) updates")
    alpha: float = knob(0.2, "the entropy weight's initial value (learned towards -dim(action))")
    epochs_per_update: int = knob(0, "0: a sample_n_step batch per env step; k > 0: k epochs ...")
    epoch_interval: int = knob(1_000, "... of iterate_epochs over the buffer every this many steps")
    eval_every: int = knob(1_000, "env steps between evaluations (and printed curve lines)")
    eval_episodes: int = knob(10, "deterministic-policy episodes per evaluation")
    target_return: float = knob(-250.0, "solved: the evaluation mean reaches this ...")
    solved_evals: int = knob(3, "... in this many evaluations in a row; then the run stops")
    out_dir: str = knob("", "folder for the PNG plot ('' = next to this file)")


def parse_args() -> Args:
    """Every field of Args becomes a --flag (bools get --flag / --no-flag)."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=fmt)
    for f in dataclasses.fields(Args):
        kind = {"action": argparse.BooleanOptionalAction} if f.type is bool else {"type": f.type}
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(flag, default=f.default, help=f.metadata["help"], **kind)
    return Args(**vars(parser.parse_args()))


def mlp(inputs: int, outputs: int, h: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(inputs, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, outputs)
    )


class Critic(nn.Module):  # two Q-networks (clipped double Q)
    def __init__(self, obs_dim: int, act_dim: int, hidden: int) -> None:
        super().__init__()
        self.q1, self.q2 = mlp(obs_dim + act_dim, 1, hidden), mlp(obs_dim + act_dim, 1, hidden)

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = torch.cat([obs, action], -1)
        return self.q1(x).squeeze(-1), self.q2(x).squeeze(-1)


class Actor(nn.Module):  # a tanh-squashed Gaussian policy, scaled to the action box
    def __init__(self, obs_dim: int, act_dim: int, hidden: int, low, high) -> None:
        super().__init__()
        self.net = mlp(obs_dim, 2 * act_dim, hidden)
        self.register_buffer("scale", torch.as_tensor((high - low) / 2))
        self.register_buffer("bias", torch.as_tensor((high + low) / 2))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A sampled action, its log-probability and the deterministic (mean) action."""
        mean, log_std = self.net(obs).chunk(2, -1)
        log_std = -5 + 0.5 * (2 - -5) * (torch.tanh(log_std) + 1)  # in [-5, 2], as CleanRL
        std = log_std.exp()
        u = mean + std * torch.randn_like(mean)
        squashed = torch.tanh(u)
        log_prob = (
            -0.5 * ((u - mean) / std) ** 2 - log_std - 0.5 * math.log(2 * math.pi)
        ) - torch.log(self.scale * (1 - squashed.pow(2)) + 1e-6)
        action = squashed * self.scale + self.bias
        return action, log_prob.sum(-1), torch.tanh(mean) * self.scale + self.bias


def evaluate(args: Args, actor: Actor, device: torch.device) -> np.ndarray:
    """Returns of ``eval_episodes`` deterministic-policy episodes, played side by side."""
    envs = gym.make_vec(args.env_id, args.eval_episodes, vectorization_mode="sync")
    obs, _ = envs.reset(seed=10_000 + args.seed)  # env i: seed 10_000 + seed + i
    returns, running = np.zeros(args.eval_episodes), np.ones(args.eval_episodes, dtype=bool)
    while running.any():  # a finished env restarts: its next steps count for nothing
        with torch.no_grad():
            actions = actor(torch.from_numpy(obs).to(device))[2].cpu().numpy()
        obs, reward, terminated, truncated, _ = envs.step(actions)
        returns += np.where(running, reward, 0.0)
        running &= ~(terminated | truncated)
    return returns


class SAC:  # the networks, their optimizers and one gradient step on an n-step batch
    def __init__(self, args: Args, env: gym.Env, device: torch.device) -> None:
        space = env.action_space
        obs_dim, act_dim = env.observation_space.shape[0], space.shape[0]
        self.args, self.updates, self.q_loss = args, 0, float("nan")
        self.actor = Actor(obs_dim, act_dim, args.hidden, space.low, space.high).to(device)
        self.critic = Critic(obs_dim, act_dim, args.hidden).to(device)
        self.critic_target = copy.deepcopy(self.critic)
        self.q_optimizer = torch.optim.Adam(self.critic.parameters(), lr=args.q_lr)
        self.actor_optimizer = torch.optim.Adam(self.actor.parameters(), lr=args.policy_lr)
        self.target_entropy = -float(act_dim)
        self.log_alpha = torch.tensor(math.log(args.alpha), device=device, requires_grad=True)
        self.alpha_optimizer = torch.optim.Adam([self.log_alpha], lr=args.policy_lr)

    def update(self, batch) -> None:
        obs, action = batch["observation"], batch["action"]
        with torch.no_grad():
            next_action, next_log_prob, _ = self.actor(batch["next_observation"])
            q1_next, q2_next = self.critic_target(batch["next_observation"], next_action)
            next_v = torch.min(q1_next, q2_next) - self.log_alpha.exp() * next_log_prob
            # reward: discounted n-step return; next_discount: γ^m (never 0: no terminations)
            target = batch["reward"] + batch["next_discount"] * next_v
        q1, q2 = self.critic(obs, action)
        q_loss = nn.functional.mse_loss(q1, target) + nn.functional.mse_loss(q2, target)
        self.q_optimizer.zero_grad()
        q_loss.backward()
        self.q_optimizer.step()
        self.q_loss = float(q_loss.detach())
        if self.updates % self.args.policy_frequency == 0:
            for _ in range(self.args.policy_frequency):  # CleanRL's delayed, compensated updates
                new_action, log_prob, _ = self.actor(obs)
                q_new = torch.min(*self.critic(obs, new_action))
                actor_loss = (self.log_alpha.detach().exp() * log_prob - q_new).mean()
                self.actor_optimizer.zero_grad()
                actor_loss.backward()
                self.actor_optimizer.step()
                with torch.no_grad():  # the entropy weight alpha is learned too
                    log_prob = self.actor(obs)[1]
                alpha_loss = -(self.log_alpha.exp() * (log_prob + self.target_entropy)).mean()
                self.alpha_optimizer.zero_grad()
                alpha_loss.backward()
                self.alpha_optimizer.step()
        with torch.no_grad():  # the target networks follow softly
            for p, t in zip(self.critic.parameters(), self.critic_target.parameters(), strict=True):
                t.lerp_(p, self.args.tau)
        self.updates += 1


def plot(args: Args, curve: list, episodes: list, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps, returns = zip(*episodes, strict=True) if episodes else ((), ())
    ax.plot(steps, returns, ".-", ms=3, lw=0.8, alpha=0.6, label="training episode")
    x, mean, std = zip(*curve, strict=True) if curve else ((), (), ())
    label = f"deterministic eval (mean ± std of {args.eval_episodes})"
    ax.errorbar(x, mean, yerr=std, fmt="o-", color="tab:red", capsize=3, label=label)
    ax.axhline(args.target_return, ls="--", color="gray", lw=1, label="target")
    title = f"SAC ({args.n_step}-step), {args.env_id}, time limits as truncation"
    ax.set(xlabel="env steps", ylabel="return", title=title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    args = parse_args()
    torch.set_num_threads(1)  # the fastest for these small networks
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    env = gym.make(args.env_id)
    env.action_space.seed(args.seed)
    agent = SAC(args, env, device)
    episodes, curve, in_a_row, start = [], [], 0, time.perf_counter()  # episodes: (step, return)
    how = "iterate_epochs" if args.epochs_per_update else "sample_n_step"
    print(f"device {device}: networks and batches ({how}, n={args.n_step}); rows on cpu")
    with SyncEpisodeReplayBuffer(
        max_steps=args.buffer_size, device=device, storing_device="cpu", seed=args.seed
    ) as buf:
        nstep = {"n": args.n_step, "gamma": args.gamma}
        obs, _ = env.reset(seed=args.seed)
        episode, episode_return = buf.start_episode(agent_id="pendulum"), 0.0
        for step in range(1, args.total_steps + 1):
            if step <= args.learning_starts:
                action = env.action_space.sample()
            else:
                with torch.no_grad():
                    action = agent.actor(torch.from_numpy(obs).to(device))[0].cpu().numpy()
            next_obs, reward, terminated, truncated, _ = env.step(action)
            buf.append_observation_action_reward(
                episode, torch.from_numpy(obs), action=torch.as_tensor(action), reward=float(reward)
            )
            episode_return += float(reward)
            if terminated or truncated:  # Pendulum only truncates: its windows bootstrap
                status = "terminated" if terminated else "truncated"
                buf.end_episode(episode, status, final_observation=torch.from_numpy(next_obs))
                episodes.append((step, episode_return))
                next_obs, _ = env.reset()
                episode, episode_return = buf.start_episode(agent_id="pendulum"), 0.0
            obs = next_obs
            if step > args.learning_starts and args.epochs_per_update == 0:
                agent.update(buf.sample_n_step(args.batch_size, **nstep))
            elif step > args.learning_starts and step % args.epoch_interval == 0:
                for batch in buf.iterate_epochs(
                    args.batch_size, args.epochs_per_update, drop_last=True, **nstep
                ):
                    agent.update(batch)
            if step % args.eval_every == 0:
                returns = evaluate(args, agent.actor, device)
                recent = np.mean([r for _, r in episodes[-10:]]) if episodes else np.nan
                curve.append((step, returns.mean(), returns.std()))
                print(
                    f"step {step:>7}  episodes {len(episodes):>4}  recent return {recent:8.1f}  "
                    f"eval {returns.mean():8.1f} ± {returns.std():6.1f}  "
                    f"q_loss {agent.q_loss:8.3f}  alpha {agent.log_alpha.exp().item():.3f}  "
                    f"wall {time.perf_counter() - start:6.1f}s",
                    flush=True,
                )
                in_a_row = in_a_row + 1 if returns.mean() >= args.target_return else 0
                if in_a_row >= args.solved_evals:
                    print(f"solved: {in_a_row} evaluations in a row >= {args.target_return}")
                    break
        s = buf.stats()
        print(
            f"buffer: {s['episodes']} episodes ({s['truncated']} truncated, {s['terminated']} "
            f"terminated, {s['in_progress']} in progress), {s['valid_steps']} valid steps"
        )
    out_dir = Path(args.out_dir) if args.out_dir else Path(__file__).resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(args, curve, episodes, path := out_dir / "sac_pendulum.png")
    print(f"wall {time.perf_counter() - start:.1f}s; plot written to {path}")
