"""How the stages of a pipelined forward overlapped: counters from each stage's piece spans.

Every stage reports the (start, end) of its layers for each piece of a forward (one clock for the
processes of a machine: time.monotonic). Piece j on stage s+1 overlapped piece j+1 on stage s when
their spans intersect: that is the pipelining a cut forward is for. `overlap_seconds` is the time
during which at least two stages ran layers at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OverlapCounters:
    """Totals since load (GET /stats "model" block "pipeline")."""

    stages: int
    forwards: int = 0
    cut_forwards: int = 0  # forwards cut into two pieces or more
    cut_rounds: int = 0  # decode / verify rounds cut between lanes
    pieces: int = 0
    overlapped_pieces: int = 0  # (stage, piece) pairs whose span met the previous stage's next piece
    overlap_seconds: float = 0.0
    busy_seconds: list = field(default_factory=list)  # per stage: the sum of its piece spans

    def __post_init__(self):
        if not self.busy_seconds:
            self.busy_seconds = [0.0] * self.stages

    def add(self, spans: list[list[tuple[float, float]]], how: str, round_cut: bool) -> int:
        """Count one forward from its per-stage piece spans; returns its overlapped piece pairs."""
        self.forwards += 1
        n = len(spans[0]) if spans else 0
        self.pieces += n
        if n > 1:
            self.cut_forwards += 1
            self.cut_rounds += int(round_cut)
        for s, row in enumerate(spans):
            self.busy_seconds[s] += sum(b - a for a, b in row)
        got = overlapped_pairs(spans)
        self.overlapped_pieces += got
        self.overlap_seconds += concurrent_seconds(spans)
        return got

    def as_dict(self) -> dict:
        return {"stages": self.stages, "forwards": self.forwards, "cut_forwards": self.cut_forwards,
                "cut_rounds": self.cut_rounds, "pieces": self.pieces, "overlapped_pieces": self.overlapped_pieces,
                "overlap_seconds": round(self.overlap_seconds, 6),
                "busy_seconds": [round(b, 6) for b in self.busy_seconds]}


def overlapped_pairs(spans: list[list[tuple[float, float]]]) -> int:
    """Pairs (stage s+1 piece j, stage s piece j+1) whose spans intersect."""
    got = 0
    for s in range(len(spans) - 1):
        here, there = spans[s], spans[s + 1]
        for j in range(min(len(here) - 1, len(there))):
            a0, a1 = here[j + 1]
            b0, b1 = there[j]
            if a0 < b1 and b0 < a1:
                got += 1
    return got


def concurrent_seconds(spans: list[list[tuple[float, float]]]) -> float:
    """Seconds during which two stages or more ran a piece (a sweep over every span's ends)."""
    events = sorted([(a, 1) for row in spans for a, _ in row] + [(b, -1) for row in spans for _, b in row])
    depth, since, total = 0, 0.0, 0.0
    for t, d in events:
        if depth >= 2:
            total += t - since
        depth += d
        since = t
    return total
