"""Multi-turn conversations as token ids, and the phases one engine start runs them in.

A conversation (one user): the shared system prompt S (the same ids for every user and every
run: it stays in vLLM's GPU prefix cache, as a real system prompt does), a private context D (a
long chat so far), then per turn t a user message Q_t. The prompt of turn t is
``S + D + (Q_0 + A_0) + ... + (Q_{t-1} + A_{t-1}) + Q_t`` where A_k is a *stand-in* for the answer:
ids from the same seeded generator, not the model's output, so every mode sees the same prompts
and prompt lengths do not depend on outputs (connectors store prompts only, so the answer's KV
is recomputed in every mode anyway).

Fresh conversations per run: D, Q and A are drawn from ``seed`` (string-seeded ``random``, the
same on every machine and Python), so two runs never share cache state beyond S.

Phases of one run (closed loop; a phase is a list of (user, turn) items taken in order by a
fixed number of workers, a user's next turn waits for its previous one):

- ``warm``: turn 0 of every user at the highest concurrency (fills the GPU cache and the tiers;
  reported but not a headline number: every mode recomputes it);
- then one phase per concurrency level, in the order given (default 32, 8, 1), each serving
  ``turns`` more turns of every user (level 1: only the first ``c1_users`` users, so that it stays
  short; their prefixes were evicted from the GPU by the users served after them).

The history between two turns of a user (all other users' contexts) is sized larger than the
GPU KV cache, so each turn's prefix must come from a connector or be recomputed.
"""
from __future__ import annotations

