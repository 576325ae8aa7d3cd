"""Loading a family's modules from an artifact, gpt-fast style: the modules are built on the meta
device, then every parameter is replaced by the stored tensor (cast to the run dtype and device).

`fuse_experts` turns per-expert MoE weights (`...mlp.experts.N.gate_proj.weight` ...) into the fused
`gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I] parameters of `ninfer_core.nn.moe.Experts`.
"""

from __future__ import annotations

import re

import torch

from ninfer_core.quant.weight import QuantizedWeight

_PER_EXPERT = re.compile(
    r"^(?P<pre>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


class LoadError(ValueError):
    """The artifact's tensors do not fit the model its config describes."""


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert MoE weights -> the fused [E, 2I, H] / [E, H, I] parameters (a copy)."""
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for n in [n for n in state if _PER_EXPERT.match(n)]:
        m = _PER_EXPERT.match(n)
        groups.setdefault(m["pre"], {}).setdefault(m["proj"], {})[int(m["e"])] = state.pop(n)
    for pre, projs in groups.items():
        try:
            e = len(projs["gate_proj"])
            gate = [projs["gate_proj"][i] for i in range(e)]
            up = [projs["up_proj"][i] for i in range(e)]
            down = [projs["down_proj"][i] for i in range(e)]
        except KeyError as exc:
            raise LoadError(f"{pre}: incomplete per-expert weights (missing {exc})") from None
        state[pre + ".gate_up_proj"] = _stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        state[pre + ".down_proj"] = _stack(down)
    return state


def _stack(parts: list):
    if isinstance(parts[0], QuantizedWeight):  # encoded experts: stack the packed rows and scales
        f = parts[0]
        return QuantizedWeight(torch.stack([p.qdata for p in parts]), torch.stack([p.scale for p in parts]),
                               f.enc, f.in_features, f.dtype)
    return torch.stack(parts)


def assign_weights(module: torch.nn.Module, state: dict, dtype: torch.dtype, device: torch.device, skip=()) -> None:
    """Replace every parameter of `module` (but `skip`) by `state[name]` in `dtype` on `device`.

    LoadError names the missing and unexpected tensors, or the first whose shape differs."""
    expected = {n: p for n, p in module.named_parameters() if n not in skip}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise LoadError(
            f"weights do not match the config: missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    for name, param in expected.items():
        t = state[name]
        if tuple(t.shape) != tuple(param.shape):
            raise LoadError(f"{name}: stored shape {tuple(t.shape)}, config expects {tuple(param.shape)}")
        owner, _, leaf = name.rpartition(".")
        mod = module.get_submodule(owner) if owner else module
        setattr(mod, leaf, torch.nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False))


def eos_token_ids(section: dict) -> tuple[int, ...]:
    """The ids of a tokenizer section's `eos_tokens` (looked up among its added tokens)."""
    by_text = {t.get("content"): t.get("id") for t in section.get("added_tokens", [])}
    return tuple(by_text[e] for e in section.get("eos_tokens", []) if by_text.get(e) is not None)
