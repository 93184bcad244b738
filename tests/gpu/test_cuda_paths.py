"""CUDA-only paths: Triton kernels compiled for real, and the cuda_ipc KV transport across processes."""
import multiprocessing as mp

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_triton_kernels_match_reference_on_cuda():
    from kernels.kv_store import store_kv_reference, store_kv_triton
    from kernels.paged_attention import paged_decode_attention_reference, paged_decode_attention_triton

    torch.manual_seed(0)
    nb, L, kvh, bs, D, H, B = 64, 2, 2, 16, 64, 8, 4
    cache = torch.randn(nb, L, 2, kvh, bs, D, device="cuda", dtype=torch.float16)
    k, v = cache[:, 1, 0].transpose(1, 2), cache[:, 1, 1].transpose(1, 2)
    tables = torch.randperm(nb, device="cuda")[:B * 8].view(B, 8).int()
    lens = torch.tensor([1, 17, 100, 128], device="cuda", dtype=torch.int32)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.float16)
    for window in (None, 24):
        ref = paged_decode_attention_reference(q, k, v, tables, lens, D ** -0.5, window)
        got = paged_decode_attention_triton(q, k, v, tables, lens, D ** -0.5, window)
        assert (ref - got).abs().max().item() < 2e-3
    key, val = torch.randn(2, 5, kvh, D, device="cuda", dtype=torch.float16)
    slots = torch.tensor([0, 17, 33, -1, 90], device="cuda")
    expect = cache.clone()
    store_kv_reference(key, val, expect[:, 0, 0].transpose(1, 2), expect[:, 0, 1].transpose(1, 2), slots)
    store_kv_triton(key, val, cache[:, 0, 0].transpose(1, 2), cache[:, 0, 1].transpose(1, 2), slots)
    assert torch.equal(cache, expect)


def _receiver(handle, queue):
    import asyncio

    from shared.kv.transport_cuda_ipc import CudaIpcTransport

    async def run():
        t = CudaIpcTransport(None, "rx")
        got = await t.fetch(handle)
        queue.put(got.cpu())
    asyncio.run(run())


async def test_cuda_ipc_round_trip_between_processes():
    from shared.kv.transport_cuda_ipc import CudaIpcTransport

    payload = torch.randn(3, 2, 2, 2, 16, 64, device="cuda", dtype=torch.float16)
    sender = CudaIpcTransport(None, "tx")
    handle = await sender.stage(payload, "t1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(handle, queue))
    proc.start()
    got = queue.get(timeout=60)
    proc.join(30)
    await sender.release("t1")
    assert torch.equal(got, payload.cpu()) and sender.staged_bytes == 0


def _fetch_all(handles, queue):
    """Spawned receiver: fetch every handle with one cuda_ipc transport, put (device type, host copy) each."""
    import asyncio

    from shared.kv.transport_cuda_ipc import CudaIpcTransport

    async def run():
        t = CudaIpcTransport(None, "rx")
        for handle in handles:
            got = await t.fetch(handle)
            queue.put((got.device.type, got.cpu()))
    asyncio.run(run())


async def test_cuda_ipc_stage_blocks_gathers_on_the_device():
    from shared.kv.transport_cuda_ipc import CudaIpcTransport

    cache = torch.randn(40, 2, 2, 2, 16, 64, device="cuda", dtype=torch.float16)  # [num_blocks, L, 2, kvh, bs, D]
    ids = [[5, 2, 17, 9], list(range(39, -1, -1))]
    sender = CudaIpcTransport(None, "tx")
    handles = [await sender.stage_blocks(cache, ids[0], "b0"),
               await sender.stage_blocks(cache.cpu(), ids[1], "b1")]              # a CPU cache is moved over
    assert sender._staged["b0"].device == cache.device and sender._staged["b0"].is_contiguous()
    assert [h["shape"] for h in handles] == [[len(i), 2, 2, 2, 16, 64] for i in ids]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_fetch_all, args=(handles, queue))
    proc.start()
    got = [queue.get(timeout=60) for _ in handles]
    proc.join(30)
    for i in range(2):
        await sender.release(f"b{i}")
    assert sender.staged_bytes == 0
    for (device_type, tensor), block_ids in zip(got, ids):
        assert device_type == "cuda" and torch.equal(tensor, cache[block_ids].cpu())
