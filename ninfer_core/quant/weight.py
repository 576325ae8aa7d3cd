"""QuantizedWeight: an encoded `[..., out, in]` weight that stands where a Linear's weight was.

It is not a tensor but answers torch's `__torch_function__` protocol (the duck-typed override
torch documents in `torch.overrides`), so the code that consumes weights stays as it is:
`F.linear(x, w)` (nn.Linear, and the families' fused GPU paths) runs the dequantising kernel,
`F.embedding(ids, w)` dequantises only the looked-up rows, `torch.cat([...])` of weights with one
encoding concatenates their packed rows (fused projections), `w[e]` of a stacked expert tensor and
`w[a:b]` of a fused one are views. Any other torch function sees the dequantised tensor (correct,
but it materialises the weight: the families avoid it on hot paths).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer_core.quant.encodings import Encoding, dequantize, quantize

# rows dequantised at a time by the reference linear, so a large head never needs its whole bf16 copy
_REF_ROWS = 8192


class QuantizedWeight:
    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, enc: Encoding, in_features: int,
                 dtype: torch.dtype):
        self.qdata, self.scale, self.enc = qdata, scale, enc
        self.in_features = int(in_features)
        self.dtype = dtype  # the compute dtype: what dequantisation produces and linear returns
        self.shape = torch.Size((*qdata.shape[:-1], self.in_features))
        self._kops = None

    @property
    def kernel_operands(self):
        """(packed rows, scales) as the Triton kernels read them (fp8 as bytes, rows contiguous),
        made once: the per-call views and checks were host time on every eager prefill linear."""
        if self._kops is None and self.dim() == 2:
            from ninfer_core.quant.kernels import kernel_operands

            self._kops = kernel_operands(self)
        return self._kops

    @classmethod
    def from_float(cls, w: torch.Tensor, enc: Encoding, scale_dtype=torch.bfloat16, dtype=None):
        q, s = quantize(w, enc, scale_dtype)
        return cls(q, s, enc, w.shape[-1], dtype or w.dtype)

    # -- tensor-like facts --------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.qdata.device

    @property
    def is_cuda(self) -> bool:
        return self.qdata.is_cuda

    def dim(self) -> int:
        return len(self.shape)

    def size(self, d=None):
        return self.shape if d is None else self.shape[d]

    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        """Stored bytes: packed values plus scales."""
        return self.qdata.numel() * self.qdata.element_size() + self.scale.numel() * self.scale.element_size()

    def to(self, device=None, dtype=None, non_blocking: bool = False, **_):
        if isinstance(device, torch.dtype):
            device, dtype = None, device
        q = self.qdata.to(device, non_blocking=non_blocking) if device is not None else self.qdata
        s = self.scale.to(device, non_blocking=non_blocking) if device is not None else self.scale
        return QuantizedWeight(q, s, self.enc, self.in_features, dtype or self.dtype)

    def dequantize(self, dtype=None) -> torch.Tensor:
        return dequantize(self.qdata, self.scale, self.enc, self.in_features, dtype or self.dtype)

    def __getitem__(self, idx):
        """An expert (`w[e]`) or a block of output rows (`w[a:b]`): views of the packed data."""
        if isinstance(idx, int) or (isinstance(idx, slice) and self.dim() == 2):
            return QuantizedWeight(self.qdata[idx], self.scale[idx], self.enc, self.in_features, self.dtype)
        raise TypeError(f"a quantised weight takes an int or a row slice, not {idx!r}")

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.enc.name}, shape={tuple(self.shape)}, dtype={self.dtype})"

    # -- torch functions ----------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return quantized_linear(x, w, bias)
        if func is F.embedding:
            ids, w = args[0], args[1]
            return QuantizedWeight(w.qdata[ids], w.scale[ids], w.enc, w.in_features, w.dtype).dequantize()
        if func is torch.cat:
            parts = list(args[0])
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            if all(isinstance(p, QuantizedWeight) for p in parts) and dim in (0, -len(parts[0].shape)):
                first = parts[0]
                if any(p.enc != first.enc or p.in_features != first.in_features for p in parts):
                    raise ValueError("cannot fuse weights of different encodings")
                return QuantizedWeight(torch.cat([p.qdata for p in parts]), torch.cat([p.scale for p in parts]),
                                       first.enc, first.in_features, first.dtype)

        def plain(a):
            if isinstance(a, QuantizedWeight):
                return a.dequantize()
            if isinstance(a, (list, tuple)):
                return type(a)(plain(x) for x in a)
            return a

        return func(*plain(tuple(args)), **{k: plain(v) for k, v in kwargs.items()})


def reference_linear(x: torch.Tensor, w: QuantizedWeight, bias=None) -> torch.Tensor:
    """The CPU reference: dequantise (a block of rows at a time) then matmul."""
    rows = w.shape[0]
    if rows <= _REF_ROWS:
        return F.linear(x, w.dequantize(x.dtype), bias)
    out = torch.cat([F.linear(x, w[a: a + _REF_ROWS].dequantize(x.dtype)) for a in range(0, rows, _REF_ROWS)], -1)
    return out if bias is None else out + bias


def quantized_linear(x: torch.Tensor, w: QuantizedWeight, bias=None) -> torch.Tensor:
    """x [..., in] @ w.T (+ bias): the Triton kernels on CUDA (or under TRITON_INTERPRET=1), else
    the reference."""
    from ninfer_core.accel import use_triton

    if w.dim() != 2:
        raise ValueError(f"linear with a stacked quantised weight of shape {tuple(w.shape)}")
    if use_triton(x) and x.device == w.device:
        from ninfer_core.quant.kernels import triton_linear

        out = triton_linear(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
        return out if bias is None else out + bias
    return reference_linear(x, w, bias)
