"""Device buffers registered by address: a CUDA tensor's ``data_ptr()`` handed to
``register_memory`` is recognised as device memory (the pool's GPU runtime is asked) and moved by
the GPU copy engine to and from the node's own DRAM, whole and in ranges, as SGLang's direct linker
does with its GPU KV pools.

Needs torch with a GPU: the CI machine has neither (torch is 4 GB), so these run on the GPU
machine (see ``gpu_env.sh``). Elsewhere they skip; ``UMBP_REQUIRE_GPU=1`` makes that a failure.
"""

from __future__ import annotations

import os

import pytest

import umbp

REQUIRED = os.environ.get("UMBP_REQUIRE_GPU") == "1"

try:
    import torch

    HAVE_GPU = torch.cuda.is_available()
except ImportError:
    torch = None
    HAVE_GPU = False

if not HAVE_GPU:
    if REQUIRED:
        raise RuntimeError("UMBP_REQUIRE_GPU=1 but torch with a CUDA device is not importable here")
    pytest.skip("no torch with a CUDA device here", allow_module_level=True)

import mori.umbp as mu  # noqa: E402  (after the skip: the module is importable everywhere)

MiB = 1 << 20


def pattern(n: int, seed: int) -> "torch.Tensor":
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).cuda()


def test_a_cuda_tensor_registers_as_device_memory_and_round_trips():
    src = pattern(8 * MiB, 1)
    dst = torch.zeros_like(src)
    with umbp.Client.local(64 * MiB, gpu="auto") as c:
        assert c.register_memory(src.data_ptr(), src.nbytes) == f"gpu:{src.device.index or 0}"
        assert c.register_memory(dst.data_ptr(), dst.nbytes) == f"gpu:{dst.device.index or 0}"
        host = torch.zeros(3 * MiB, dtype=torch.uint8).numpy()
        assert c.register_memory(host.ctypes.data, host.nbytes) == "host"
        c.batch_put_from_ptr(["a", "b"], [src.data_ptr(), src.data_ptr() + 3 * MiB], [3 * MiB, 5 * MiB])
        got = c.batch_get_into_ptr(["b", "a"], [dst.data_ptr(), dst.data_ptr() + 5 * MiB], [5 * MiB, 3 * MiB])
        assert got == [5 * MiB, 3 * MiB]
        torch.cuda.synchronize()
        assert torch.equal(dst[: 5 * MiB], src[3 * MiB :]) and torch.equal(dst[5 * MiB :], src[: 3 * MiB])
        # Device → pool → host memory too.
        assert c.get_into_ptr("a", host.ctypes.data, host.nbytes) == 3 * MiB
        assert torch.equal(torch.from_numpy(host), src[: 3 * MiB].cpu())
        c.deregister_memory(src.data_ptr())
        c.deregister_memory(dst.data_ptr())
        c.deregister_memory(host.ctypes.data)


def test_mori_client_moves_kv_pages_between_gpu_buffers_in_ranges():
    # torch has initialised CUDA here, so the compat client gets a GPU runtime on its own.
    torch.cuda.init()
    cfg = mu.UMBPConfig()
    cfg.dram.capacity_bytes = 64 * MiB
    c = mu.UMBPClient(cfg)
    try:
        layers, page = 8, 64 << 10
        kv = pattern(layers * 4 * page, 2).view(layers, 4, page)  # 8 layers x 4 pages
        out = torch.zeros_like(kv)
        assert c.register_memory(kv.data_ptr(), kv.nbytes) is True
        assert c.register_memory(out.data_ptr(), out.nbytes) is True
        # One object per page holding its 8 layers, assembled from 8 ranges (the linker's layout).
        keys = [f"page{p}" for p in range(4)]
        ptrs = [[kv[layer, p].data_ptr() for layer in range(layers)] for p in range(4)]
        sizes = [[page] * layers for _ in range(4)]
        offs = [[layer * page for layer in range(layers)] for _ in range(4)]
        assert c.batch_put_ranges_from_ptr(keys, [layers * page] * 4, ptrs, sizes, offs) == [True] * 4
        # Read back scattered into the other buffer, pages in another order.
        order = [2, 0, 3, 1]
        dst = [[out[layer, order[i]].data_ptr() for layer in range(layers)] for i in range(4)]
        assert c.batch_get_ranges_into_ptr(keys, dst, sizes, offs) == [True] * 4
        torch.cuda.synchronize()
        for i, p in enumerate(order):
            assert torch.equal(out[:, p], kv[:, i]), (i, p)
        # Half a page's layers only: the ranges need not cover the value.
        part = torch.zeros(2 * page, dtype=torch.uint8, device="cuda")
        # Unregistered device memory is refused (never touched by the CPU), registered it moves.
        assert c.batch_get_ranges_into_ptr(["page1"], [[part.data_ptr()]], [[page]], [[0]]) == [False]
        assert c.register_memory(part.data_ptr(), part.nbytes) is True
        assert c.batch_get_ranges_into_ptr(
            ["page1"], [[part.data_ptr(), part.data_ptr() + page]], [[page, page]], [[3 * page, 6 * page]]
        ) == [True]
        torch.cuda.synchronize()
        assert torch.equal(part[:page], kv[3, 1]) and torch.equal(part[page:], kv[6, 1])
    finally:
        c.close()
