"""The tier's compressed KV formats (shared/kv/kv_codec.py): round trips within each format's error bound, the
documented byte size, zero heads, and formats told apart by their stored dtype."""
import pytest
import torch

from shared.errors import DeepinferError
from shared.kv.kv_codec import KVCodec, codec_for
from shared.kv.transport import parse_dtype

SHAPE = [3, 2, 2, 8, 16]   # [L, 2, kvh, bs, D]


def blocks(n: int = 4, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, *SHAPE, generator=gen) * torch.logspace(-2, 1, SHAPE[2])[None, None, None, :, None, None]
    return x.to(dtype)


@pytest.mark.parametrize("name", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_within_the_formats_bound(name, dtype):
    codec = KVCodec(name)
    x = blocks(dtype=dtype)
    enc = codec.encode(x)
    assert enc.dtype == torch.uint8 and list(enc.shape) == [4, *codec.encoded_shape(SHAPE)]
    y = codec.decode(enc, SHAPE, dtype)
    assert y.dtype == dtype and y.shape == x.shape
    xf, yf = x.float(), y.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)   # per block, layer, half, head, token
    if name == "fp8":
        bound = xf.abs() / 16 + amax / 448 / 2 ** 9
    else:
        bound = amax / 127 / 2
    slack = 0 if dtype == torch.float32 else yf.abs() / 128   # bf16's own rounding of the decoded value
    assert bool(((xf - yf).abs() <= bound + slack + 1e-12).all())
    assert (xf - yf).abs().max() > 0   # it is lossy: the test would see a format that stored nothing


def test_bytes_per_block_and_zero_heads():
    codec = KVCodec("fp8")
    assert codec.row_bytes(SHAPE) == 4 * 2 * 2 * 8 + 2 * 2 * 8 * 16
    x = blocks()
    x[:, :, 1, 0, 3] = 0.0   # layer rows' V half of head 0, token 3: all zeros
    y = codec.decode(codec.encode(x), SHAPE, torch.float32)
    assert bool((y[:, :, 1, 0, 3] == 0).all())
    assert codec.encode(x).numel() == x.numel() * (16 + 4) // 16   # (D + 4) / D bytes per number


def test_formats_are_named_apart_and_bad_names_refused():
    assert KVCodec("fp8").wire_dtype != KVCodec("int8").wire_dtype
    assert parse_dtype(KVCodec("fp8").wire_dtype) == torch.uint8 == parse_dtype(KVCodec("int8").wire_dtype)
    assert codec_for("") is None
    with pytest.raises(DeepinferError, match="tier KV format"):
        KVCodec("fp4")
