"""A multi-turn chat workload: shared system prompts and conversations that grow.

Conversation ``c`` opens with system prompt ``c % system_prompts``; each turn appends a
user message to the conversation so far and asks for ``new_tokens`` tokens; the next turn
starts from that prompt plus the reply. So turn ``t + 1`` of a conversation shares all of
turn ``t`` (prompt and reply) as its prefix, and every conversation shares its system
prompt with the others that use it. Token ids are drawn from a seeded generator: the same
config always gives the same workload.

The workload is played in rounds: round ``t`` holds turn ``t`` of every conversation, and
needs the replies of round ``t - 1`` to build its prompts (:meth:`ChatWorkload.play`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hicache.engine.scheduler import GenerationRequest, RequestResult
from hicache.types import ConfigError


@dataclass(frozen=True)
class ChatWorkloadConfig:
    """Sizes of a chat workload (tokens, unless named otherwise)."""

    conversations: int = 8
    turns: int = 3
    system_prompts: int = 2
    system_prompt_tokens: int = 256
    user_tokens_min: int = 24
    user_tokens_max: int = 64
    new_tokens: int = 8
    vocab_size: int = 256
    seed: int = 0

    def validate(self) -> None:
        """Raise ConfigError naming the first value out of range."""
        for name in ("conversations", "turns", "system_prompts", "new_tokens", "vocab_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"chat workload {name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.user_tokens_min <= self.user_tokens_max:
            raise ConfigError(
                f"need 1 <= user_tokens_min <= user_tokens_max, got {self.user_tokens_min}, "
                f"{self.user_tokens_max}"
            )
        if self.system_prompt_tokens < 0:
            raise ConfigError("system_prompt_tokens must be >= 0")

    @property
    def max_sequence_tokens(self) -> int:
        """The longest sequence a conversation reaches (its last prompt and reply)."""
        per_turn = self.user_tokens_max + self.new_tokens
        return self.system_prompt_tokens + self.turns * per_turn


class ChatWorkload:
    """The requests of a :class:`ChatWorkloadConfig`, turn by turn."""

    def __init__(self, config: ChatWorkloadConfig | None = None) -> None:
        self.config = config or ChatWorkloadConfig()
        self.config.validate()
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, 0])
        self.system_prompts = [
            rng.integers(0, cfg.vocab_size, cfg.system_prompt_tokens).tolist()
            for _ in range(cfg.system_prompts)
        ]

    def user_message(self, conversation: int, turn: int) -> list[int]:
        """The user tokens of one turn (fixed by the seed, the conversation and the turn)."""
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, 1, conversation, turn])
        n = int(rng.integers(cfg.user_tokens_min, cfg.user_tokens_max + 1))
        return rng.integers(0, cfg.vocab_size, n).tolist()

    @staticmethod
    def rid(conversation: int, turn: int) -> str:
        return f"c{conversation}-t{turn}"

    def first_turn(self, conversation: int) -> GenerationRequest:
        system = self.system_prompts[conversation % self.config.system_prompts]
        return GenerationRequest.of(
            self.rid(conversation, 0),
            system + self.user_message(conversation, 0),
            self.config.new_tokens,
        )

    def next_turn(
        self, conversation: int, turn: int, previous: GenerationRequest, reply: list[int]
    ) -> GenerationRequest:
        """Turn ``turn`` of a conversation whose previous turn was ``previous``, answered
        with ``reply``."""
        prompt = [*previous.prompt_ids, *reply, *self.user_message(conversation, turn)]
        return GenerationRequest.of(self.rid(conversation, turn), prompt, self.config.new_tokens)

    def play(
        self, serve: Callable[[int, list[GenerationRequest]], list[RequestResult]]
    ) -> list[list[GenerationRequest]]:
        """Play every round: ``serve(round, requests)`` must return one result per request,
        in order. Returns the requests of each round. A failed request ends its
        conversation."""
        cfg = self.config
        current = {c: self.first_turn(c) for c in range(cfg.conversations)}
        rounds = []
        for turn in range(cfg.turns):
            conversations = sorted(current)
            requests = [current[c] for c in conversations]
            if not requests:
                break
            rounds.append(requests)
            results = serve(turn, requests)
            if len(results) != len(requests):
                raise RuntimeError(f"serve returned {len(results)} results for {len(requests)}")
            current = {}
            if turn + 1 == cfg.turns:
                break
            for c, request, result in zip(conversations, requests, results):
                if result.error is None:
                    current[c] = self.next_turn(c, turn + 1, request, result.output_ids)
        return rounds
