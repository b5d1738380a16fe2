"""The codecs of pseudo-gradient parts on the wire: a part of n fp32 values as one byte image.

- `fp32`: the raw little-endian values (4n bytes);
- `bf16`: torch's round-to-nearest-even bfloat16 values (2n bytes);
- `int8`: blockwise absmax quantisation, `INT8_BLOCK` values per block: first one fp32 scale per block
  (absmax / 127), then one int8 per value, q = round(x / scale) (n + 4·⌈n / INT8_BLOCK⌉ bytes).
  Each value comes back within scale / 2 (plus fp32 rounding) of what was sent.

Decoding is a pure function of the image, so every member that decodes the same image holds the
same fp32 values bit for bit (the all-reduce relies on it).
"""

from __future__ import annotations

import sys

import torch

from swarmnode.swarm.wire import check_dtype

INT8_BLOCK = 1024
"""Values per int8 quantisation block (one fp32 scale each: 0.4% overhead)."""
_INT8_MAX = 127.0
_ITEM_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}

assert sys.byteorder == "little", "the wire images are little-endian, as torch lays them out here"


def int8_blocks(n: int) -> int:
    return -(-n // INT8_BLOCK)


def encoded_size(wire_dtype: str, n: int) -> int:
    """Bytes of the image of n values."""
    size = _ITEM_BYTES[check_dtype(wire_dtype)] * n
    return size + 4 * int8_blocks(n) if wire_dtype == "int8" else size


def encode(x: torch.Tensor, wire_dtype: str) -> memoryview:
    """The image of a flat fp32 CPU tensor, as bytes. For fp32 it is a view of `x` itself (no copy):
    keep `x` alive and unchanged while the image is in use."""
    assert x.dtype == torch.float32 and x.dim() == 1 and x.is_contiguous(), "flat contiguous fp32 expected"
    if check_dtype(wire_dtype) == "fp32":
        return _bytes_of(x)
    if wire_dtype == "bf16":
        return _bytes_of(x.to(torch.bfloat16))
    scales, q = _quantize_int8(x)
    image = torch.empty(encoded_size("int8", x.numel()), dtype=torch.uint8)
    image[: 4 * scales.numel()].copy_(scales.view(torch.uint8))
    image[4 * scales.numel() :].copy_(q.view(torch.uint8))
    return _bytes_of(image)


def decode(image: bytes | bytearray | memoryview, wire_dtype: str, n: int) -> torch.Tensor:
    """The n fp32 values of an image made by `encode`; for fp32 a view of the image's memory if it is
    writable (no copy). Raises ValueError if its size is not exactly `encoded_size(wire_dtype, n)`."""
    if len(image) != encoded_size(wire_dtype, n):
        raise ValueError(
            f"a {wire_dtype} image of {n} values has {encoded_size(wire_dtype, n)} bytes, not {len(image)}"
        )
    if n == 0:
        return torch.empty(0, dtype=torch.float32)
    raw = torch.frombuffer(_writable(image), dtype=torch.uint8)
    if wire_dtype == "fp32":
        return raw.view(torch.float32)
    if wire_dtype == "bf16":
        return raw.view(torch.bfloat16).float()
    nb = int8_blocks(n)
    return _dequantize_int8(raw[: 4 * nb].view(torch.float32), raw[4 * nb :].view(torch.int8))


def _quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(one scale per block, int8 values); a block of zeros has scale 0 and decodes to zeros."""
    blocks = _padded_blocks(x)
    scales = blocks.abs().amax(dim=1).div_(_INT8_MAX)
    divisors = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = blocks.div(divisors[:, None]).round_().clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return scales, q.view(-1)[: x.numel()]


def _dequantize_int8(scales: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    values = _padded_blocks(q.to(torch.float32))
    return values.mul_(scales[:, None]).view(-1)[: q.numel()]


def _padded_blocks(x: torch.Tensor) -> torch.Tensor:
    """`x` as rows of `INT8_BLOCK` values, zero-padded at the end (a fresh tensor only if padded)."""
    pad = int8_blocks(x.numel()) * INT8_BLOCK - x.numel()
    return (torch.cat((x, x.new_zeros(pad))) if pad else x).view(-1, INT8_BLOCK)


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def _writable(image: bytes | bytearray | memoryview) -> bytearray | memoryview:
    """A writable buffer over the image (torch refuses to wrap read-only memory without a warning)."""
    view = memoryview(image)
    return view if not view.readonly else bytearray(view)
