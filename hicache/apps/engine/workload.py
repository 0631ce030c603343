"""A multi-turn chat workload: shared system prompts and conversations that grow.

Conversation ``c`` opens with system prompt ``c % system_prompts``; each turn appends a
user message to the conversation so far and asks for ``new_tokens`` tokens; the next turn
starts from that prompt plus the reply. So turn ``t + 1`` of a conversation shares all of
turn ``t`` (prompt and reply) as its prefix, and every conversation shares its system
prompt with the others that use it. Token ids are drawn from a seeded generator: the same
config always gives the same workload.

The workload is played in rounds (:meth:`ChatWorkload.play`): ``arrivals_per_round``
conversations open in each round (all in the first when unset), and every open
conversation has its next turn in each round, built from its reply in the round before.
Staggered arrivals are what lets a conversation find its system prompt already cached by
an earlier one: requests admitted together all miss what none of them has computed yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hicache.apps.engine.scheduler import GenerationRequest, RequestResult
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
    arrivals_per_round: int | None = None
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
        if self.arrivals_per_round is not None and self.arrivals_per_round < 1:
            raise ConfigError(
                f"arrivals_per_round must be >= 1 (or unset), got {self.arrivals_per_round}"
            )

    @property
    def max_sequence_tokens(self) -> int:
        """The longest sequence a conversation reaches (its last prompt and reply)."""
        per_turn = self.user_tokens_max + self.new_tokens
        return self.system_prompt_tokens + self.turns * per_turn


@dataclass(frozen=True)
class ChatTurn:
    """One request of the workload: turn ``turn`` of conversation ``conversation``."""

    conversation: int
    turn: int
    request: GenerationRequest


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
        self, serve: Callable[[int, list[ChatTurn]], list[RequestResult]]
    ) -> list[list[ChatTurn]]:
        """Play every round: ``serve(round, turns)`` must return one result per turn, in
        order. Returns the turns of each round. A failed request ends its conversation."""
        cfg = self.config
        per_round = cfg.arrivals_per_round or cfg.conversations
        waiting: dict[int, ChatTurn] = {}
        opened = 0
        rounds: list[list[ChatTurn]] = []
        while True:
            while opened < min(cfg.conversations, (len(rounds) + 1) * per_round):
                waiting[opened] = ChatTurn(opened, 0, self.first_turn(opened))
                opened += 1
            if not waiting:
                if opened == cfg.conversations:
                    return rounds
                rounds.append([])
                continue
            turns = [waiting[c] for c in sorted(waiting)]
            rounds.append(turns)
            results = serve(len(rounds) - 1, turns)
            if len(results) != len(turns):
                raise RuntimeError(f"serve returned {len(results)} results for {len(turns)}")
            waiting = {}
            for t, result in zip(turns, results):
                if result.error is None and t.turn + 1 < cfg.turns:
                    request = self.next_turn(
                        t.conversation, t.turn + 1, t.request, result.output_ids
                    )
                    waiting[t.conversation] = ChatTurn(t.conversation, t.turn + 1, request)
