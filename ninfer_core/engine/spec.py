"""The speculative-backend contract: what a drafter plugin gives the engine's round driver.

A backend is registered through `ninfer_register_spec_backends` (`register("mtp",
"ninfer_spec_mtp.backend:MtpBackend")`) and picked by `--spec NAME`. It reaches the model family
only through `ninfer_core.engine.model_api` (draft heads, `embed`, `logits`, hidden states of the
target's forwards), never by importing a family plugin.

Each round the driver asks the backend for drafts of every decode-ready lane that may draft
(`propose`), verifies all lanes' drafts in one batched forward, accepts (greedy: longest prefix equal
to the target's picks; sampled: the coupled rejection test in `ninfer_core.engine.sampler`),
commits the accepted prefix on the runner and reports what happened (`observe_round`).

A backend that conditions on the target's hidden states (DFlash) names the layers in
`target_layers`: every target forward of a lane then asks for those layer outputs, and the engine
hands the backend the rows of the positions that forward committed (`observe_target`): a prefill
chunk's every row, a round's first `kept` rows (the lane's last token and its accepted drafts).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class DraftLane:
    """One lane as a backend sees it at the start of a round.

    `token` is the lane's last committed token, at `position` (the positions before it are in
    the lane's KV and state slot); drafts are the tokens after it. At most `max_drafts` of them
    can be verified this round (the request's remaining output and context)."""

    request_id: str
    slot: int
    tables: Mapping[str, Sequence[int]]
    position: int
    token: int
    max_drafts: int
    history: Sequence[int] = ()  # the lane's prompt and output ids so far (read only)


@dataclass
class Proposal:
    """Drafts for one lane. `probs` [k, vocab]: the distribution each draft was drawn from, when
    the backend sampled them; None for deterministic (argmax) drafts."""

    tokens: list[int] = field(default_factory=list)
    probs: Any = None


@dataclass
class RoundReport:
    """What the driver tells the backend after a round: the verified width (drafts + 1), the batch
    size, the round's seconds and, per lane that drafted through the backend, the drafts it sent
    and how many of them were accepted."""

    width: int
    batch: int
    seconds: float
    lanes: list[tuple[str, int, int]] = field(default_factory=list)  # (request id, drafted, accepted)


class SpecBackend(ABC):
    """A speculative drafter. `draft_tokens` is K, the most drafts a round proposes per lane."""

    name: str = ""
    draft_tokens: int = 0
    # target layer outputs (model layer indices) the backend reads from every forward of a lane
    target_layers: tuple[int, ...] = ()

    @classmethod
    def check_options(cls, options: Any) -> None:
        """Refuse option combinations before the server binds its port (ValueError with the reason)."""

    @classmethod
    def load(cls, runner, artifact, options: Any = None) -> "SpecBackend":
        """Build the backend for a loaded runner (before the engine allocates the cache).

        `options` holds every serve option plugins added (`ninfer_add_serve_options`)."""
        return cls()

    @property
    def verify_widths(self) -> tuple[int, ...]:
        """The verify widths (drafts + 1) rounds will use, so the runner can prepare them."""
        return (self.draft_tokens + 1,)

    @abstractmethod
    def propose(self, lanes: Sequence[DraftLane]) -> list[Proposal]:
        """Drafts for every lane (at most `lane.max_drafts` each), in one batched call."""

    def round_width(self, lanes: Sequence[DraftLane], proposals: Sequence[Proposal]) -> int | None:
        """The most drafts per lane to verify this round (an adaptive width), or None for all."""
        return None

    def observe_round(self, report: RoundReport) -> None:
        """Called after every round that verified drafts (costs and survival for adaptive widths)."""

    def observe_target(self, request_id: str, start: int, hidden: Mapping[int, Any]) -> None:
        """The target's outputs of `target_layers` ({layer: [n, hidden]}) at the committed positions
        start .. start+n-1 of one lane (called only when `target_layers` is not empty). Positions a
        lane reused from the context cache never ran in its forwards: their rows are never seen."""

    def lane_finished(self, request_id: str) -> None:
        """A request ended: drop what the backend keeps for it."""

    def describe(self) -> dict:
        """What server_start, /props and the logs report about the backend."""
        return {"backend": self.name, "draft_tokens": self.draft_tokens}

    def request_facts(self, request_id: str) -> dict:
        """Backend-specific facts of one request for its request_done record (adaptive widths)."""
        return {}


@dataclass
class SpecStats:
    """One request's speculative counters (spec "Structured request log": request_done.speculative)."""

    rounds: int = 0  # rounds that verified drafts for this request
    drafted: int = 0
    accepted: int = 0
    fallback_steps: int = 0  # rounds this request decoded without drafts while speculation was on
    accepted_per_position: list[int] = field(default_factory=list)
    model_rounds: int = 0
    model_drafted: int = 0
    model_accepted: int = 0
    ngram_rounds: int = 0
    ngram_drafted: int = 0
    ngram_accepted: int = 0
    archive_rounds: int = 0
    archive_drafted: int = 0
    archive_accepted: int = 0

    def record(self, source: str, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            self.fallback_steps += 1
            return
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        while len(self.accepted_per_position) < drafted:
            self.accepted_per_position.append(0)
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        if source == "model":
            self.model_rounds += 1
            self.model_drafted += drafted
            self.model_accepted += accepted
        else:
            self.ngram_rounds += 1
            self.ngram_drafted += drafted
            self.ngram_accepted += accepted
            if source == "archive":
                self.archive_rounds += 1
                self.archive_drafted += drafted
                self.archive_accepted += accepted

    @property
    def any(self) -> bool:
        return self.rounds > 0 or self.fallback_steps > 0
