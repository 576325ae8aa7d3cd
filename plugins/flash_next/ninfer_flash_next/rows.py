"""Where a PLE layer's n-gram rows come from (`--ngram-residency`, `--ngram-io`, `--ngram-io-depth`).

The published table is ~45 B parameters, far more than device memory, so rows are fetched per
pass: `disk` reads each token's rows from the table's file (optionally keeping recently read rows
within `--ngram-ram-mib`), `ram` holds the whole table in RAM, `ram-hot` holds the rows a hot-row
profile ranks first (within `--ngram-ram-mib`) and reads the rest from the file. Reads go through
the OS page cache (`buffered`, pread), past it (`direct`, O_DIRECT into aligned buffers) or out of a
mapping (`mmap`); up to `--ngram-io-depth` reads are in flight on a thread pool (pread releases the
GIL). Every residency returns the same rows, so the model's output does not depend on it.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

RESIDENCIES = ("disk", "ram", "ram-hot")
IO_MODES = ("buffered", "direct", "mmap")
_ALIGN = 4096  # O_DIRECT offsets, lengths and buffers are aligned to the device's block size


@dataclass
class RowCounters:
    """The `ngram_table` block of /stats: rows addressed, rows served from RAM, passes, read time."""

    rows: int = 0
    resident_rows: int = 0
    batches: int = 0
    read_seconds: float = 0.0
    latency_us: list = field(default_factory=list)  # per pass, for the p50 / p99

    def report(self) -> dict:
        lat = sorted(self.latency_us)

        def bucket(q):  # upper bound of the power-of-two bucket of the q-quantile
            if not lat:
                return 0
            v = lat[min(len(lat) - 1, int(q * len(lat)))]
            return 1 << max(0, int(v - 1).bit_length())

        return {"rows": self.rows, "resident_rows": self.resident_rows, "batches": self.batches,
                "read_seconds": self.read_seconds, "read_latency_us": {"p50": bucket(0.5), "p99": bucket(0.99)}}


@dataclass(frozen=True)
class TableFile:
    """One PLE layer's table as stored: shard byte ranges in a file, rows of `dim` values."""

    path: str
    shards: tuple[tuple[int, int, int], ...]  # (first row, rows, absolute byte offset)
    dim: int
    dtype: torch.dtype

    @property
    def rows(self) -> int:
        return sum(s[1] for s in self.shards)

    @property
    def row_bytes(self) -> int:
        return self.dim * torch.empty((), dtype=self.dtype).element_size()

    def locate(self, row: int) -> int:
        for first, n, off in self.shards:
            if first <= row < first + n:
                return off + (row - first) * self.row_bytes
        raise IndexError(f"n-gram row {row} outside the table of {self.rows} rows")


def _np_dtype(dtype: torch.dtype):
    return {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}[dtype]


