"""QuantizedTensor: packed codes plus block scales, and `quantize()` that makes one."""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ._formats import check_block, check_format, check_input, fp8_grid
from ._native import native_dequantize, native_quantize

__all__ = ["QuantizedTensor", "quantize"]

# Double quantization of NF4 absmax values: int8 blocks of this many scales.
DOUBLE_QUANT_BLOCK = 256

# codes tensor -> weak reference to the QuantizedTensor that holds it (keys by identity: a tensor's ==
# is elementwise). Neither side keeps the other alive.
_owners: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _scale_count(format: str, shape: torch.Size, block: int) -> int:
    if format == "fp8":
        rows, cols = fp8_grid(shape)
        return math.ceil(rows / block) * math.ceil(cols / block)
    return math.ceil(math.prod(shape) / block)


def _packed_bytes(format: str, n: int) -> int:
    return (n + 1) // 2 if format in ("nf4", "nvfp4") else n


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor fp32 scale, amax / (448 * 6) over the finite values, shape [1], on x's device."""
    amax = x.abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).amax().float().reshape(1)
    # Divide by a tensor, not a Python number: torch's CUDA division by a CPU scalar multiplies by the
    # reciprocal (up to 1 ulp off the IEEE quotient), which changed the scale bytes against the CPU.
    return amax / torch.full_like(amax, 2688.0)


