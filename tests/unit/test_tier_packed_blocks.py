"""The cache tier's side of packed KV runs (services/cache_tier/blocks.py): a put is cut into blocks holding only
their own rows, a get that takes blocks without window rows gets the same packed run back, one that does not
is never served them."""
import pytest
import torch

from services.cache_tier.blocks import check_put_handle, fits, to_blocks, to_payload, window_mask
from shared import protocol as p
from shared.errors import DeepinferError
from shared.kv import block_pack

SHAPE = [6, 2, 1, 4, 3]                         # 6 layers (5 window, layer 5 full), K/V, 1 kv head, bs 4, D 3
FLAGS = [False, False, True, True]
BLOCKS = dict(worker_id="prefill-0", retention="chat", block_hashes=[11, 12, 13, 14], token_ids=list(range(16)),
              block_size=4, dtype="float32", block_shape=SHAPE)


def packed_run() -> torch.Tensor:
    logical = torch.arange(4 * 6 * 24, dtype=torch.float32).reshape(4, *SHAPE) + 1
    return block_pack.pack(logical, FLAGS, [0, 1, 2, 3, 4])


def put(payload: torch.Tensor, **kw) -> p.CachePut:
    handle = {"transport": "shm", "dtype": "float32", "shape": list(payload.shape),
              "nbytes": payload.numel() * 4}
    return p.CachePut(**BLOCKS, transfer_id="wb-1", transport="shm", handle=handle, full_layers=1,
                      window_mask=block_pack.encode_mask(FLAGS), **kw)


def get(full_layers: int) -> p.CacheGet:
    return p.CacheGet(**BLOCKS, transfer_id="tg-1", transports=["shm"], full_layers=full_layers)


def test_a_packed_put_stores_each_block_with_its_own_rows_and_comes_back_the_same():
    payload = packed_run()
    msg = put(payload)
    check_put_handle(msg, max_block_bytes=1 << 20)
    blocks = to_blocks(msg, payload, "prefill-0")
    assert [b.shape[0] for b in blocks] == [1, 1, 6, 6]
    assert sum(len(b.payload) for b in blocks) == payload.numel() * 4 < 4 * 6 * 24 * 4
    assert all(fits(b, get(1)) for b in blocks)
    assert window_mask(blocks, get(1)) == msg.window_mask
    assert torch.equal(to_payload(blocks, get(1)), payload)


def test_a_get_that_takes_whole_blocks_only_is_not_served_one_without_window_rows():
    blocks = to_blocks(put(packed_run()), packed_run(), "prefill-0")
    assert not fits(blocks[0], get(0)) and fits(blocks[2], get(0))
    assert window_mask(blocks[2:], get(0)) == b""
    assert list(to_payload(blocks[2:], get(0)).shape) == [2, *SHAPE]     # whole blocks: the logical layout


def test_a_put_whose_handle_is_not_its_packed_shape_is_refused():
    logical = torch.zeros(4, *SHAPE)
    with pytest.raises(DeepinferError, match="invalid_request"):
        check_put_handle(put(logical), max_block_bytes=1 << 20)
    with pytest.raises(DeepinferError, match="payload_too_large"):
        check_put_handle(put(packed_run()), max_block_bytes=6 * 24 * 4 - 1)   # a whole block is 6 rows
