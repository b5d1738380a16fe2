"""The codecs of pseudo-gradient parts on the wire: a part of n fp32 values as one byte image.

- `fp32`: the raw little-endian values (4n bytes);
- `bf16`: torch's round-to-nearest-even bfloat16 values (2n bytes);
- `int8`: blockwise absmax quantisation, `INT8_BLOCK` values per block: first one fp32 scale per block
  (absmax / 127), then one int8 per value, q = round(x / scale) (n + 4·⌈n / INT8_BLOCK⌉ bytes).
  Each value comes back within scale / 2 (plus fp32 rounding) of what was sent.
- `int4`: blockwise absmax quantisation to 4 bits, `INT4_BLOCK` values per block (the 4-bit outer
  gradients of Streaming DiLoCo, Douillard et al. 2025): first one fp32 scale per block (absmax / 7),
  then the values two to a byte, q = round(x / scale) ∈ [-7, 7] stored as the nibble q + 8, the even
  value in the low nibble (4·⌈n / INT4_BLOCK⌉ + ⌈n / 2⌉ bytes). Each value comes back within scale / 2
  (plus fp32 rounding) of what was sent: 1/14 of its block's largest magnitude.

- `topk<k>` (and `topk`, the default k): chunk-wise top-k with 2-bit values and per-chunk scales,
  `core/sparse.py` (its image and its validation are there).

Decoding is a pure function of the image, so every member that decodes the same image holds the
same fp32 values bit for bit (the all-reduce relies on it).
"""

from __future__ import annotations

import sys

import torch

from swarmnode.core import sparse
from swarmnode.swarm.averaging.wire import check_dtype, is_sparse

INT8_BLOCK = 1024
"""Values per int8 quantisation block (one fp32 scale each: 0.4% overhead)."""
INT4_BLOCK = 128
"""Values per int4 quantisation block (one fp32 scale each: 6% over the 4 bits; smaller blocks keep
the error of a block bound to its own largest value)."""
_INT8_MAX = 127.0
_INT4_MAX = 7.0
_INT4_ZERO = 8
_ITEM_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}

assert sys.byteorder == "little", "the wire images are little-endian, as torch lays them out here"


