"""A router's request log and stats lines, per model (what a single-model server has for its one).

- `--request-log-jsonl FILE` (the command line, `[*]` or a model's section): every model writes
  its own file, FILE with the model's name before the suffix (`requests.jsonl` ->
  `requests.tiny-a.jsonl`), in the single-model schema exactly: the model's `server_start` first,
  then its requests and its engine's throughput records. A log holds one engine's records, so its
  throughput deltas and request ids stay meaningful. The file is opened when the model loads and
  closed when it unloads; a later load appends to it, starting with a new `server_start`.
- `--log-stats-interval-ms N`: each loaded model prints its own `stats NAME | ...` line (idle
  intervals skipped, a sleeping model is idle). The pinned stats panel stays a single-model
  feature: it shows one engine's totals.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def model_log_path(path: str, name: str) -> str:
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{_UNSAFE.sub('_', name)}{p.suffix}"))


def check_model_logs(slots: list[Any]) -> None:
    """Startup: every model's log path is usable and no two models share one (ValueError)."""
    from ninfer_core.server.request_log import RequestLogError, check_log_path

    seen: dict[str, str] = {}
    for slot in slots:
        path = getattr(slot.args, "request_log_jsonl", None)
        if not path:
            continue
        mine = model_log_path(path, slot.name)
        other = seen.setdefault(str(Path(mine).resolve()), slot.name)
        if other != slot.name:
            raise ValueError(f"models {other} and {slot.name} would write the same request log {mine}")
        try:
            check_log_path(mine, slot.path)
        except RequestLogError as e:
            raise ValueError(f"model {slot.name}: {e}") from None


def open_model_log(options: Any, name: str) -> Any:
    """The model's RequestLog (sets options.request_log_jsonl to its own path), or None."""
    if not options.request_log_jsonl:
        return None
    from ninfer_core.server.request_log import RequestLog

    options.request_log_jsonl = model_log_path(options.request_log_jsonl, name)
    return RequestLog(options.request_log_jsonl, options.request_log_max_mib, options.request_log_keep)


def start_stats(loader: Any, options: Any, console: Any, name: str) -> None:
    """The model's `stats NAME |` line, stopped with the model (stop_loaded stops loader.stats)."""
    if console is None or loader.engine is None or options.log_stats_interval_ms <= 0:
        return
    from ninfer_core.server.console import StatsReporter

    loader.stats = StatsReporter(loader.engine, options.log_stats_interval_ms / 1000.0, console, label=name)
    loader.stats.start()
