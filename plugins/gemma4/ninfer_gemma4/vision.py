"""The Gemma 4 vision tower (reference path): patch embedding with a learned 2-D position table,
bidirectional ViT blocks with axial 2-D RoPE and four norms each, 3x3 average pooling to soft
tokens scaled by sqrt(hidden) (optionally standardized), and the multimodal embedder (an unscaled
RMSNorm and a projection into the text width).

The facts are transformers' models/gemma4 (Gemma4VisionModel, Gemma4MultimodalEmbedder). Parameter
names follow the checkpoint under `model.vision_tower.` and `model.embed_vision.`. One image is
encoded at a time, unpadded: its ph x pw patches (raster order, multiples of the pooling kernel)
attend to each other only, which is what transformers' padded batch computes for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ninfer_core.media.api import PreparedMedia, VisionTower

TOWER_PREFIX = "model.vision_tower."
EMBED_PREFIX = "model.embed_vision."


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    pooling_kernel_size: int = 3
    patch_size: int = 16
    position_embedding_size: int = 10240
    use_clipped_linears: bool = False
    standardize: bool = False
    rope_theta: float = 100.0
    text_hidden_size: int = 2304

    @classmethod
    def from_hf(cls, config: dict) -> VisionConfig:
        v = dict(config.get("vision_config") or {})
        text = config.get("text_config") or {}
        rope = v.get("rope_parameters") or {}
        known = {f for f in cls.__dataclass_fields__ if f not in ("rope_theta", "text_hidden_size")}
        kw = {k: v[k] for k in known if v.get(k) is not None}
        return cls(**kw, rope_theta=float(rope.get("rope_theta", 100.0)),
                   text_hidden_size=int(text.get("hidden_size", cls.text_hidden_size)))

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size ** 2


def _act(name: str):
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "silu":
        return F.silu
    raise ValueError(f"unsupported vision activation {name!r}")


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm in fp32: x * (mean(x^2) + eps)^-1/2 [* w], back in x's dtype."""
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.type_as(x)


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False) if with_scale else None

    def forward(self, x):
        return _rms(x, self.weight, self.eps)

    def f32(self, x):
        """The norm in fp32, left in fp32 (for the blocks' fp32 residual stream)."""
        return _rms(x.float(), self.weight, self.eps)