class FileRows:
    """Rows read from the table's file, `depth` reads in flight."""

    def __init__(self, table: TableFile, io: str = "buffered", depth: int = 64):
        if io not in IO_MODES:
            raise ValueError(f"--ngram-io must be one of {', '.join(IO_MODES)}, not {io!r}")
        self.table, self.io, self.depth = table, io, depth
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="ngram-io") if depth > 1 else None
        self._map = None
        if io == "mmap":
            self._map = np.memmap(table.path, dtype=np.uint8, mode="r")
        elif io == "direct":
            try:
                fd = os.open(table.path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            except OSError as e:
                raise ValueError(f"--ngram-io direct: {table.path} cannot be opened with O_DIRECT ({e.strerror}); "
                                 "use --ngram-io buffered or mmap on this file system") from None
            os.close(fd)

    def _fd(self) -> int:
        fd = getattr(self._local, "fd", None)
        if fd is None:
            flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if self.io == "direct" else 0)
            fd = self._local.fd = os.open(self.table.path, flags)
            self._local.buf = mmap.mmap(-1, 2 * _ALIGN + self.table.row_bytes) if self.io == "direct" else None
        return fd

    def _read_one(self, row: int) -> bytes:
        off, n = self.table.locate(row), self.table.row_bytes
        if self._map is not None:
            return self._map[off: off + n].tobytes()
        fd = self._fd()
        if self.io == "buffered":
            return os.pread(fd, n, off)
        start = off - off % _ALIGN
        length = -(-(off + n - start) // _ALIGN) * _ALIGN
        buf = self._local.buf
        got = os.preadv(fd, [memoryview(buf)[:length]], start)
        if got < off - start + n:
            raise OSError(f"short read of n-gram row {row} from {self.table.path}")
        return bytes(buf[off - start: off - start + n])

    def read(self, rows: list[int]) -> torch.Tensor:
        """rows -> [len(rows), dim] in the stored dtype."""
        if self._pool is not None and len(rows) > 1:
            chunks = list(self._pool.map(self._read_one, rows))
        else:
            chunks = [self._read_one(r) for r in rows]
        arr = np.frombuffer(b"".join(chunks), dtype=_np_dtype(self.table.dtype)).reshape(len(rows), self.table.dim)
        t = torch.from_numpy(arr.copy())
        return t.view(torch.bfloat16) if self.table.dtype == torch.bfloat16 else t

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


class NgramRows:
    """One PLE layer's row source: `fetch(ids [T, R]) -> [T, R, dim]`, counting what it read."""

    def __init__(self, table: TableFile, residency: str = "disk", io: str = "buffered", depth: int = 64,
                 ram_mib: int | None = None, hot_rows=None, counters: RowCounters | None = None):
        if residency not in RESIDENCIES:
            raise ValueError(f"--ngram-residency must be one of {', '.join(RESIDENCIES)}, not {residency!r}")
        if not 1 <= depth <= 1024:
            raise ValueError(f"--ngram-io-depth must be in 1..1024, got {depth}")
        self.table, self.residency = table, residency
        self.counters = counters if counters is not None else RowCounters()
        self.file = FileRows(table, io, depth) if residency != "ram" else None
        self.full = None  # ram: the whole table
        self.hot: dict[int, int] = {}  # ram-hot: row -> index into hot_data
        self.hot_data = None
        self.cache: OrderedDict[int, torch.Tensor] = OrderedDict()  # disk: LRU of read rows
        per_row = table.row_bytes + 16  # a row and its index entry
        if ram_mib is None:
            ram_mib = 4096 if residency == "ram-hot" else 0
        self.cache_rows = ram_mib * (1 << 20) // per_row if residency == "disk" else 0
        if residency == "ram":
            self.full = FileRows(table, io, depth).read(list(range(table.rows)))
        elif residency == "ram-hot":
            if hot_rows is None:
                raise ValueError("--ngram-residency ram-hot needs a hot-row profile (--ngram-hot-profile PATH, "
                                 "or a table with an embedded profile)")
            budget = ram_mib * (1 << 20) // per_row
            keep = [int(r) for r in list(hot_rows)[:budget] if 0 <= int(r) < table.rows]
            keep = list(dict.fromkeys(keep))
            self.hot = {r: i for i, r in enumerate(keep)}
            self.hot_data = self.file.read(keep) if keep else None

    @classmethod
    def resident(cls, table: torch.Tensor, counters: RowCounters | None = None) -> NgramRows:
        """Rows of a table already in memory (an artifact-like source without a file: the bench's
        random weights), served as `ram` residency."""
        self = cls.__new__(cls)
        self.table = TableFile("<memory>", ((0, table.shape[0], 0),), table.shape[1], table.dtype)
        self.residency, self.file, self.full = "ram", None, table
        self.hot, self.hot_data, self.cache, self.cache_rows = {}, None, OrderedDict(), 0
        self.counters = counters if counters is not None else RowCounters()
        return self

    def fetch(self, ids: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        flat = ids.reshape(-1).tolist()
        c = self.counters
        c.rows += len(flat)
        c.batches += 1
        if self.full is not None:
            out = self.full[ids.reshape(-1).to(self.full.device)]
            c.resident_rows += len(flat)
        else:
            uniq = list(dict.fromkeys(flat))
            got: dict[int, torch.Tensor] = {}
            missing = []
            for r in uniq:
                if r in self.hot:
                    got[r] = self.hot_data[self.hot[r]]
                elif r in self.cache:
                    self.cache.move_to_end(r)
                    got[r] = self.cache[r]
                else:
                    missing.append(r)
            miss = set(missing)
            c.resident_rows += sum(1 for r in flat if r not in miss)
            if missing:
                read = self.file.read(missing)
                for r, row in zip(missing, read):
                    got[r] = row
                    if self.cache_rows:
                        self.cache[r] = row
                        if len(self.cache) > self.cache_rows:
                            self.cache.popitem(last=False)
            out = torch.stack([got[r] for r in flat])
        dt = time.perf_counter() - t0
        c.read_seconds += dt
        c.latency_us.append(dt * 1e6)
        if len(c.latency_us) > 4096:
            del c.latency_us[:2048]
        return out.reshape(*ids.shape, self.table.dim)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