import math

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkloadParams:
    """Sizes of one run's conversations (tokens) and its phases."""

    users: int = 128
    system_tokens: int = 1024
    context_tokens: int = 1024
    turn_tokens: int = 128
    answer_tokens: int = 32
    concurrency: tuple[int, ...] = (32, 8, 1)
    turns: int = 1
    c1_users: int = 16
    warm_concurrency: int = 0  # 0: the highest level
    vocab_size: int = 128256
    system_seed: int = 0

    def __post_init__(self) -> None:
        for name in ("users", "turn_tokens", "answer_tokens", "turns", "c1_users"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.system_tokens < 0 or self.context_tokens < 0:
            raise ValueError("system_tokens and context_tokens must be >= 0")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if self.vocab_size < 4096:
            raise ValueError("vocab_size must be >= 4096 (ids are drawn from [1000, vocab - 1000))")

    @property
    def warm_c(self) -> int:
        """Concurrency of the warm phase."""
        return self.warm_concurrency or max(self.concurrency)

    @property
    def turns_per_user(self) -> int:
        """Turns of a user served by all phases (warm included)."""
        return 1 + len(self.concurrency) * self.turns

    def prompt_len(self, turn: int) -> int:
        """Prompt tokens of turn ``turn`` (0 = the warm phase's)."""
        return self.system_tokens + self.context_tokens + turn * (self.turn_tokens + self.answer_tokens) + self.turn_tokens

    @property
    def max_seq_len(self) -> int:
        """Longest prompt + output of a run: must fit ``--max-model-len``."""
        return self.prompt_len(self.turns_per_user - 1) + self.answer_tokens


@dataclass(frozen=True)
class Phase:
    """One closed-loop phase: ``items`` are (user, turn) in the order workers take them."""

    name: str
    concurrency: int
    items: tuple[tuple[int, int], ...] = field(repr=False)


class Workload:
    """The token ids of one run's conversations (deterministic in ``seed``), built lazily per user."""

    def __init__(self, params: WorkloadParams, seed: int) -> None:
        self.p = params
        self.seed = seed
        self._lo, self._hi = 1000, params.vocab_size - 1000
        self.system = self._ids(f"system:{params.system_seed}", params.system_tokens)
        self._context: dict[int, list[int]] = {}

    def _ids(self, tag: str, n: int) -> list[int]:
        rng = random.Random(tag)  # str seeds hash with sha512: the same everywhere
        lo, hi = self._lo, self._hi
        return [rng.randrange(lo, hi) for _ in range(n)]

    def context(self, user: int) -> list[int]:
        """The user's private context D."""
        if user not in self._context:
            self._context[user] = self._ids(f"{self.seed}:ctx:{user}", self.p.context_tokens)
        return self._context[user]

    def message(self, user: int, turn: int) -> list[int]:
        """The user's message Q of a turn."""
        return self._ids(f"{self.seed}:q:{user}:{turn}", self.p.turn_tokens)

    def answer(self, user: int, turn: int) -> list[int]:
        """The stand-in answer A of a turn that the next turn's history carries."""
        return self._ids(f"{self.seed}:a:{user}:{turn}", self.p.answer_tokens)

    def prompt(self, user: int, turn: int) -> list[int]:
        """Token ids of the prompt of ``turn`` (history + the new message)."""
        ids = self.system + self.context(user)
        for k in range(turn):
            ids += self.message(user, k) + self.answer(user, k)
        return ids + self.message(user, turn)

    def phases(self) -> list[Phase]:
        """The run's phases in order: warm, then one per concurrency level."""
        return plan_phases(self.p)


def plan_phases(p: WorkloadParams) -> list[Phase]:
    """Phases of a run with these parameters: warm, then one per concurrency level."""
    out = [Phase("warm", p.warm_c, tuple((u, 0) for u in range(p.users)))]
    seen: dict[str, int] = {}
    for i, c in enumerate(p.concurrency):
        users = range(min(p.c1_users, p.users)) if c == 1 else range(p.users)
        first = 1 + i * p.turns
        name = f"c{c}"
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name += f"-{seen[name]}"
        out.append(Phase(name, c, tuple((u, t) for t in range(first, first + p.turns) for u in users)))
    return out


def resident_gpu_blocks(params: WorkloadParams, sz: dict, block_size: int = 16) -> int:
    """GPU blocks for a cache that never evicts a prefix in this run (``none-resident``): every distinct
    prompt token of the run, each user's last answer and one partly filled block per user, plus 10%.
    ``sz`` is what ``sizes`` returns for ``params``."""
    tokens = sz["stored_tokens"] + params.users * (params.answer_tokens + block_size)
    return math.ceil(1.1 * tokens / block_size)


def sizes(params: WorkloadParams, kv_bytes_per_token: int, gpu_blocks: int, block_size: int = 16) -> dict:
    """What a run holds and moves: for the dry run and for sizing the CPU tier and the GPU cache.

    ``stored_tokens``: distinct prompt tokens of one run (the system prompt once, each user's
    longest prompt beyond it): what a prompt-only store holds at the end of the run.
    ``evict_ratio``: tokens of the other users between two turns of a user (at turn 1, the
    smallest) over the GPU KV cache; > 1 means a user's prefix left the GPU before its next turn.
    """
    phases = plan_phases(params)
    last_turn = {u: 0 for u in range(params.users)}
    for ph in phases:
        for u, t in ph.items:
            last_turn[u] = max(last_turn[u], t)
    stored = params.system_tokens + sum(params.prompt_len(t) - params.system_tokens for t in last_turn.values())
    gpu_tokens = gpu_blocks * block_size
    per_user_turn1 = params.context_tokens + params.turn_tokens + params.answer_tokens
    out_phases = []
    for ph in phases:
        lens = [params.prompt_len(t) for _, t in ph.items]
        out_phases.append({"name": ph.name, "concurrency": ph.concurrency, "requests": len(ph.items),
                           "prompt_len_min": min(lens), "prompt_len_max": max(lens),
                           "prompt_tokens": sum(lens), "output_tokens": len(ph.items) * params.answer_tokens})
    return {
        "stored_tokens": stored, "stored_bytes": stored * kv_bytes_per_token,
        "gpu_cache_tokens": gpu_tokens, "history_over_gpu": round(stored / gpu_tokens, 2),
        "evict_ratio": round((params.users - 1) * per_user_turn1 / gpu_tokens, 2),
        "running_tokens_max": max(params.concurrency + (params.warm_c,)) * params.max_seq_len,
        "max_seq_len": params.max_seq_len, "phases": out_phases,
    }
