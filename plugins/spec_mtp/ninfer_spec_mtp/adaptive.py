"""--adaptive-mtp: the verify width (drafts per round) chosen from min(3, K)..K every round.

Each request tracks, position by position, how often a draft survives given that the one before
it did, with a fast and a slow moving average (their mean is the estimate). Each width is priced
by the round time measured at that width and batch size; a width not yet run is priced from a
relative cost shape scaled by the widths that have run. The width with the most expected committed
tokens per second wins; the width in use changes only after a candidate has won several rounds in
a row, and it is probed one wider when every row has kept all its drafts for a while.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FAST, SLOW = 0.5, 0.05  # moving-average weights of a new observation
PRIOR = 0.7  # survival assumed before a position was observed
SWITCH_AFTER = 4  # rounds a new width must win in a row before it is used
PROBE_AFTER = 8  # rounds with every draft surviving before one more draft is probed
COST_EMA = 0.2
SHAPE_PER_DRAFT = 0.05  # unmeasured width w costs (1 + 0.05 w) relative to a measured one at w = 0


@dataclass
class _Request:
    fast: list[float]
    slow: list[float]
    rounds_per_width: dict[int, int] = field(default_factory=dict)
    transitions: int = 0
    last_width: int | None = None


class AdaptiveWidth:
    def __init__(self, k: int):
        self.k = k
        self.lo = min(3, k)
        self.widths = tuple(range(self.lo, k + 1))
        self.width = k  # start optimistic; the measurements pull it down
        self.costs: dict[tuple[int, int], float] = {}  # (width, batch) -> seconds (moving average)
        self.requests: dict[str, _Request] = {}
        self._candidate: int | None = None
        self._wins = 0
        self._full = 0

    def _req(self, rid: str) -> _Request:
        r = self.requests.get(rid)
        if r is None:
            r = self.requests[rid] = _Request([PRIOR] * self.k, [PRIOR] * self.k)
        return r

    def survival(self, rid: str) -> list[float]:
        r = self._req(rid)
        return [(f + s) / 2 for f, s in zip(r.fast, r.slow)]

    @staticmethod
    def expected_tokens(p: list[float], w: int) -> float:
        """Committed tokens of a round verifying w drafts: the bonus token plus each surviving draft."""
        total, run = 1.0, 1.0
        for j in range(w):
            run *= p[j]
            total += run
        return total

    def cost(self, w: int, b: int) -> float:
        known = self.costs.get((w, b))
        if known is not None:
            return known
        same_b = [(kw, c) for (kw, kb), c in self.costs.items() if kb == b]
        if not same_b:  # nothing at this batch: a batch-independent shape is enough to compare widths
            return 1.0 + SHAPE_PER_DRAFT * w
        kw, c = min(same_b, key=lambda wc: abs(wc[0] - w))
        return c * (1.0 + SHAPE_PER_DRAFT * w) / (1.0 + SHAPE_PER_DRAFT * kw)

    def best(self, rids: list[str], b: int) -> int:
        ps = [self.survival(r) for r in rids] or [[PRIOR] * self.k]

        def rate(w):
            return sum(self.expected_tokens(p, w) for p in ps) / len(ps) / self.cost(w, b)

        return max(self.widths, key=lambda w: (rate(w), -w))

    def choose(self, rids: list[str], b: int) -> int:
        best = self.best(rids, b)
        if self._full >= PROBE_AFTER and self.width < self.k:
            best, self._full = self.width + 1, 0  # every draft kept surviving: try one more
            self._candidate, self._wins = best, SWITCH_AFTER
        if best == self.width:
            self._candidate, self._wins = None, 0
        elif best == self._candidate:
            self._wins += 1
        else:
            self._candidate, self._wins = best, 1
        if self._candidate is not None and self._wins >= SWITCH_AFTER:
            self.width, self._candidate, self._wins = self._candidate, None, 0
        for rid in rids:
            r = self._req(rid)
            if r.last_width is not None and r.last_width != self.width:
                r.transitions += 1
            r.last_width = self.width
            r.rounds_per_width[self.width] = r.rounds_per_width.get(self.width, 0) + 1
        return self.width

    def observe(self, report) -> None:
        w = report.width - 1
        key = (w, report.batch)
        old = self.costs.get(key)
        self.costs[key] = report.seconds if old is None else old + COST_EMA * (report.seconds - old)
        all_full = bool(report.lanes)
        for rid, drafted, accepted in report.lanes:
            r = self._req(rid)
            for j in range(min(accepted + 1, drafted, self.k)):  # position j is seen when all before it survived
                x = 1.0 if j < accepted else 0.0
                r.fast[j] += FAST * (x - r.fast[j])
                r.slow[j] += SLOW * (x - r.slow[j])
            all_full = all_full and accepted == drafted
        self._full = self._full + 1 if all_full else 0

    def forget(self, rid: str) -> None:
        self.requests.pop(rid, None)

    def facts(self, rid: str) -> dict:
        r = self.requests.get(rid)
        if r is None:
            return {"window_transitions": 0, "rounds_per_window": {}}
        return {"window_transitions": r.transitions,
                "rounds_per_window": {str(w): n for w, n in sorted(r.rounds_per_width.items())}}
