"""Several asyncio agents in a small text world, an n-step learner, a checkpoint and a resume.

Each agent reads a text observation, tokenizes it (a toy word hash: no model download),
chooses a tool call and gets a reward. Every step goes into one replaybuf
``EpisodeReplayBuffer`` as the agent made it: the text, its token ids (a ragged field: each
step has its own length) and the tool-call dict (a JSON-like field). A learner task samples
n-step batches while the agents act and fits a Q-function on bag-of-token features with
``nn.EmbeddingBag``, which takes the batch's nested token tensor (values and offsets) as is.
Halfway, the buffer is checkpointed, closed and loaded again, and the run goes on from it.

    python examples/llm_agents.py            # 400 episodes, 4 agents
    python examples/llm_agents.py --smoke    # a few episodes (the test suite runs this)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import zlib
from pathlib import Path

import torch
from torch import nn

from replaybuf import EpisodeReplayBuffer, Field

VOCAB = 512
TOOLS = [
    {"name": "look", "args": {}},
    {"name": "take", "args": {"item": "key"}},
    {"name": "open", "args": {"target": "door"}},
    {"name": "go", "args": {"direction": "north"}},
]
SPEC = {
    "observation": {"text": "text", "tokens": Field.ragged(torch.int64)},
    "extras": {"tool_call": "json"},
}


def tokenize(text: str) -> list[int]:
    """Word ids by hash: enough for a bag-of-words Q-function."""
    return [zlib.crc32(word.encode()) % VOCAB for word in text.lower().split()]


class TreasureRoom:
    """Take the key, open the door, go north: +1. Every turn costs 0.05; 12 turns at most."""

    def reset(self) -> str:
        self.has_key, self.open, self.turns = False, False, 0
        return "You are in a small room. A key lies on the floor. A door leads north."

    async def step(self, tool: dict) -> tuple[str, float, bool, bool]:
        await asyncio.sleep(0)  # a tool call: other agents act meanwhile
        self.turns += 1
        name, reward, done = tool["name"], -0.05, False
        if name == "take" and not self.has_key:
            self.has_key, text = True, "You pick up the key. The door is locked."
        elif name == "open" and self.has_key:
            self.open, text = True, "The key turns. The door swings open to the north."
        elif name == "go" and self.open:
            text, reward, done = "You walk north and find the treasure!", 1.0, True
        else:
            text = "Nothing happens. " + ("The door is open." if self.open else "It is quiet.")
        return text, reward, done, self.turns >= 12 and not done


class QNet(nn.Module):
    """Q-values of the tools from the mean embedding of the observation's tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, 32, mode="mean")
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(32, len(TOOLS)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens``: a nested ``[B, j]`` tensor (its values and offsets feed the bag)."""
        return self.head(self.bag(tokens.values(), tokens.offsets()[:-1]))

    def one(self, ids: list[int]) -> torch.Tensor:
        return self.head(self.bag(torch.tensor([ids]), None))


async def agent(name: str, buf: EpisodeReplayBuffer, q: QNet, episodes: int, log: list) -> None:
    env, rng = TreasureRoom(), random.Random(name)
    for _ in range(episodes):
        text = env.reset()
        e = await buf.start_episode(name)
        total, done, truncated = 0.0, False, False
        while not (done or truncated):
            tokens = tokenize(text)
            if rng.random() < 0.2:
                choice = rng.randrange(len(TOOLS))
            else:
                with torch.no_grad():
                    choice = int(q.one(tokens).argmax())
            observation = {"text": text, "tokens": tokens}
            text, reward, done, truncated = await env.step(TOOLS[choice])
            await buf.append_observation_action_reward(
                e, observation, choice, reward, {"tool_call": TOOLS[choice]}
            )
            total += reward
        final = {"text": text, "tokens": tokenize(text)}
        await buf.end_episode(e, "terminated" if done else "truncated", final)
        log.append(total)


async def learner(buf: EpisodeReplayBuffer, q: QNet, stop: asyncio.Event, n: int) -> int:
    """DQN updates on 3-step batches while the agents act: targets from replaybuf's n-step
    reward and next_discount (0 past a terminated end)."""
    opt = torch.optim.Adam(q.parameters(), lr=3e-3)
    await buf.wait_for_steps(64)
    updates = 0
    while not stop.is_set() and updates < n:
        batch = await buf.sample_n_step(64, n=3, gamma=0.95)
        obs_tokens = batch["observation", "tokens"]
        next_tokens = batch["next_observation", "tokens"]
        with torch.no_grad():
            target = batch["reward"] + batch["next_discount"] * q(next_tokens).max(-1).values
        chosen = q(obs_tokens).gather(1, batch["action"].unsqueeze(1)).squeeze(1)
        loss = nn.functional.smooth_l1_loss(chosen, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        updates += 1
        await asyncio.sleep(0)
    return updates


async def run_phase(buf: EpisodeReplayBuffer, q: QNet, agents: int, episodes: int) -> list:
    log: list[float] = []
    stop = asyncio.Event()
    learn = asyncio.create_task(learner(buf, q, stop, n=50 * episodes))
    await asyncio.gather(*(agent(f"agent{i}", buf, q, episodes, log) for i in range(agents)))
    stop.set()
    await learn
    return log


async def main(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    q = QNet()
    half = max(1, args.episodes // args.agents // 2)
    ckpt = Path(args.out_dir or tempfile.mkdtemp()) / "llm-buffer"
    buf = EpisodeReplayBuffer(20_000, spec=SPEC, seed=0)
    first = await run_phase(buf, q, args.agents, half)
    await buf.save_checkpoint(ckpt)
    stats = await buf.stats()
    batch = await buf.sample_n_step(2, n=3)
    print(
        f"phase 1: {len(first)} episodes, {stats['steps']} steps stored, mean return "
        f"{sum(first) / len(first):+.2f}"
    )
    print(f"  a batch's text: {batch['observation', 'text'][0]!r}")
    print(f"  its tool call:  {batch['tool_call'][0]}")
    print(f"  its token ids:  {batch['observation', 'tokens'][0].tolist()}")
    await buf.close()

    buf = await EpisodeReplayBuffer.load_checkpoint(ckpt)  # a new process would do the same
    assert (await buf.stats())["steps"] == stats["steps"], "the checkpoint holds every step"
    second = await run_phase(buf, q, args.agents, half)
    print(
        f"phase 2 (resumed): {len(second)} episodes, {(await buf.stats())['steps']} steps "
        f"stored, mean return {sum(second) / len(second):+.2f}"
    )
    await buf.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=400, help="episodes in all")
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="a few episodes only")
    parser.add_argument("--out-dir", default=None, help="where the checkpoint goes")
    args = parser.parse_args()
    if args.smoke:
        args.episodes = 16
    asyncio.run(main(args))
