"""The other process of a cuda_ipc test: CUDA refuses to open an IPC handle in the process
that exported it, so the exporting side (a KV cache, or a whole prefill engine) runs in
a spawned child and talks to the test over a pipe."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from pdserve.core_types.cache_spec import KVCacheConfig
from pdserve.forward_context import KVCaches


def filled_caches(cfg: KVCacheConfig, num_blocks: int, device: str, seed: int) -> KVCaches:
    """Deterministic contents (drawn on the CPU): both processes can rebuild them."""
    caches = KVCaches.allocate(cfg, num_blocks, torch.device(device))
    g = torch.Generator().manual_seed(seed)
    for _, _, c in caches.layers():
        if c.dtype == torch.uint8:
            c.copy_(torch.randint(0, 256, c.shape, generator=g, dtype=torch.uint8))
        else:
            c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
    return caches


def export_caches(
    cfg: KVCacheConfig, num_blocks: int, seed: int, conn: Connection, device: str = "cuda"
) -> None:
    from pdserve.kv_transfer.transports.cuda_ipc import CudaIpcServer

    caches = filled_caches(cfg, num_blocks, device, seed)
    torch.cuda.synchronize()
    conn.send(CudaIpcServer(caches).transport_info())
    conn.recv()  # keep the memory alive until the test is done with it


def prefill_engine(path: Path, prompts: list[list[int]], conn: Connection) -> None:
    """A two-group prefill engine on cuda_ipc: for each prompt sends (kv_transfer_params,
    every layer's bytes of the prompt's held blocks), then serves reads until told."""
    import pytest

    from _two_group_model import register
    from pdserve import SamplingParams
    from pdserve.config import EngineConfig
    from pdserve.engine.engine_core import EngineCore
    from pdserve.frontend.processor import InputProcessor
    from pdserve.frontend.tokenizer import Tokenizer

    with pytest.MonkeyPatch.context() as mp:
        register(mp)
        cfg = EngineConfig.from_kwargs(
            model=str(path),
            dtype="float32",
            block_size=4,
            device="cuda",
            enforce_eager=True,
            kv_transfer_config={
                "kv_connector": "PdConnector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"transport": "cuda_ipc", "lease_seconds": 60},
            },
        )
        core = EngineCore(cfg)
        proc = InputProcessor(Tokenizer.from_pretrained(path), core.max_model_len, core.vocab_size)
        one = SamplingParams(temperature=0, max_tokens=1)
        out = []
        for i, ids in enumerate(prompts):
            core.add_request(proc.make_request(f"r{i}", ids, one, {"do_remote_decode": True}))
            params = None
            while params is None:
                for o in core.step():
                    params = o.kv_transfer_params
            blocks = torch.tensor(params.remote_block_ids, device="cuda")
            layers = {
                name: c.index_select(lay.block_axis, blocks).cpu()
                for name, lay, c in core.runner.kv_caches.layers()
            }
            out.append((params, layers))
        conn.send(out)
        while not conn.poll(0.01):
            core.step()  # frees what decode read
            time.sleep(0.005)
        core.shutdown()
