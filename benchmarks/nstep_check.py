"""W2 correctness: do n-step samples stop at episode ends and bootstrap correctly?

Every implementation is filled with the same toy episodes (1 to 6 steps, terminated and
truncated alternately), then sampled many times. Observation ``[100 e + t, ...]`` names the
step, so each sampled transition is checked against the exact answer, n = 3, gamma = 0.5:

* ``reward``: sum_{k < m} gamma^k r_{t+k} with m = min(n, T - t) (never past the episode);
* ``next observation``: obs_{t+m};
* ``bootstrap``: the factor the learner multiplies Q(next observation) by, as that library
  tells it to (its discount and done flags): 0 when obs_{t+m} ends a *terminated* episode,
  gamma^m otherwise (a truncated episode bootstraps from its final observation).

A peer that returns no per-sample discount is read as gamma^n (its learner has nothing else).
``check`` returns the counts of wrong items per quantity and a few examples.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import peers
import torch

N, GAMMA = 3, 0.5
LENGTHS = [1, 2, 3, 4, 5, 6, 2, 1]  # episode e is terminated when e is even, else truncated
SAMPLE_BATCH, DRAWS = 64, 16
Draw = Callable[[], dict[str, np.ndarray]]


def toy_episodes() -> peers.Episodes:
    count, longest = len(LENGTHS), max(LENGTHS)
    obs = torch.full((count, longest + 1, 2), -1.0)
    reward = torch.zeros(count, longest)
    for e, length in enumerate(LENGTHS):
        ids = 100.0 * e + torch.arange(length + 1, dtype=torch.float32)
        obs[e, : length + 1] = ids.unsqueeze(1).expand(-1, 2)
        reward[e, :length] = 2.0 ** torch.arange(length, dtype=torch.float32) + 0.25 * e
    return peers.Episodes(
        obs=obs,
        action=torch.zeros(count, longest, 1),
        reward=reward,
        length=list(LENGTHS),
        terminated=[e % 2 == 0 for e in range(count)],
    )


def expected(eps: peers.Episodes, e: int, t: int, n: int = N, gamma: float = GAMMA) -> dict:
    length = eps.length[e]
    m = min(n, length - t)
    ret = sum(gamma**k * float(eps.reward[e, t + k]) for k in range(m))
    ends = t + m == length
    bootstrap = 0.0 if ends and eps.terminated[e] else gamma**m
    return {"reward": ret, "next_id": 100 * e + t + m, "bootstrap": bootstrap, "m": m}


def check(name: str, draw: Draw, eps: peers.Episodes, draws: int = DRAWS) -> dict[str, Any]:
    """Sample ``draws`` batches with ``draw`` and count the items that are wrong."""
    wrong = {"start": 0, "reward": 0, "next_obs": 0, "bootstrap": 0}
    bad_items, checked, seen = 0, 0, set()
    examples: list[dict[str, Any]] = []
    for _ in range(draws):
        got = draw()
        for i in range(len(got["start_id"])):
            start = round(float(got["start_id"][i]))
            e, t = divmod(start, 100)
            checked += 1
            if not (0 <= e < eps.count and 0 <= t < eps.length[e]):
                wrong["start"] += 1
                bad_items += 1
                continue
            seen.add((e, t))
            want = expected(eps, e, t)
            errors = []
            if abs(float(got["reward"][i]) - want["reward"]) > 1e-4:
                errors.append("reward")
            if round(float(got["next_id"][i])) != want["next_id"]:
                errors.append("next_obs")
            if abs(float(got["bootstrap"][i]) - want["bootstrap"]) > 1e-4:
                errors.append("bootstrap")
            for kind in errors:
                wrong[kind] += 1
            if errors:
                bad_items += 1
                if len(examples) < 4 and (e, t) not in {x["step"] for x in examples}:
                    examples.append(
                        {
                            "step": (e, t),
                            "episode": f"{eps.length[e]} steps, "
                            + ("terminated" if eps.terminated[e] else "truncated"),
                            "wrong": errors,
                            "got": {
                                "reward": round(float(got["reward"][i]), 4),
                                "next_obs": round(float(got["next_id"][i]), 1),
                                "bootstrap": round(float(got["bootstrap"][i]), 4),
                            },
                            "want": {k: want[k] for k in ("reward", "next_id", "bootstrap")},
                        }
                    )
    return {
        "name": name,
        "checked": checked,
        "distinct_steps": len(seen),
        "steps": eps.steps,
        "wrong_items": bad_items,
        "wrong": wrong,
        "examples": examples,
        "correct": bad_items == 0 and checked > 0,
    }


def summary(report: dict[str, Any]) -> str:
    if report.get("skipped"):
        return f"{report['name']}: skipped ({report['skipped']})"
    if report["correct"]:
        return f"{report['name']}: correct ({report['checked']} samples)"
    kinds = ", ".join(f"{k} {v}" for k, v in report["wrong"].items() if v)
    return f"{report['name']}: WRONG {report['wrong_items']}/{report['checked']} ({kinds})"


# --------------------------------------------------------------------------- adapters
def _np(t: Any) -> np.ndarray:
    return t.detach().reshape(len(t), -1)[:, 0].numpy() if t.dim() > 1 else t.detach().numpy()


def floor_draw(eps: peers.Episodes, respect_ends: bool = True) -> Draw:
    floor = peers.FlatNStep(eps, N, GAMMA, respect_ends=respect_ends)

    def draw() -> dict[str, np.ndarray]:
        s = floor.sample(SAMPLE_BATCH)
        return {
            "start_id": _np(s["observation"]),
            "reward": _np(s["reward"]),
            "next_id": _np(s["next_observation"]),
            "bootstrap": _np(s["discount"]),
        }

    return draw


def replaybuf_draw(eps: peers.Episodes, scratch: Path) -> tuple[Draw, Callable[[], None]]:
    built, _ = peers.replaybuf_nstep(eps, N, GAMMA, SAMPLE_BATCH, scratch)

    def draw() -> dict[str, np.ndarray]:
        s = built.sample()
        return {
            "start_id": _np(s["observation"]),
            "reward": _np(s["reward"]),
            "next_id": _np(s["next_observation"]),
            "bootstrap": _np(s["next_discount"]),
        }

    return draw, built.close


def cpprb_draw(eps: peers.Episodes) -> Draw:
    built = peers.cpprb_nstep(eps, N, GAMMA, SAMPLE_BATCH)

    def draw() -> dict[str, np.ndarray]:
        s = built.sample()
        return {
            "start_id": _np(s["obs"]),
            "reward": _np(s["rew"]),
            "next_id": _np(s["next_obs"]),
            "bootstrap": GAMMA**N * (1 - _np(s["done"])),
        }

    return draw


def sb3_draw(eps: peers.Episodes) -> Draw:
    built = peers.sb3_nstep(eps, N, GAMMA, SAMPLE_BATCH, use_add=True)

    def draw() -> dict[str, np.ndarray]:
        s = built.sample()
        return {
            "start_id": _np(s.observations),
            "reward": _np(s.rewards),
            "next_id": _np(s.next_observations),
            "bootstrap": _np(s.discounts) * (1 - _np(s.dones)),
        }

    return draw


def torchrl_draw(eps: peers.Episodes) -> Draw:
    built = peers.torchrl_nstep(eps, N, GAMMA, SAMPLE_BATCH)

    def draw() -> dict[str, np.ndarray]:
        s = built.sample()
        return {
            "start_id": _np(s["observation"]),
            "reward": _np(s["next", "reward"]),
            "next_id": _np(s["next", "observation"]),
            "bootstrap": _np(s["gamma"]) * (1 - _np(s["next", "terminated"].float())),
        }

    return draw


def check_all(scratch: Path) -> dict[str, dict[str, Any]]:
    """The check for the floor, replaybuf and every installed peer, keyed by name."""
    np.random.seed(0)  # SB3 and cpprb sample with NumPy's global generator
    torch.manual_seed(0)
    eps = toy_episodes()
    reports: dict[str, dict[str, Any]] = {}
    reports[peers.FLOOR] = check(peers.FLOOR, floor_draw(eps), eps)
    draw, close = replaybuf_draw(eps, scratch)
    try:
        reports["replaybuf"] = check("replaybuf", draw, eps)
    finally:
        close()
    have = peers.available()
    for name, maker in ((peers.CPPRB, cpprb_draw), (peers.SB3, sb3_draw)):
        if have[name]:
            reports[name] = check(name, maker(eps), eps)
        else:
            reports[name] = {"name": name, "skipped": "not installed", "correct": None}
    reports[peers.TORCHRL] = check(peers.TORCHRL, torchrl_draw(eps), eps)
    return reports