class QuantizedTensor:
    """A tensor stored as packed codes (`data`, uint8) and block scales.

    `scales`: float32 per block (int8, nf4), per 128x128 tile (fp8, shape
    [row tiles, col tiles]), or float8_e4m3fn per 16 values (nvfp4, which also
    has `global_scale`, fp32 [1]). NF4 with double quantization keeps its
    absmax values as an int8 QuantizedTensor plus `scale_offset`.
    A plain object of tensors: it pickles, so torch.save / torch.load work.
    """

    def __init__(self, format: str, shape: torch.Size | tuple[int, ...], data: torch.Tensor,
                 scales: torch.Tensor | QuantizedTensor, block_size: int, dtype: torch.dtype = torch.bfloat16,
                 global_scale: torch.Tensor | None = None, scale_offset: torch.Tensor | None = None) -> None:
        self.format = check_format(format)
        self.shape = torch.Size(shape)
        self.data = data
        self.scales = scales
        self.block_size = check_block(format, block_size)
        self.dtype = dtype
        self.global_scale = global_scale
        self.scale_offset = scale_offset
        self._cache: dict[str, Any] = {}

    def __setattr__(self, name: str, value: Any) -> None:
        # Derived values (quantized_linear's plans, swizzled scales) follow the fields: a new field clears them.
        cache = self.__dict__.get("_cache")
        if cache and name != "_cache":
            cache.clear()
        object.__setattr__(self, name, value)
        if name == "data" and isinstance(value, torch.Tensor):
            _owners[value] = weakref.ref(self)

    @staticmethod
    def owner_of(data: torch.Tensor) -> QuantizedTensor | None:
        """The live QuantizedTensor whose codes are the tensor object `data` (the last one given it), or None.
        Compiled graphs pass a weight's tensors, not the object: this finds its cached plans again."""
        ref = _owners.get(data)
        return None if ref is None else ref()

    # ---- facts -------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def double_quant(self) -> bool:
        return isinstance(self.scales, QuantizedTensor)

    @property
    def nbytes(self) -> int:
        """Bytes of codes, scales and per-tensor values together."""
        total = self.data.numel() * self.data.element_size()
        total += self.scales.nbytes if self.double_quant else self.scales.numel() * self.scales.element_size()
        for extra in (self.global_scale, self.scale_offset):
            if extra is not None:
                total += extra.numel() * extra.element_size()
        return total

    def __repr__(self) -> str:
        return (f"QuantizedTensor(format={self.format!r}, shape={tuple(self.shape)}, block_size={self.block_size}, "
                f"device={self.device}, nbytes={self.nbytes})")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cache"] = {}  # derived tensor-core layouts are rebuilt on demand
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:  # a copy owns its codes, as a constructed one does
        self.__dict__.update(state)
        if isinstance(self.data, torch.Tensor):
            _owners[self.data] = weakref.ref(self)

    def named_tensors(self, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every tensor this holds: codes, scales (or, double quantized, their own codes and
        scales), global scale, scale offset. The same format, shape and block size always give the same names,
        shapes and dtypes."""
        for attr in ("data", "scales", "global_scale", "scale_offset"):
            value = getattr(self, attr)
            if isinstance(value, QuantizedTensor):
                yield from value.named_tensors(f"{prefix}{attr}.")
            elif value is not None:
                yield f"{prefix}{attr}", value

    def requantize_(self, values: torch.Tensor) -> None:
        """Stores `values` (this shape) quantized in this object's own tensors, in place: the format, block
        size, double quantization, device and dtype stay, and whoever holds these tensors sees the new codes."""
        if tuple(values.shape) != tuple(self.shape):
            raise ValueError(f"requantize_: values of shape {tuple(values.shape)} do not fit a quantized tensor "
                             f"of shape {tuple(self.shape)}")
        new = quantize(values.detach().to(self.device), self.format, self.block_size, double_quant=self.double_quant)
        for (_, mine), (_, theirs) in zip(self.named_tensors(), new.named_tensors(), strict=True):
            mine.copy_(theirs)
        self._cache.clear()  # plans and swizzled scales derive from the old values
        if self.double_quant:
            self.scales._cache.clear()

    # ---- decode ------------------------------------------------------------
    def block_scales(self) -> torch.Tensor:
        """The fp32 (nf4, int8, fp8) or e4m3 (nvfp4) scales, undoing double quantization."""
        if not self.double_quant:
            return self.scales
        return self.scales.dequantize(torch.float32) + self.scale_offset

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The decoded tensor in `dtype` (float32, bfloat16 or float16) on this tensor's device."""
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dequantize: dtype {dtype} is not supported; use float32, bfloat16 or float16")
        out = torch.empty(self.shape, dtype=dtype, device=self.device)
        scales = self.block_scales()
        if self.format == "nvfp4":
            scales = scales.view(torch.uint8)
        native_dequantize(self.format, self.shape, self.data, scales, self.global_scale, self.block_size, out)
        return out

    # ---- placement ---------------------------------------------------------
    def _map(self, fn) -> QuantizedTensor:
        scales = self.scales._map(fn) if self.double_quant else fn(self.scales)
        return QuantizedTensor(self.format, self.shape, fn(self.data), scales, self.block_size, self.dtype,
                               None if self.global_scale is None else fn(self.global_scale),
                               None if self.scale_offset is None else fn(self.scale_offset))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> QuantizedTensor:
        """A copy on `device` (self when already there); dtypes never change."""
        device = torch.device(device)
        if device == self.device or (device.index is None and device.type == self.device.type):
            return self
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def cuda(self, device: int | None = None, non_blocking: bool = False) -> QuantizedTensor:
        return self.to(torch.device("cuda", device) if device is not None else "cuda", non_blocking)

    def cpu(self) -> QuantizedTensor:
        return self.to("cpu")

    def pin_memory(self) -> QuantizedTensor:
        """A copy in page-locked host memory (for non_blocking uploads)."""
        return self._map(lambda t: t.pin_memory())

    def is_pinned(self) -> bool:
        return self.data.is_pinned()

    # ---- state dicts -------------------------------------------------------
    def to_state_dict(self, prefix: str = "") -> dict[str, Any]:
        """Tensors and metadata as a flat dict (tensors keep their device)."""
        state: dict[str, Any] = {
            prefix + "format": self.format,
            prefix + "shape": list(self.shape),
            prefix + "block_size": self.block_size,
            prefix + "dtype": str(self.dtype).removeprefix("torch."),
            prefix + "data": self.data,
        }
        if self.double_quant:
            state.update(self.scales.to_state_dict(prefix + "scales."))
        else:
            state[prefix + "scales"] = self.scales
        if self.global_scale is not None:
            state[prefix + "global_scale"] = self.global_scale
        if self.scale_offset is not None:
            state[prefix + "scale_offset"] = self.scale_offset
        return state

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], prefix: str = "") -> QuantizedTensor:
        """Inverse of to_state_dict."""
        if prefix + "scales" in state:
            scales = state[prefix + "scales"]
        else:
            scales = cls.from_state_dict(state, prefix + "scales.")
        return cls(state[prefix + "format"], tuple(state[prefix + "shape"]), state[prefix + "data"], scales,
                   int(state[prefix + "block_size"]), getattr(torch, state[prefix + "dtype"]),
                   state.get(prefix + "global_scale"), state.get(prefix + "scale_offset"))

    # ---- tensor-core layouts -------------------------------------------------
    def swizzled_scales(self) -> torch.Tensor:
        """NVFP4 block scales in the 128x4-tile layout of the FP4 tensor cores (cuBLAS / torch SWIZZLE_32_4_4).

        Needs a 2-D shape whose last dim is a multiple of 16. Cached.
        """
        from ._swizzle import swizzle_block_scales

        if self.format != "nvfp4":
            raise ValueError(f"swizzled_scales is for nvfp4, not {self.format}")
        if len(self.shape) != 2 or self.shape[1] % 16:
            raise ValueError(f"swizzled_scales needs a 2-D nvfp4 tensor with a last dim divisible by 16, "
                             f"got shape {tuple(self.shape)}")
        if "swizzled" not in self._cache:
            rows, cols = self.shape
            self._cache["swizzled"] = swizzle_block_scales(self.scales.view(rows, cols // 16))
        return self._cache["swizzled"]


def quantize(tensor: torch.Tensor, format: str, block_size: int | None = None, *,
             double_quant: bool = False) -> QuantizedTensor:
    """Quantizes `tensor` (float32/bfloat16/float16, CPU or CUDA) into `format`: int8, nf4, fp8 or nvfp4.

    block_size: values per scale (int8/nf4 default 64, any even size; nvfp4 16), or the tile edge for fp8
    (default 128). double_quant (nf4 only): store the absmax values as int8 blocks of 256 around their mean.
    CUDA tensors are quantized on the current stream without a host sync.
    """
    format = check_format(format)
    block = check_block(format, block_size)
    if double_quant and format != "nf4":
        raise ValueError(f"double_quant applies to nf4 only, not {format}")
    x = check_input(tensor)
    n = x.numel()
    device = x.device
    data = torch.empty(_packed_bytes(format, n), dtype=torch.uint8, device=device)
    count = _scale_count(format, x.shape, block)
    global_scale = None
    if format == "nvfp4":
        scales = torch.empty(count, dtype=torch.uint8, device=device)
        global_scale = nvfp4_global_scale(x) if n else torch.zeros(1, device=device)
    else:
        scales = torch.empty(count, dtype=torch.float32, device=device)
    native_quantize(format, x, data, scales, global_scale, block)
    if format == "nvfp4":
        scales = scales.view(torch.float8_e4m3fn)
    elif format == "fp8":
        rows, cols = fp8_grid(x.shape)
        scales = scales.view(math.ceil(rows / block), math.ceil(cols / block))
    q = QuantizedTensor(format, x.shape, data, scales, block, tensor.dtype if tensor.dtype in
                        (torch.float32, torch.bfloat16, torch.float16) else torch.float32, global_scale)
    if double_quant and scales.numel():
        offset = scales.mean().reshape(1)
        q.scales = quantize(scales - offset, "int8", DOUBLE_QUANT_BLOCK)
        q.scale_offset = offset
    return q
