"""Named model shapes for `ninfer bench`: the Hugging Face configs family plugins register
(`ninfer_register_bench_shapes`); weights are drawn at random at these shapes, nothing is downloaded.

`SHAPES` (module attribute, read on access) is {name: config} over the installed plugins;
`default_shape()` is the one a plugin marks `default=True` (else the first registered).
"""

from __future__ import annotations

from typing import Any


def _registry(host: Any = None) -> dict:
    if host is None:
        from ninfer_core.plugins import PluginHost, PluginSelection

        host = PluginHost(PluginSelection.from_sources([]))
    return host.registry("bench_shape")


def shapes(host: Any = None) -> dict[str, dict]:
    """{name: a copy of the HF config} of every registered shape."""
    out = {}
    for name, reg in _registry(host).items():
        cfg = reg.load()
        out[name] = dict(cfg)
    return out


def default_shape(host: Any = None) -> str | None:
    regs = _registry(host)
    marked = [n for n, r in regs.items() if r.extra.get("default")]
    return (marked or list(regs) or [None])[0]


def __getattr__(name: str):
    if name == "SHAPES":
        return shapes()
    raise AttributeError(name)