class ClippableLinear(nn.Module):
    """A bias-free linear (`.linear`), its input and output clamped to stored bounds when the
    checkpoint uses clipped linears."""

    def __init__(self, cfg: VisionConfig, n_in: int, n_out: int):
        super().__init__()
        self.linear = nn.Linear(n_in, n_out, bias=False)
        self.clipped = cfg.use_clipped_linears
        if self.clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                self.register_parameter(name, nn.Parameter(torch.zeros(()), requires_grad=False))

    def forward(self, x):
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        x = self.linear(x)
        if self.clipped:
            x = torch.clamp(x, self.output_min, self.output_max)
        return x


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _axial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, d]: its first d/2 channels rotate with the column (x) position, the rest with
    the row (y) position, each half by rotate_half; cos/sin [N, d] (halves per axis)."""
    half = x.shape[-1] // 2
    parts = []
    for a in (0, 1):
        xs = x[..., a * half: (a + 1) * half]
        c, s = cos[:, None, a * half: (a + 1) * half], sin[:, None, a * half: (a + 1) * half]
        parts.append(xs * c + _rotate_half(xs) * s)
    return torch.cat(parts, dim=-1)


TABLE_ROWS = 4096  # rows of one position-table chunk (9 MiB at the 31B width in bf16)


class PositionTable(nn.Module):
    """The learned position table [2, size, hidden] (column plane, row plane) kept as row chunks of
    each plane, so no tensor of it is larger than a block's matrices: an overlay window carved from
    KV pages needs each tensor contiguous. A lookup gathers from the chunk holding each row (the
    same values as one gather from the whole table)."""

    def __init__(self, size: int, hidden: int):
        super().__init__()
        self.size = size
        self.bounds = [(lo, min(lo + TABLE_ROWS, size)) for lo in range(0, size, TABLE_ROWS)]
        for axis in (0, 1):
            for j, (lo, hi) in enumerate(self.bounds):
                self.register_parameter(f"p{axis}_{j}", nn.Parameter(torch.zeros(hi - lo, hidden), requires_grad=False))

    def lookup(self, axis: int, idx: torch.Tensor) -> torch.Tensor:
        first = getattr(self, f"p{axis}_0")
        out = torch.empty(idx.shape[0], first.shape[1], dtype=first.dtype, device=first.device)
        for j, (lo, hi) in enumerate(self.bounds):
            sel = ((idx >= lo) & (idx < hi)).nonzero().reshape(-1)
            if sel.numel():
                out[sel] = getattr(self, f"p{axis}_{j}")[idx[sel] - lo]
        return out

    def assign(self, table: torch.Tensor, device, dtype) -> None:
        """Take the checkpoint's [2, size, hidden] tensor."""
        for axis in (0, 1):
            for j, (lo, hi) in enumerate(self.bounds):
                setattr(self, f"p{axis}_{j}", nn.Parameter(table[axis, lo:hi].to(device=device, dtype=dtype),
                                                          requires_grad=False))


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = ClippableLinear(cfg, h, self.heads * self.head_dim)
        self.k_proj = ClippableLinear(cfg, h, self.kv_heads * self.head_dim)
        self.v_proj = ClippableLinear(cfg, h, self.kv_heads * self.head_dim)
        self.o_proj = ClippableLinear(cfg, self.heads * self.head_dim, h)
        self.q_norm = Norm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = Norm(self.head_dim, cfg.rms_norm_eps)
        self.eps = cfg.rms_norm_eps

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, dt = x.shape[0], x.dtype
        # q/k norms and the rotation in fp32 (cos/sin are fp32), rounded once for the attention
        q = _axial_rope(self.q_norm.f32(self.q_proj(x).view(n, self.heads, self.head_dim)), cos, sin).to(dt)
        k = _axial_rope(self.k_norm.f32(self.k_proj(x).view(n, self.kv_heads, self.head_dim)), cos, sin).to(dt)
        v = _rms(self.v_proj(x).view(n, self.kv_heads, self.head_dim), None, self.eps)
        rep = self.heads // self.kv_heads
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, N, d]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        # every patch of the image attends to every other; the softmax scale is 1 (the norms set it)
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0)[0].transpose(0, 1)
        return self.o_proj(out.reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = VisionAttention(cfg)
        self.mlp = nn.Module()
        self.mlp.gate_proj = ClippableLinear(cfg, h, cfg.intermediate_size)
        self.mlp.up_proj = ClippableLinear(cfg, h, cfg.intermediate_size)
        self.mlp.down_proj = ClippableLinear(cfg, cfg.intermediate_size, h)
        self.input_layernorm = Norm(h, eps)
        self.post_attention_layernorm = Norm(h, eps)
        self.pre_feedforward_layernorm = Norm(h, eps)
        self.post_feedforward_layernorm = Norm(h, eps)
        self.act = _act(cfg.hidden_activation)

    def forward(self, x, cos, sin):
        """The residual stream `x` stays in fp32 whatever the weights' dtype (as the Qwen3.5
        tower's): only the matmul inputs are rounded, the four norms run in fp32 and each branch is
        added in fp32. A bf16 stream, rounded twice a block, put the 31B tower's bf16 at 1.08e-2 of
        fp32 on the H200; an fp32 tower is unchanged."""
        dt = self.input_layernorm.weight.dtype
        x = x.float()
        x = x + self.post_attention_layernorm.f32(self.self_attn(self.input_layernorm.f32(x).to(dt), cos, sin))
        y = self.pre_feedforward_layernorm.f32(x).to(dt)
        y = self.mlp.down_proj(self.act(self.mlp.gate_proj(y)) * self.mlp.up_proj(y))
        return x + self.post_feedforward_layernorm.f32(y)


class Gemma4VisionModel(nn.Module):
    """Patches [ph*pw, 3*p*p] (uint8 or [0, 1] floats, raster order) of one ph x pw image ->
    soft-token embeddings [ph*pw / k^2, text hidden]."""

    def __init__(self, cfg: VisionConfig, depth: int | None = None):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.patch_embedder = nn.Module()
        self.patch_embedder.input_proj = nn.Linear(cfg.patch_dim, h, bias=False)
        self.patch_embedder.position_embedding_table = PositionTable(cfg.position_embedding_size, h)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(VisionBlock(cfg) for _ in range(
            cfg.num_hidden_layers if depth is None else depth))
        if cfg.standardize:
            self.std_bias = nn.Parameter(torch.zeros(h), requires_grad=False)
            self.std_scale = nn.Parameter(torch.ones(h), requires_grad=False)
        self.embed_vision = nn.Module()  # Gemma4MultimodalEmbedder: unscaled norm, projection
        self.embed_vision.embedding_projection = nn.Linear(h, cfg.text_hidden_size, bias=False)
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embedder.input_proj.weight.dtype

    def _rope(self, xy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [N, head_dim] of patch positions xy [N, 2]: per axis head_dim/4 frequencies,
        laid out [x, x, y, y] (rotate_half within each axis's half)."""
        cfg = self.cfg
        spatial = cfg.head_dim // 2
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32, device=xy.device) / spatial))
        fx, fy = xy[:, 0:1].float() * inv, xy[:, 1:2].float() * inv
        ang = torch.cat([fx, fx, fy, fy], dim=-1)
        return ang.cos(), ang.sin()  # fp32: the attention rotates in fp32 and rounds q, k once

    def embed(self, pixel_values: torch.Tensor, grid: tuple[int, int]):
        """(patch embeddings + positions [N, hidden], cos, sin) of one ph x pw image."""
        ph, pw = grid
        dev = self.patch_embedder.input_proj.weight.device
        pv = pixel_values.to(dev)
        if not pv.is_floating_point():  # stored as bytes: the processor's rescale by 1/255 in fp32
            pv = pv.float() * (1.0 / 255.0)
        x = self.patch_embedder.input_proj((2 * (pv.float() - 0.5)).to(self.dtype))
        yy, xx = torch.meshgrid(torch.arange(ph, device=dev), torch.arange(pw, device=dev), indexing="ij")
        xy = torch.stack([xx.reshape(-1), yy.reshape(-1)], dim=-1)  # [N, 2] (column, row)
        table = self.patch_embedder.position_embedding_table
        x = x.float() + (table.lookup(0, xy[:, 0]).float() + table.lookup(1, xy[:, 1]).float())  # fp32 stream
        cos, sin = self._rope(xy)
        return x, cos, sin

    def pool(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """k x k average pooling (fp32, rounded to the activation dtype as transformers does),
        sqrt(hidden) scaling and standardization in fp32, then the embedder: [L, text hidden]."""
        ph, pw = grid
        k = self.cfg.pooling_kernel_size
        h = x.shape[-1]
        pooled = x.float().reshape(ph // k, k, pw // k, k, h).mean(dim=(1, 3)).reshape(-1, h).to(self.dtype)
        soft = pooled.float() * (self.cfg.hidden_size ** 0.5)
        if self.cfg.standardize:
            soft = (soft - self.std_bias.float()) * self.std_scale.float()
        soft = soft.to(self.dtype)
        return self.embed_vision.embedding_projection(_rms(soft, None, self.cfg.rms_norm_eps))

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        x, cos, sin = self.embed(pixel_values, grid)
        for blk in self.encoder.layers:
            x = blk(x, cos, sin)
        return self.pool(x, grid)


class Gemma4VisionTower(VisionTower):
    """The tower over one device; an item is an image (grid (ph, pw)) or a video whose frames are
    encoded one after another (grid (frames, ph, pw))."""

    def __init__(self, model: Gemma4VisionModel, device: torch.device):
        self.model, self.device = model, device
        self.hidden_size = model.cfg.text_hidden_size

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @staticmethod
    def _frames(item: PreparedMedia):
        grid = tuple(item.grid)
        frames, (ph, pw) = (grid[0], grid[1:]) if len(grid) == 3 else (1, grid)
        per = ph * pw
        return [(item.pixel_values[f * per: (f + 1) * per], (ph, pw)) for f in range(frames)]

    def _check(self, out: torch.Tensor, item: PreparedMedia) -> torch.Tensor:
        if out.shape[0] != item.tokens:
            raise RuntimeError(f"the tower produced {out.shape[0]} embeddings for an item of {item.tokens} tokens")
        return out

    def encode(self, item: PreparedMedia) -> torch.Tensor:
        outs = [self.model(pv, grid) for pv, grid in self._frames(item)]
        return self._check(torch.cat(outs), item)

    def device_bytes(self) -> int:
        if self.device.type == "cpu":
            return 0
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    # -- overlay: host weights streamed through a device window -------------------------------------
    def pin(self) -> None:
        if torch.cuda.is_available():
            for p in self.model.parameters():
                p.data = p.data.pin_memory()

    def window_tensors(self) -> list[nn.Module]:
        """The modules one streamed encode holds on the device (meta): the front (patch embedder,
        position table, standardization, embedder) and two block slots."""
        cfg = self.model.cfg
        with torch.device("meta"):
            front = Gemma4VisionModel(cfg, depth=0)
            slots = [VisionBlock(cfg) for _ in range(min(2, cfg.num_hidden_layers))]
        return [front, *slots]

    def window_bytes(self) -> int:
        from ninfer_core.media.window import nbytes_of

        return sum(nbytes_of(self.window_tensors(), self.dtype))

    @torch.inference_mode()
    def encode_streamed(self, item: PreparedMedia, device, window=None) -> torch.Tensor:
        """`encode` with the weights in host memory, the blocks streamed through the window's two
        slots (ninfer_core.media.window): the same kernels on the same bytes as a resident tower."""
        from ninfer_core.media.window import allocator_window, fill_from, nbytes_of, stream_blocks

        dev = torch.device(device)
        front, *slots = mods = self.window_tensors()
        if window is None:
            window = allocator_window(nbytes_of(mods, self.dtype), dev)
        window.materialize(mods, self.dtype)
        fill_from(front, self.model)  # the front's tensors are the host model's minus its blocks
        outs = []
        for pv, grid in self._frames(item):
            x, cos, sin = front.embed(pv, grid)
            x = stream_blocks(self.model.encoder.layers, slots, lambda blk, h, c=cos, s=sin: blk(h, c, s), x, dev)
            outs.append(front.pool(x, grid))
        return self._check(torch.cat(outs), item)


def load_vision_model(artifact, device: torch.device, dtype: torch.dtype) -> Gemma4VisionModel:
    """The tower's modules built on the meta device, then the artifact's model.vision_tower.* and
    model.embed_vision.* tensors assigned."""
    cfg = VisionConfig.from_hf(artifact.config)
    with torch.device("meta"):
        model = Gemma4VisionModel(cfg)
    state = {}
    for n in artifact.tensor_names():
        if n.startswith(TOWER_PREFIX):
            state[n[len(TOWER_PREFIX):]] = n
        elif n.startswith(EMBED_PREFIX):
            state["embed_vision." + n[len(EMBED_PREFIX):]] = n
    table = "patch_embedder.position_embedding_table"
    expected = {n: p for n, p in model.named_parameters() if not n.startswith(table + ".")}
    expected[table] = None  # one checkpoint tensor [2, size, hidden], kept as chunks (PositionTable)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"vision weights do not match the config: missing {missing[:6]}, unexpected {unexpected[:6]}")
    for name, param in expected.items():
        t = artifact.get_tensor(state[name])
        want = (2, cfg.position_embedding_size, cfg.hidden_size) if param is None else tuple(param.shape)
        if tuple(t.shape) != want:
            raise ValueError(f"{state[name]}: stored shape {tuple(t.shape)}, config expects {want}")
        if param is None:
            model.patch_embedder.position_embedding_table.assign(t, device, dtype)
            continue
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, leaf,
                nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False))
    return model.eval()
