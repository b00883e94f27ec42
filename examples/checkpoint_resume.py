"""Train, kill, resume, continue: n-step DQN on CartPole-v1 from a replaybuf checkpoint.

The worker (``--role worker``) trains ``dqn_cartpole.py``'s DQN, every ``checkpoint_every`` env
steps saves the buffer (``save_checkpoint``) and, with ``torch.save``, networks, Adam, RNGs, counts
and envs in ``ckpt-<step>/`` named by ``LATEST``; restarted, it resumes there (``load_checkpoint``).
The driver (default) runs a worker, SIGKILLs it, reruns it and checks the curves agree exactly.

    python examples/checkpoint_resume.py                  # full demo; --help lists every knob
    python examples/checkpoint_resume.py --total-steps 400 --learning-starts 100 --eval-every 50 \
        --eval-episodes 2 --checkpoint-every 100 --kill-at-step 250 --out-dir /tmp/smoke  # smoke
"""

import argparse
import copy
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gymnasium as gym
import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn

from replaybuf import SyncEpisodeReplayBuffer

CURVE = re.compile(r"^step\s+(\d+)\s.*recent return (\S+)\s+eval (\S+) ±")  # a curve point


def knob(default, doc: str):
    return dataclasses.field(default=default, metadata={"help": doc})


@dataclasses.dataclass
class Args:
    role: str = knob("driver", "'driver' runs workers and kills one; 'worker' trains")
    run_dir: str = knob("", "checkpoint folder ('' = a fresh temporary one, removed at the end)")
    out_dir: str = knob("", "folder for the PNG plot ('' = next to this file)")
    total_steps: int = knob(16_000, "env steps of the whole run (all envs together)")
    checkpoint_every: int = knob(2_000, "env steps between checkpoints")
    kill_at_step: int = knob(9_000, "the driver kills run 1 once it prints a step >= this")
    reference: bool = knob(True, "also run uninterrupted and compare the curves")
    durable: bool = knob(True, "fsync checkpoints (False: safe against kills, not power loss)")
    seed: int = knob(1, "seeds torch, the buffer's sampler, every env and every epsilon draw")
    num_envs: int = knob(4, "envs, taking env steps in turn")
    learning_starts: int = knob(1_000, "valid steps stored before the first gradient step")
    eval_every: int = knob(1_000, "env steps between evaluations (printed curve lines)")
    eval_episodes: int = knob(10, "greedy episodes per evaluation")


