"""Counting how speculation goes: rounds, drafted and accepted tokens, acceptance by draft position."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpeculationStats:
    """How speculation went: rounds, drafted and accepted tokens, acceptance by draft position."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """α = accepted / drafted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def record(self, drafted: int, accepted: int) -> None:
        """Counts one round that drafted `drafted` tokens and accepted the first `accepted`."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        while len(self.drafted_per_position) < drafted:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < accepted)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per round: the accepted drafts plus the recovered or bonus token."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0
