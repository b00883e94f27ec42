"""Train, kill, resume, continue: n-step DQN on CartPole-v1 from a replaybuf checkpoint.

One file, top to bottom (CleanRL style). The same script plays two roles:

* **worker** (``--role worker``) trains the asyncio DQN of ``dqn_cartpole.py`` (collector tasks
  writing episodes into an ``EpisodeReplayBuffer``, a learner sampling ``sample_n_step``) and,
  every ``checkpoint_every`` env steps, saves everything a run is made of into
  ``run_dir/ckpt-<step>/``: the buffer with ``await buf.save_checkpoint(dir)`` (rows, episodes in
  progress, the sampler's RNG state) and, next to it with ``torch.save``, the Q-networks, the
  Adam state, the turn counters, each collector's env state (CartPole's state is four numbers),
  epsilon RNG, current observation and episode id, and the curve so far. Then it points
  ``run_dir/LATEST`` at that folder (an atomic rename), so a kill at any moment leaves one
  complete checkpoint. Started again, it resumes from ``LATEST`` with
  ``await EpisodeReplayBuffer.load_checkpoint(dir)``: the episodes in progress go on where they
  stopped, in the buffer and in the envs.
* **driver** (the default) starts a worker, kills it with SIGKILL once it has printed the curve
  past ``kill_at_step``, starts it again (it resumes from the last checkpoint and redoes the
  lost steps), and with ``--reference`` also runs it uninterrupted. Everything is decided by
  counts, not timing, so the resumed curve is the uninterrupted one, number for number: the
  driver checks that, prints both curves and writes ``checkpoint_resume.png``.

    python examples/checkpoint_resume.py                  # full demo
    python examples/checkpoint_resume.py --help           # every knob
    python examples/checkpoint_resume.py --total-steps 400 --learning-starts 100 \
        --eval-every 50 --eval-episodes 2 --checkpoint-every 100 --kill-at-step 250 \
        --out-dir /tmp/smoke                              # smoke test

With the defaults run 1 is killed just after step 9,000, run 2 resumes from the 8,000-step
checkpoint, and all 15 curve points of killed + resumed equal the uninterrupted run's; the whole
demo takes 63 s on a 2-core CPU VM at load average 1.3-1.9 (each checkpoint save 0.03-0.06 s).

For an env whose state cannot be saved, end each restored episode in progress with
``end_episode(ep, "truncated", final_observation=<the saved current observation>)`` instead and
start fresh episodes: the buffer still holds every step taken before the checkpoint.
"""

import argparse
import asyncio
import copy
import dataclasses
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


def knob(default, doc: str):
    """A dataclass field with its command-line help."""
    return field(default=default, metadata={"help": doc})


@dataclass
class Args:
    role: str = knob("driver", "'driver' runs workers and kills one; 'worker' trains")
    run_dir: str = knob("", "checkpoint folder ('' = a fresh temporary one, removed at the end)")
    out_dir: str = knob("", "folder for the PNG plot ('' = next to this file)")
    total_steps: int = knob(16_000, "env steps of the whole run (all collectors together)")
    checkpoint_every: int = knob(2_000, "env steps between checkpoints")
    kill_at_step: int = knob(9_000, "the driver kills run 1 once it prints a step >= this")
    reference: bool = knob(True, "also run uninterrupted and compare the curves")
    durable: bool = knob(True, "fsync checkpoints (False: safe against kills, not power loss)")
    seed: int = knob(1, "seeds torch, the buffer's sampler, every env and every epsilon draw")
    env_id: str = knob("CartPole-v1", "gymnasium env (its state must be savable: CartPole)")
    num_collectors: int = knob(4, "asyncio collector tasks, each with its own env")
    learning_starts: int = knob(1_000, "valid steps stored before the first gradient step")
    train_frequency: int = knob(1, "env steps per gradient step (a fixed ratio)")
    buffer_size: int = knob(100_000, "max_steps of the EpisodeReplayBuffer")
    batch_size: int = knob(128, "n-step transitions per gradient step")
    n_step: int = knob(3, "n of the n-step return")
    gamma: float = knob(0.99, "discount")
    learning_rate: float = knob(5e-4, "Adam learning rate")
    hidden: int = knob(128, "units in each of the Q-network's two hidden layers")
    target_update: int = knob(500, "gradient steps between hard target-network updates")
    max_grad_norm: float = knob(10.0, "gradient clipping norm")
    start_e: float = knob(1.0, "epsilon at the start")
    end_e: float = knob(0.05, "epsilon at the end of the schedule")
    exploration_steps: int = knob(10_000, "env steps to anneal epsilon over")
    eval_every: int = knob(1_000, "env steps between evaluations (printed curve lines)")
    eval_episodes: int = knob(10, "greedy episodes per evaluation")
    threads: int = knob(1, "torch CPU threads")


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
    return Args(**vars(parser.parse_args(argv)))