def parse_args() -> Args:
    """Every field of Args becomes a --flag (bools get --flag / --no-flag)."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=fmt)
    for f in dataclasses.fields(Args):
        kind = {"action": argparse.BooleanOptionalAction} if f.type is bool else {"type": f.type}
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(flag, default=f.default, help=f.metadata["help"], **kind)
    return Args(**vars(parser.parse_args()))


@dataclasses.dataclass
class Progress:  # what the training loop has counted and holds; each checkpoint saves all of it
    obs: list  # each env's current observation (a tensor)
    episode_ids: list  # each env's episode in progress
    returns: list  # each env's return so far in that episode
    step: int = 0  # env steps taken; env step s is taken by env s % num_envs
    updates: int = 0  # gradient steps taken: the learner takes a turn after each env step ...
    base: int | None = None  # ... from here on: the step when learning_starts steps were stored
    episodes: list = dataclasses.field(default_factory=list)  # [env step at its end, return]

    def due(self, every: int) -> bool:  # each multiple of every, and learning's start if one passed
        return self.step % every == 0 or (self.step == self.base and self.base > every)


@torch.no_grad()
def evaluate(args: Args, q: nn.Module) -> np.ndarray:
    """Returns of ``eval_episodes`` greedy episodes, played side by side (one batched forward)."""
    envs = gym.make_vec("CartPole-v1", args.eval_episodes, vectorization_mode="sync")
    obs, _ = envs.reset(seed=10_000 + args.seed * 1_000)  # env i: this seed + i
    returns, running = np.zeros(args.eval_episodes), np.ones(args.eval_episodes, dtype=bool)
    actions = np.zeros(args.eval_episodes, dtype=np.int64)  # a finished env's is ignored
    while running.any():
        actions[running] = q(torch.from_numpy(obs[running])).argmax(1).numpy()
        obs, reward, terminated, truncated, _ = envs.step(actions)
        returns += np.where(running, reward, 0.0)
        running &= ~(terminated | truncated)
    return returns


def save(args: Args, buf: SyncEpisodeReplayBuffer, nets: dict, envs, rngs, p: Progress) -> None:
    """``run_dir/ckpt-<step>/{replay/, agent.pt}``, then ``LATEST`` names it; older ones go."""
    run_dir, ckpt = Path(args.run_dir), Path(args.run_dir) / f"ckpt-{p.step:08d}"
    state = {key: net.state_dict() for key, net in nets.items()}  # networks, Adam
    state["torch_rng"], state["progress"] = torch.get_rng_state(), dataclasses.asdict(p)
    state["env_states"] = [env.unwrapped.state.tolist() for env in envs]  # x, x', θ, θ' float64
    state["env_steps"] = [env.get_wrapper_attr("_elapsed_steps") for env in envs]  # TimeLimit's
    state["rngs"] = [g.bit_generator.state for g in rngs + [e.unwrapped.np_random for e in envs]]
    buf.save_checkpoint(ckpt / "replay", durable=args.durable)  # makes ckpt/, clears a killed write
    torch.save(state, ckpt / "agent.pt")
    (run_dir / ".LATEST.tmp").write_text(ckpt.name)
    for path in (ckpt / "agent.pt", run_dir / ".LATEST.tmp") if args.durable else ():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    os.replace(run_dir / ".LATEST.tmp", run_dir / "LATEST")  # the old name or the new, no mix
    for old in set(run_dir.glob("ckpt-*")) - {ckpt}:
        shutil.rmtree(old)
    print(f"checkpoint step {p.step} -> {ckpt.name}")


def train(args: Args) -> None:
    """The worker: resume from ``LATEST`` if there is one, then train and checkpoint."""
    torch.set_num_threads(1)  # the fastest for these small networks
    run_dir = Path(args.run_dir)  # memmaps: the temp folder, where a new buffer sweeps dead ones'
    envs = [gym.make("CartPole-v1") for _ in range(args.num_envs)]  # its state can be saved whole
    rngs = [np.random.default_rng(args.seed * 1_000 + i) for i in range(args.num_envs)]  # epsilon
    obs = [torch.from_numpy(env.reset(seed=args.seed * 1_000 + i)[0]) for i, env in enumerate(envs)]
    d, n_act, h = obs[0].shape[0], envs[0].action_space.n, 128  # d: obs size, h: hidden units
    torch.manual_seed(args.seed)
    q = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, n_act))
    target, optimizer = copy.deepcopy(q), torch.optim.Adam(q.parameters(), lr=5e-4)
    nets = {"q": q, "target": target, "optimizer": optimizer}  # what has a state_dict
    if (run_dir / "LATEST").exists():
        ckpt = run_dir / (run_dir / "LATEST").read_text()
        buf = SyncEpisodeReplayBuffer.load_checkpoint(ckpt / "replay")
        state = torch.load(ckpt / "agent.pt", weights_only=True)  # tensors and plain data only
        for key, net in nets.items():
            net.load_state_dict(state[key])
        torch.set_rng_state(state["torch_rng"])
        for g, s in zip(rngs + [e.unwrapped.np_random for e in envs], state["rngs"], strict=True):
            g.bit_generator.state = s
        for env, x, steps in zip(envs, state["env_states"], state["env_steps"], strict=True):
            env.unwrapped.state = np.array(x)  # reset() satisfied the order check; overwrite it
            env.set_wrapper_attr("_elapsed_steps", steps)
        p = Progress(**state["progress"])
        print(
            f"resumed from {ckpt.name}: step {p.step}, {p.updates} gradient steps, "
            f"{len(buf)} valid steps, {buf.stats()['in_progress']} episodes in progress continue"
        )
    else:
        buf = SyncEpisodeReplayBuffer(max_steps=100_000, seed=args.seed)
        ids = [buf.start_episode(agent_id=f"env-{i}") for i in range(args.num_envs)]
        p = Progress(obs, ids, [0.0] * len(envs))
    with buf:
        while p.step < args.total_steps:
            while p.base is not None and p.step >= p.base + p.updates:  # the learner's turn
                batch = buf.sample_n_step(128, n=3, gamma=0.99)
                with torch.no_grad():  # Double DQN: the online net picks, the target rates
                    best = q(batch["next_observation"]).argmax(1, keepdim=True)
                    next_q = target(batch["next_observation"]).gather(1, best).squeeze(1)
                    # reward: discounted n-step return; next_discount: γ^m, 0 after a termination
                    td_target = batch["reward"] + batch["next_discount"] * next_q
                q_taken = q(batch["observation"]).gather(1, batch["action"].unsqueeze(1)).squeeze(1)
                loss = nn.functional.smooth_l1_loss(q_taken, td_target)
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(q.parameters(), max_norm=10.0)
                optimizer.step()
                p.updates += 1
                if p.updates % 500 == 0:  # a hard target-network update
                    target.load_state_dict(q.state_dict())
                if p.due(args.eval_every):
                    evals, recent = evaluate(args, q), [r for _, r in p.episodes[-20:]]
                    print(
                        f"step {p.step:>7}  updates {p.updates:>6}  episodes {len(p.episodes):>5}  "
                        f"recent return {np.mean(recent) if recent else np.nan:.4f}  "
                        f"eval {evals.mean():.4f} ± {evals.std():.4f}  loss {loss.item():.6f}"
                    )
                if p.due(args.checkpoint_every):
                    save(args, buf, nets, envs, rngs, p)
            i, ep = p.step % args.num_envs, p.episode_ids[p.step % args.num_envs]
            explore = rngs[i].random() < 0.05 + 0.95 * max(0.0, 1.0 - p.step / 10_000)  # ε-greedy
            with torch.no_grad():
                action = int(rngs[i].integers(n_act)) if explore else int(q(p.obs[i]).argmax())
            next_obs, reward, terminated, truncated, _ = envs[i].step(action)
            buf.append_observation_action_reward(ep, p.obs[i], action=action, reward=float(reward))
            p.returns[i] += float(reward)
            if terminated or truncated:
                status = "terminated" if terminated else "truncated"
                buf.end_episode(ep, status, final_observation=torch.from_numpy(next_obs))
                p.episodes.append([p.step + 1, p.returns[i]])
                next_obs, _ = envs[i].reset()
                p.episode_ids[i], p.returns[i] = buf.start_episode(agent_id=f"env-{i}"), 0.0
            p.obs[i], p.step = torch.from_numpy(next_obs), p.step + 1
            p.base = p.step if p.base is None and len(buf) >= args.learning_starts else p.base
    print(f"finished: step {p.step}, {p.updates} gradient steps")


def run_worker(run_dir: Path, label: str, kill_at: float = np.inf) -> dict[int, str]:
    """Run a worker on ``run_dir``, echo it, SIGKILL it at a step >= ``kill_at``; its curve."""
    cmd = [sys.executable, "-u", __file__, *sys.argv[1:], "--role", "worker", "--run-dir", run_dir]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    points = {}
    for line in proc.stdout:
        print(f"[{label}] {line.rstrip()}", flush=True)
        if m := CURVE.match(line):
            points[int(m[1])] = line
            if int(m[1]) >= kill_at:
                proc.kill()  # SIGKILL: no cleanup, no last checkpoint
                print(f"[{label}] --- SIGKILL at step >= {m[1]} ---", flush=True)
                break
    proc.stdout.read()  # whatever it wrote before the signal landed
    if proc.wait() != 0 and kill_at == np.inf:
        raise SystemExit(f"{label}: the worker exited with {proc.returncode}")
    return points


def drive(args: Args) -> None:
    # the uninterrupted run goes alongside in a thread; the pool ends before the folders go
    with tempfile.TemporaryDirectory(prefix="dqn-") as tmp, ThreadPoolExecutor() as pool:
        run_dir = Path(args.run_dir or Path(tmp) / "run")
        ref = args.reference and pool.submit(run_worker, Path(tmp) / "reference", "reference")
        run1 = run_worker(run_dir, "run 1", kill_at=args.kill_at_step)
        resumed_from = int(latest.read_text()[5:]) if (latest := run_dir / "LATEST").exists() else 0
        run2 = run_worker(run_dir, "run 2")  # its new memmap storage sweeps run 1's away
        runs = {"run 1": run1, "run 2": run2, **({"reference": ref.result()} if ref else {})}
    both = run1.keys() & run2.keys()  # printed by run 1 after the checkpoint run 2 resumed from
    same = all(run1[s] == run2[s] for s in both) and all(s > resumed_from for s in run2)
    print(f"run 2 redid {len(both)} curve point(s) of run 1:", "identical" if same else "DIFFERENT")
    if ref:
        same = same and {**run1, **run2} == runs["reference"]
        print(f"killed + resumed == uninterrupted at all {len(runs['reference'])} points: {same}")
    fig, ax = plt.subplots(figsize=(8, 5.5), layout="tight")
    for k, (label, points) in enumerate(runs.items()):  # run 1, run 2, reference
        steps, found = sorted(points), [CURVE.match(points[s]) for s in sorted(points)]
        kw = {"color": f"C{k}"} if k < 2 else {"color": "gray", "lw": 7, "alpha": 0.3, "zorder": 1}
        ax.plot(steps, [float(m[3]) for m in found], "o-", ms=3, label=f"{label}: eval", **kw)
        ax.plot(steps, [float(m[2]) for m in found], "--", label=f"{label}: training", **kw)
    ax.axvline(max(run1), color="tab:red", ls="--", lw=1, label="run 1 killed")
    ax.axvline(resumed_from, color="tab:green", ls=":", lw=1.5, label="run 2 resumed")
    ax.set(xlabel="env steps", title="kill and resume from a checkpoint: 3-step DQN, CartPole-v1")
    ax.set_ylabel(f"return (eval: greedy mean of {args.eval_episodes}; training: last 20 episodes)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=4, fontsize=7)
    path = Path(args.out_dir or Path(__file__).resolve().parent) / "checkpoint_resume.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")
    if not same:
        raise SystemExit("the resumed run did not go on as the uninterrupted one")


if __name__ == "__main__":
    args = parse_args()
    (train if args.role == "worker" else drive)(args)