def int8_blocks(n: int) -> int:
    return -(-n // INT8_BLOCK)


def int4_blocks(n: int) -> int:
    return -(-n // INT4_BLOCK)


def topk_of(wire_dtype: str) -> int:
    """k of a top-k wire dtype (`topk`: the default density's)."""
    k = sparse.parse_wire_name(wire_dtype)
    return k if k is not None else sparse.kept_per_chunk(sparse.DEFAULT_DENSITY)


def encoded_size(wire_dtype: str, n: int) -> int:
    """Bytes of the image of n values."""
    if is_sparse(check_dtype(wire_dtype)):
        return sparse.image_size(n, topk_of(wire_dtype))
    if wire_dtype == "int4":
        return 4 * int4_blocks(n) + (n + 1) // 2
    size = _ITEM_BYTES[wire_dtype] * n
    return size + 4 * int8_blocks(n) if wire_dtype == "int8" else size


CHEAP_DTYPES = ("fp32", "bf16")
"""Wire dtypes whose encode and decode are a view or one conversion pass (no quantisation)."""


def encode(x: torch.Tensor, wire_dtype: str, into: memoryview | None = None) -> memoryview:
    """The image of a flat fp32 CPU tensor, as bytes. For fp32 it is a view of `x` itself (no copy):
    keep `x` alive and unchanged while the image is in use. `into`: bytes of the image's size to
    write a bf16 image into (other dtypes ignore it), rather than fresh memory."""
    assert x.dtype == torch.float32 and x.dim() == 1 and x.is_contiguous(), "flat contiguous fp32 expected"
    if check_dtype(wire_dtype) == "fp32":
        return _bytes_of(x)
    if is_sparse(wire_dtype):
        return sparse.encode(x, topk_of(wire_dtype))
    if wire_dtype == "bf16":
        if into is not None and x.numel():
            assert len(into) == encoded_size("bf16", x.numel()), "into must be the image's size"
            torch.frombuffer(into, dtype=torch.bfloat16).copy_(x)
            return into
        return _bytes_of(x.to(torch.bfloat16))
    if wire_dtype == "int4":
        return _encode_int4(x)
    scales, q = _quantize_int8(x)
    image = torch.empty(encoded_size("int8", x.numel()), dtype=torch.uint8)
    image[: 4 * scales.numel()].copy_(scales.view(torch.uint8))
    image[4 * scales.numel() :].copy_(q.view(torch.uint8))
    return _bytes_of(image)


def decode(
    image: bytes | bytearray | memoryview, wire_dtype: str, n: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The n fp32 values of an image made by `encode`, written into `out` (a flat fp32 tensor of n
    values) if given; else for fp32 a view of the image's memory if it is writable (no copy). Raises
    ValueError if its size is not exactly `encoded_size(wire_dtype, n)`."""
    if len(image) != encoded_size(wire_dtype, n):
        raise ValueError(
            f"a {wire_dtype} image of {n} values has {encoded_size(wire_dtype, n)} bytes, not {len(image)}"
        )
    assert out is None or (out.dtype == torch.float32 and out.shape == (n,)), "flat fp32 out of n expected"
    if n == 0:
        return out if out is not None else torch.empty(0, dtype=torch.float32)
    if is_sparse(wire_dtype):
        return sparse.decode(image, n, topk_of(wire_dtype), out)
    raw = torch.frombuffer(_writable(image), dtype=torch.uint8)
    values = _decoded(raw, wire_dtype, n, out)
    if out is not None and values is not out:
        out.copy_(values)
        return out
    return values


def entries(
    image: bytes | bytearray | memoryview, wire_dtype: str, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A top-k image's kept entries (flat positions ascending, fp32 values), validated as `decode`
    validates it, without its n-value dense vector (`sparse.entries`)."""
    assert is_sparse(wire_dtype), "a top-k wire dtype expected"
    return sparse.entries(image, n, topk_of(wire_dtype))


def _decoded(raw: torch.Tensor, wire_dtype: str, n: int, out: torch.Tensor | None) -> torch.Tensor:
    if wire_dtype == "fp32":
        return raw.view(torch.float32)
    if wire_dtype == "bf16":
        return raw.view(torch.bfloat16) if out is not None else raw.view(torch.bfloat16).float()
    if wire_dtype == "int4":
        return _decode_int4(raw, n)
    nb = int8_blocks(n)
    return _dequantize_int8(raw[: 4 * nb].view(torch.float32), raw[4 * nb :].view(torch.int8))


def wire_values(image: bytes | bytearray | memoryview, wire_dtype: str, n: int) -> torch.Tensor:
    """The n values of an image as a tensor that adds into fp32 exactly as its decoded values do,
    with no copy where the wire dtype allows: fp32 and bf16 are views of the image (torch adds bf16
    into fp32 exactly, widening first), int8 is decoded. ValueError as `decode`."""
    if wire_dtype != "bf16" or len(image) != encoded_size(wire_dtype, n) or n == 0:
        return decode(image, wire_dtype, n)
    return torch.frombuffer(_writable(image), dtype=torch.uint8).view(torch.bfloat16)


def writable_image(x: torch.Tensor) -> memoryview:
    """The fp32 image of a flat contiguous fp32 CPU tensor as a writable view of its memory: bytes
    written into it are the tensor's values (a receiver fills a tensor in place that way)."""
    assert x.dtype == torch.float32 and x.dim() == 1 and x.is_contiguous(), "flat contiguous fp32 expected"
    return _bytes_of(x)


def receive_buffer(size: int) -> memoryview:
    """`size` writable bytes, not zero-filled, to receive an image into: every byte is written before
    it is read (a part whose bytes did not all arrive is dropped), and zero-filling 10 MB parts cost
    a pass over them that showed in the all-reduce's profile."""
    return _bytes_of(torch.empty(size, dtype=torch.uint8))


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


def _padded_blocks(x: torch.Tensor, block: int = INT8_BLOCK) -> torch.Tensor:
    """`x` as rows of `block` values, zero-padded at the end (a fresh tensor only if padded)."""
    pad = -x.numel() % block
    return (torch.cat((x, x.new_zeros(pad))) if pad else x).view(-1, block)


def _encode_int4(x: torch.Tensor) -> memoryview:
    """Scales, then nibbles q + 8 two to a byte (the last byte's high nibble is 8, a zero, if n is odd)."""
    n, nb = x.numel(), int4_blocks(x.numel())
    blocks = _padded_blocks(x, INT4_BLOCK)
    scales = blocks.abs().amax(dim=1).div_(_INT4_MAX)
    divisors = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = blocks.div(divisors[:, None]).round_().clamp_(-_INT4_MAX, _INT4_MAX).add_(_INT4_ZERO).to(torch.uint8)
    nibbles = q.view(-1)[: n + n % 2]  # the block padding holds zeros (nibble 8) for an odd n
    image = torch.empty(encoded_size("int4", n), dtype=torch.uint8)
    image[: 4 * nb].copy_(scales.view(torch.uint8))
    torch.bitwise_or(nibbles[0::2], nibbles[1::2].bitwise_left_shift(4), out=image[4 * nb :])
    return _bytes_of(image)


def _decode_int4(raw: torch.Tensor, n: int) -> torch.Tensor:
    nb = int4_blocks(n)
    scales, packed = raw[: 4 * nb].view(torch.float32), raw[4 * nb :]
    values = torch.empty(nb * INT4_BLOCK, dtype=torch.float32)
    pairs = values[: 2 * packed.numel()].view(-1, 2)
    pairs[:, 0].copy_(packed.bitwise_and(0x0F))
    pairs[:, 1].copy_(packed.bitwise_right_shift(4))
    values[2 * packed.numel() :].fill_(_INT4_ZERO)
    return values.sub_(_INT4_ZERO).view(-1, INT4_BLOCK).mul_(scales[:, None]).view(-1)[:n]


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def _writable(image: bytes | bytearray | memoryview) -> bytearray | memoryview:
    """A writable buffer over the image (torch refuses to wrap read-only memory without a warning)."""
    view = memoryview(image)
    return view if not view.readonly else bytearray(view)
