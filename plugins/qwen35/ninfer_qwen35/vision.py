"""The Qwen3.5 vision tower (reference path): patch embedding, learned positions resampled to the
grid, ViT blocks with 2-D rotary attention per frame, and the 2x2 patch merger into the text width.

Parameter names follow the checkpoint under `model.visual.` (`blocks.3.attn.qkv.weight` ...).
Patches arrive in spatial-merge-block order (four neighbouring patches consecutive), the layout
`ninfer_qwen35.media` writes, so the merger is a reshape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ninfer_core.media.api import PreparedMedia, VisionTower

VISION_PREFIX = "model.visual."


@dataclass(frozen=True)
class VisionConfig:
    depth: int = 27
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, config: dict) -> VisionConfig:
        v = dict(config.get("vision_config") or {})
        rope = v.get("rope_parameters") or {}
        known = {f for f in cls.__dataclass_fields__ if f != "rope_theta"}
        kw = {k: v[k] for k in known if k in v}
        for name in ("patch_size", "temporal_patch_size"):
            if isinstance(kw.get(name), (list, tuple)):
                kw[name] = int(kw[name][0])
        return cls(**kw, rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


def _act(name: str):
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "silu":
        return F.silu
    raise ValueError(f"unsupported vision activation {name!r}")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)  # [N, heads, d] each
        # rotary in fp32, rounded back to the activation dtype (transformers' rounding points)
        c, s = cos[:, None, :].float(), sin[:, None, :].float()
        q = (q.float() * c + _rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(x.dtype)
        outs, at = [], 0
        for length in frames:  # attention stays inside one frame (one temporal patch)
            qs, ks, vs = (t[at: at + length].transpose(0, 1)[None] for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs)[0].transpose(0, 1))
            at += length
        return self.proj(torch.cat(outs).reshape(n, -1))


def _norm(norm: nn.LayerNorm, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """LayerNorm of the fp32 residual stream in fp32, rounded once to the matmul dtype."""
    w, b = norm.weight, norm.bias
    return F.layer_norm(x.float(), norm.normalized_shape, w.float(), b.float(), norm.eps).to(dtype)


class VisionBlock(nn.Module):
    """One ViT block over the residual stream `x`, kept in fp32 whatever the weights' dtype: 27
    bf16 residual adds would round the stream 54 times, so only the matmul inputs are rounded
    (the norms run in fp32, each branch's output is added in fp32)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.mlp.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = _act(cfg.hidden_act)

    def forward(self, x, cos, sin, frames):
        dt = self.norm1.weight.dtype
        x = x + self.attn(_norm(self.norm1, x, dt), cos, sin, frames).float()
        return x + self.mlp.linear_fc2(self.act(self.mlp.linear_fc1(_norm(self.norm2, x, dt)))).float()


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width, bias=True)
        self.linear_fc2 = nn.Linear(self.width, cfg.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The fp32 residual stream -> embeddings in the weights' dtype."""
        x = _norm(self.norm, x, self.norm.weight.dtype).reshape(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen35VisionModel(nn.Module):
    """pixel_values [patches, patch_dim] + grids [(t, h, w)] -> embeddings [patches / merge^2, out_hidden]."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Module()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.patch_embed.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.side = int(cfg.num_position_embeddings ** 0.5)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        for p in self.parameters():
            p.requires_grad_(False)

    def _block_order(self, h: int, w: int, values: torch.Tensor) -> torch.Tensor:
        """[h, w, ...] raster -> [h*w, ...] in spatial-merge-block order."""
        m = self.cfg.spatial_merge_size
        tail = values.shape[2:]
        return values.reshape(h // m, m, w // m, m, *tail).transpose(1, 2).reshape(h * w, *tail)

    def _positions(self, h: int, w: int, device) -> torch.Tensor:
        """The learned position table resampled bilinearly (corners aligned) to an h x w grid."""
        side = self.side

        def taps(size: int):
            src = torch.arange(size, device=device, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
            lo = torch.floor(src)
            frac = src - lo
            lo = lo.long().clamp(0, side - 1)
            return lo, (lo + 1).clamp(max=side - 1), frac

        h0, h1, fh = taps(h)
        w0, w1, fw = taps(w)
        table = self.pos_embed.weight
        def at(hi, wi):
            return table[(hi[:, None] * side + wi[None, :]).reshape(-1)].reshape(h, w, -1).float()

        fh, fw = fh[:, None, None], fw[None, :, None]
        pos = (at(h0, w0) * (1 - fh) * (1 - fw) + at(h0, w1) * (1 - fh) * fw
               + at(h1, w0) * fh * (1 - fw) + at(h1, w1) * fh * fw)
        return self._block_order(h, w, pos)

    def _rotary(self, h: int, w: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        dim = self.cfg.head_dim // 2
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
        hh, ww = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        hw = self._block_order(h, w, torch.stack([hh, ww], -1))  # [h*w, 2]
        freqs = torch.cat([hw[:, 0:1].float() * inv, hw[:, 1:2].float() * inv], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        x, cos, sin, frames = self.embed(pixel_values, grids)
        for blk in self.blocks:
            x = blk(x, cos, sin, frames)
        return self.merger(x)

    def embed(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]):
        """Patch embedding plus resampled positions: (x [patches, hidden], cos, sin, frame lengths)."""
        cfg = self.cfg
        dtype = self.patch_embed.proj.weight.dtype
        x = pixel_values.to(dtype).reshape(-1, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size,
                                           cfg.patch_size)
        x = self.patch_embed.proj(x).reshape(-1, cfg.hidden_size)
        pos, cos, sin, frames = [], [], [], []
        for t, h, w in grids:
            p = self._positions(h, w, x.device)
            c, s = self._rotary(h, w, x.device)
            pos.append(p.repeat(t, 1))
            cos.append(c.repeat(t, 1))
            sin.append(s.repeat(t, 1))
            frames += [h * w] * t
        x = x.float() + torch.cat(pos)  # the residual stream stays in fp32 (VisionBlock)
        return x, torch.cat(cos), torch.cat(sin), frames


class Qwen35VisionTower(VisionTower):
    """The tower over one device: encodes one prepared item at a time."""

    def __init__(self, model: Qwen35VisionModel, device: torch.device):
        self.model, self.device = model, device
        self.hidden_size = model.cfg.out_hidden_size

    def encode(self, item: PreparedMedia) -> torch.Tensor:
        pv = item.pixel_values.to(self.device)
        t, h, w = item.grid
        out = self.model(pv, [(t, h, w)])
        if out.shape[0] != item.tokens:
            raise RuntimeError(f"the tower produced {out.shape[0]} embeddings for an item of {item.tokens} tokens")
        return out

    def device_bytes(self) -> int:
        if self.device.type == "cpu":
            return 0
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    # -- overlay: host weights streamed through a device window -------------------------------------
    def pin(self) -> None:
        """Page-lock the host weights (copies to the device then run asynchronously)."""
        if torch.cuda.is_available():
            for p in self.model.parameters():
                p.data = p.data.pin_memory()

    @property
    def dtype(self) -> torch.dtype:
        return self.model.patch_embed.proj.weight.dtype

    def window_tensors(self) -> list[nn.Module]:
        """The modules one streamed encode holds on the device, built on the meta device: the
        tower's front (patch embedding, positions, merger) and two block slots."""
        cfg = self.model.cfg
        with torch.device("meta"):
            front = Qwen35VisionModel(VisionConfig(**{**cfg.__dict__, "depth": 0}))
            slots = [VisionBlock(cfg) for _ in range(min(2, cfg.depth))]
        return [front, *slots]

    def window_bytes(self) -> int:
        """Device bytes one streamed encode borrows: two block slots, the embedding and the merger."""
        from ninfer_core.media.window import nbytes_of

        return sum(nbytes_of(self.window_tensors(), self.dtype))

    @torch.inference_mode()
    def encode_streamed(self, item: PreparedMedia, device, window=None) -> torch.Tensor:
        """`encode` with the weights in host memory: the front is copied into the window for this
        encode and the blocks stream through its two slots (ninfer_core.media.window). The same
        kernels on the same bytes as a resident tower. `window`: a DeviceWindow (None: one from
        the device allocator)."""
        from ninfer_core.media.window import allocator_window, fill_from, nbytes_of, stream_blocks

        dev = torch.device(device)
        host = self.model
        front, *slots = mods = self.window_tensors()
        if window is None:
            window = allocator_window(nbytes_of(mods, self.dtype), dev)
        window.materialize(mods, self.dtype)
        for name in ("patch_embed", "pos_embed", "merger"):
            fill_from(getattr(front, name), getattr(host, name))
        x, cos, sin, frames = front.embed(item.pixel_values.to(dev), [tuple(item.grid)])
        x = stream_blocks(host.blocks, slots, lambda blk, h: blk(h, cos, sin, frames), x, dev)
        out = front.merger(x)
        if out.shape[0] != item.tokens:
            raise RuntimeError(f"the tower produced {out.shape[0]} embeddings for an item of {item.tokens} tokens")
        return out


def load_vision_model(artifact, device: torch.device, dtype: torch.dtype) -> Qwen35VisionModel:
    """The tower's modules built on the meta device, then the artifact's model.visual.* assigned."""
    cfg = VisionConfig.from_hf(artifact.config)
    with torch.device("meta"):
        model = Qwen35VisionModel(cfg)
    names = [n for n in artifact.tensor_names() if n.startswith(VISION_PREFIX)]
    state = {n[len(VISION_PREFIX):]: artifact.get_tensor(n) for n in names}
    expected = dict(model.named_parameters())
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"vision weights do not match the config: missing {missing[:6]}, unexpected {unexpected[:6]}")
    for name, param in expected.items():
        t = state[name]
        if tuple(t.shape) != tuple(param.shape):
            raise ValueError(f"model.visual.{name}: stored shape {tuple(t.shape)}, config expects {tuple(param.shape)}")
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, leaf,
                nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False))
    return model.eval()