def to_argv(args: Args) -> list[str]:
    """The flags that rebuild ``args`` (the driver passes its knobs on to the workers)."""
    argv = []
    for f in dataclasses.fields(Args):
        value, flag = getattr(args, f.name), f.name.replace("_", "-")
        argv += (
            [f"--{'' if value else 'no-'}{flag}"] if f.type is bool else [f"--{flag}", str(value)]
        )
    return argv


# =============================================================================== worker
# Imported only by the worker: the driver needs neither torch nor gymnasium.


def worker(args: Args) -> None:
    import gymnasium as gym
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch import nn

    from replaybuf import EpisodeReplayBuffer

    logging.getLogger("torchrl").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    run_dir = Path(args.run_dir)
    scratch = run_dir / "scratch"  # memmap files; a killed worker leaves its folder here
    scratch.mkdir(parents=True, exist_ok=True)

    def q_network(obs_dim: int, n_actions: int) -> nn.Module:
        return nn.Sequential(
            nn.Linear(obs_dim, args.hidden),
            nn.ReLU(),
            nn.Linear(args.hidden, args.hidden),
            nn.ReLU(),
            nn.Linear(args.hidden, n_actions),
        )

    def epsilon(step: int) -> float:
        span = max(1, args.exploration_steps)
        return args.end_e + (args.start_e - args.end_e) * max(0.0, 1.0 - step / span)

    class Pace:
        """Turns by counts only (see dqn_cartpole.py): env step s belongs to collector
        ``s % num_collectors``; one gradient step per ``train_frequency`` env steps once
        learning starts. The counters are part of the checkpoint."""

        def __init__(self) -> None:
            self.cond = asyncio.Condition()
            self.step = 0  # env steps completed
            self.updates = 0  # gradient steps completed
            self.busy = False  # an env step is in flight
            self.base: int | None = None  # env steps when learning started
            self.stopped = False

        def done(self) -> bool:
            return self.stopped or self.step >= args.total_steps

        def allowance(self) -> float:
            if self.base is None:
                return float("inf")
            return self.base + self.updates * args.train_frequency

        async def begin_env_step(self, collector: int) -> int | None:
            async with self.cond:
                await self.cond.wait_for(
                    lambda: (
                        self.done()
                        or (
                            not self.busy
                            and self.step % args.num_collectors == collector
                            and self.step < self.allowance()
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
            async with self.cond:
                if self.base is None:
                    self.base = self.step + int(self.busy)
                await self.cond.wait_for(
                    lambda: self.done() or (not self.busy and self.step >= self.allowance())
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

    class Collector:
        """One env and its epsilon RNG; ``state()`` / ``restore()`` for the checkpoint."""

        def __init__(self, index: int) -> None:
            self.index = index
            self.env = gym.make(args.env_id)
            self.rng = np.random.default_rng(args.seed * 1_000 + index)
            self.obs, _ = self.env.reset(seed=args.seed * 1_000 + index)
            self.episode = -1  # set by start() or restore()
            self.episode_return = 0.0

        async def start(self, buf: EpisodeReplayBuffer) -> None:
            self.episode = await buf.start_episode(agent_id=f"collector-{self.index}")

        def state(self) -> dict:
            core = self.env.unwrapped
            return {
                "env_state": [float(x) for x in core.state],  # CartPole: x, x', θ, θ' (float64)
                "elapsed_steps": self.env.get_wrapper_attr("_elapsed_steps"),
                "env_rng": core.np_random.bit_generator.state,
                "rng": self.rng.bit_generator.state,
                "obs": torch.from_numpy(self.obs.copy()),
                "episode": self.episode,
                "episode_return": self.episode_return,
            }

        def restore(self, state: dict) -> None:
            core = self.env.unwrapped  # reset() above satisfied the order check; now overwrite
            core.state = np.array(state["env_state"], dtype=np.float64)
            core.np_random.bit_generator.state = state["env_rng"]
            self.env.set_wrapper_attr("_elapsed_steps", state["elapsed_steps"])
            self.rng.bit_generator.state = state["rng"]
            self.obs = state["obs"].numpy()
            self.episode, self.episode_return = state["episode"], state["episode_return"]

        async def run(self, buf, pace: Pace, q: nn.Module, episodes: list) -> None:
            while (step := await pace.begin_env_step(self.index)) is not None:
                if self.rng.random() < epsilon(step):
                    action = int(self.rng.integers(self.env.action_space.n))
                else:
                    with torch.no_grad():
                        action = int(q(torch.from_numpy(self.obs)).argmax())
                next_obs, reward, terminated, truncated, _ = self.env.step(action)
                await buf.append_observation_action_reward(
                    self.episode, torch.from_numpy(self.obs), action=action, reward=float(reward)
                )
                self.episode_return += float(reward)
                if terminated or truncated:
                    status = "terminated" if terminated else "truncated"
                    await buf.end_episode(
                        self.episode, status, final_observation=torch.from_numpy(next_obs)
                    )
                    episodes.append([step + 1, self.episode_return])
                    next_obs, _ = self.env.reset()
                    await self.start(buf)
                    self.episode_return = 0.0
                self.obs = next_obs
                await pace.end_env_step()

    def evaluate(q: nn.Module) -> np.ndarray:
        envs = [gym.make(args.env_id) for _ in range(args.eval_episodes)]
        obs = [env.reset(seed=10_000 + args.seed * 1_000 + i)[0] for i, env in enumerate(envs)]
        returns = np.zeros(len(envs))
        running = list(range(len(envs)))
        while running:
            with torch.no_grad():
                batch = torch.from_numpy(np.stack([obs[i] for i in running]))
                actions = q(batch).argmax(1).tolist()
            still = []
            for i, action in zip(running, actions, strict=True):
                obs[i], reward, terminated, truncated, _ = envs[i].step(action)
                returns[i] += reward
                if not (terminated or truncated):
                    still.append(i)
            running = still
        return returns

    def atomic_write(path: Path, text: str) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            if args.durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)  # readers see the old pointer or the new one, never a mix

    def keep_only(name: str) -> None:
        """Remove every checkpoint folder but ``name``."""
        for folder in run_dir.glob("ckpt-*"):
            if folder.name != name:
                shutil.rmtree(folder)

    async def save(buf, state: dict, step: int) -> None:
        """``run_dir/ckpt-<step>/{replay/, agent.pt}``, then LATEST points at it."""
        began = time.perf_counter()
        name = f"ckpt-{step:08d}"
        folder = run_dir / name
        shutil.rmtree(folder, ignore_errors=True)  # a half-written one from a killed run
        folder.mkdir()
        await buf.save_checkpoint(folder / "replay", durable=args.durable)
        torch.save(state, folder / "agent.pt")
        if args.durable:
            fd = os.open(folder / "agent.pt", os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        atomic_write(run_dir / "LATEST", name)
        keep_only(name)
        print(f"checkpoint step {step} -> {name} ({time.perf_counter() - began:.2f}s)", flush=True)

    async def train() -> None:
        probe = gym.make(args.env_id)
        obs_dim, n_actions = probe.observation_space.shape[0], probe.action_space.n
        torch.manual_seed(args.seed)
        q = q_network(obs_dim, n_actions)
        target = copy.deepcopy(q)
        optimizer = torch.optim.Adam(q.parameters(), lr=args.learning_rate)
        pace = Pace()
        collectors = [Collector(i) for i in range(args.num_collectors)]
        episodes: list[list] = []  # [env step at its end, return]
        curve: list[dict] = []
        next_eval, next_checkpoint, wall_before = args.eval_every, args.checkpoint_every, 0.0
        latest = run_dir / "LATEST"
        if latest.exists():  # resume
            name = latest.read_text().strip()
            keep_only(name)  # drops a save the kill interrupted
            buf = await EpisodeReplayBuffer.load_checkpoint(
                run_dir / name / "replay", scratch_dir=scratch
            )
            state = torch.load(run_dir / name / "agent.pt", weights_only=True)
            q.load_state_dict(state["q"])
            target.load_state_dict(state["target"])
            optimizer.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["torch_rng"])
            pace.step, pace.updates, pace.base = state["step"], state["updates"], state["base"]
            for c, saved in zip(collectors, state["collectors"], strict=True):
                c.restore(saved)
            episodes, curve = state["episodes"], state["curve"]
            next_eval, next_checkpoint = state["next_eval"], state["next_checkpoint"]
            wall_before = state["wall"]
            stats = await buf.stats()
            print(
                f"resumed from {name}: step {pace.step}, {pace.updates} gradient steps, "
                f"{stats['valid_steps']} valid steps, {stats['in_progress']} episodes in "
                "progress continue",
                flush=True,
            )
        else:
            buf = EpisodeReplayBuffer(
                max_steps=args.buffer_size, seed=args.seed, scratch_dir=scratch
            )
            for c in collectors:
                await c.start(buf)
            print("fresh run", flush=True)
        start = time.perf_counter()
        async with buf:
            tasks = [asyncio.create_task(c.run(buf, pace, q, episodes)) for c in collectors]
            await buf.wait_for_steps(args.learning_starts)
            while await pace.begin_update():  # no env step is in flight in this loop body
                batch = await buf.sample_n_step(args.batch_size, n=args.n_step, gamma=args.gamma)
                with torch.no_grad():
                    next_obs = batch["next_observation"]
                    best = q(next_obs).argmax(1, keepdim=True)  # Double DQN
                    next_q = target(next_obs).gather(1, best).squeeze(1)
                    td_target = batch["reward"] + batch["next_discount"] * next_q
                q_taken = q(batch["observation"]).gather(1, batch["action"].unsqueeze(1))
                loss = F.smooth_l1_loss(q_taken.squeeze(1), td_target)
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(q.parameters(), args.max_grad_norm)
                optimizer.step()
                updates = pace.updates + 1  # this one included
                if updates % args.target_update == 0:
                    target.load_state_dict(q.state_dict())
                wall = wall_before + time.perf_counter() - start
                if pace.step >= next_eval:
                    next_eval = (pace.step // args.eval_every + 1) * args.eval_every
                    returns = evaluate(q)
                    recent = [r for _, r in episodes[-20:]]
                    point = {
                        "step": pace.step,
                        "updates": updates,
                        "episodes": len(episodes),
                        "recent": float(np.mean(recent)) if recent else float("nan"),
                        "eval_mean": float(returns.mean()),
                        "eval_std": float(returns.std()),
                        "loss": float(loss.detach()),
                    }
                    curve.append(point)
                    print(
                        f"step {point['step']:>7}  updates {updates:>6}  "
                        f"episodes {point['episodes']:>5}  recent return {point['recent']:.4f}  "
                        f"eval {point['eval_mean']:.4f} ± {point['eval_std']:.4f}  "
                        f"loss {point['loss']:.6f}  wall {wall:.1f}s",
                        flush=True,
                    )
                if pace.step >= next_checkpoint:
                    next_checkpoint = (
                        pace.step // args.checkpoint_every + 1
                    ) * args.checkpoint_every
                    state = {
                        "args": dataclasses.asdict(args),
                        "q": q.state_dict(),
                        "target": target.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "torch_rng": torch.get_rng_state(),
                        "step": pace.step,
                        "updates": updates,  # as after end_update() below
                        "base": pace.base,
                        "collectors": [c.state() for c in collectors],
                        "episodes": episodes,
                        "curve": curve,
                        "next_eval": next_eval,
                        "next_checkpoint": next_checkpoint,
                        "wall": wall,
                    }
                    await save(buf, state, pace.step)  # collectors wait: it is not their turn
                await pace.end_update()
            await pace.stop()
            await asyncio.gather(*tasks)
        print(f"finished: step {pace.step}, {pace.updates} gradient steps", flush=True)

    asyncio.run(train())


# =============================================================================== driver

CURVE = re.compile(
    r"step\s+(?P<step>\d+)\s+updates\s+(?P<updates>\d+)\s+episodes\s+(?P<episodes>\d+)\s+"
    r"recent return (?P<recent>\S+)\s+eval (?P<eval_mean>\S+) ± (?P<eval_std>\S+)\s+"
    r"loss (?P<loss>\S+)"
)


def run_worker(args: Args, run_dir: Path, label: str, kill_at: int | None = None) -> list[dict]:
    """Run a worker on ``run_dir``, echo its output; SIGKILL it once it prints ``kill_at``."""
    cmd = [sys.executable, "-u", __file__, *to_argv(args), "--role", "worker"]
    cmd += ["--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    points = []
    for line in proc.stdout:
        print(f"[{label}] {line.rstrip()}", flush=True)
        if m := CURVE.search(line):
            points.append(
                {
                    k: v if k in ("recent", "eval_mean", "eval_std", "loss") else int(v)
                    for k, v in m.groupdict().items()
                }
            )
            if kill_at is not None and points[-1]["step"] >= kill_at:
                proc.send_signal(signal.SIGKILL)  # no cleanup, no last checkpoint
                print(f"[{label}] --- SIGKILL at step >= {points[-1]['step']} ---", flush=True)
                break
    for _ in proc.stdout:  # whatever it wrote before the signal landed
        pass
    code = proc.wait()
    if kill_at is None and code != 0:
        raise SystemExit(f"{label}: worker exited with {code}")
    return points


def plot(args: Args, runs: dict[str, list[dict]], resumed_from: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    styles = {
        "reference": {"color": "gray", "lw": 7, "alpha": 0.3, "zorder": 1},
        "run 1": {"color": "tab:blue", "zorder": 3},
        "run 2": {"color": "tab:orange", "zorder": 2},
    }
    for label in ("reference", "run 1", "run 2"):
        points = runs.get(label)
        if not points:
            continue
        steps = [p["step"] for p in points]
        style = styles[label]
        name = "uninterrupted reference" if label == "reference" else label
        ax.plot(
            steps,
            [float(p["eval_mean"]) for p in points],
            marker="o",
            ms=3,
            **style,
            label=f"{name}: greedy eval (mean of {args.eval_episodes})",
        )
        ax.plot(
            steps,
            [float(p["recent"]) for p in points],
            ls="--",
            **style,
            label=f"{name}: training return (mean of last 20 episodes)",
        )
    killed = runs["run 1"][-1]["step"] if runs["run 1"] else 0
    ax.axvline(killed, color="tab:red", ls="--", lw=1, label=f"run 1 killed (step ~{killed})")
    ax.axvline(
        resumed_from,
        color="tab:green",
        ls=":",
        lw=1.5,
        label=f"run 2 resumed from checkpoint (step {resumed_from})",
    )
    ax.set_xlabel("env steps")
    ax.set_ylabel("return")
    ax.set_title(f"kill and resume from a checkpoint: {args.n_step}-step DQN, {args.env_id}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def driver(args: Args) -> None:
    began = time.perf_counter()
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="dqn-run-"))
    scratch_parent = Path(tempfile.mkdtemp(prefix="dqn-reference-"))
    results: dict[str, list[dict]] = {}

    failed: list[BaseException] = []

    def reference() -> None:
        try:
            results["reference"] = run_worker(args, scratch_parent, "reference")
        except BaseException as error:  # re-raised by the main thread after join()
            failed.append(error)

    try:
        side = threading.Thread(target=reference) if args.reference else None
        if side:  # the uninterrupted run goes alongside (its output is interleaved, labelled)
            side.start()
        results["run 1"] = run_worker(args, run_dir, "run 1", kill_at=args.kill_at_step)
        left = list((run_dir / "scratch").glob("replaybuf-*"))
        print(f"killed run 1 left its memmap scratch folder behind: {[p.name for p in left]}")
        for folder in left:  # SIGKILL skips every cleanup; the checkpoint is intact
            shutil.rmtree(folder)
        if (run_dir / "LATEST").exists():
            latest = (run_dir / "LATEST").read_text().strip()
            resumed_from = int(latest.split("-")[1])
            print(f"LATEST -> {latest}: run 2 resumes at step {resumed_from}")
        else:
            resumed_from = 0
            print("run 1 was killed before its first checkpoint: run 2 starts afresh")
        results["run 2"] = run_worker(args, run_dir, "run 2")
        if side:
            side.join()
            if failed:
                raise failed[0]
    finally:
        if not args.run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(scratch_parent, ignore_errors=True)

    print("\nlearning curve (step, recent return, eval return):")
    for label in ("run 1", "run 2"):
        for p in results[label]:
            print(
                f"  {label}  step {p['step']:>7}  recent {float(p['recent']):7.1f}  "
                f"eval {float(p['eval_mean']):6.1f} ± {float(p['eval_std']):5.1f}"
            )
    run1 = {p["step"]: p for p in results["run 1"]}
    run2 = {p["step"]: p for p in results["run 2"]}
    redone = sorted(set(run1) & set(run2))
    same = all(run1[s] == run2[s] for s in redone)
    print(
        f"run 2 redid {len(redone)} curve point(s) run 1 had printed after its checkpoint: "
        f"{'identical' if same else 'DIFFERENT'}"
    )
    if results["run 2"] and results["run 2"][0]["step"] <= resumed_from:
        raise SystemExit("run 2 did not continue from its checkpoint")
    match = True
    if "reference" in results:
        ref = {p["step"]: p for p in results["reference"]}
        joined = {**run1, **run2}
        match = joined == ref
        print(f"killed + resumed curve == uninterrupted curve at all {len(ref)} points: {match}")
        if not match:
            diff = [s for s in sorted(ref) if joined.get(s) != ref[s]]
            print(f"  first differing step: {diff[0] if diff else 'none (different steps)'}")
    out_dir = Path(args.out_dir) if args.out_dir else Path(__file__).resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "checkpoint_resume.png"
    plot(args, results, resumed_from, path)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"plot written to {path} (total wall {time.perf_counter() - began:.1f}s, "
        f"load average {load})"
    )
    if not (same and match):
        raise SystemExit("the resumed run did not reproduce the uninterrupted one")


if __name__ == "__main__":
    parsed = parse_args()
    if parsed.role == "worker":
        worker(parsed)
    else:
        driver(parsed)
