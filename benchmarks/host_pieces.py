#!/usr/bin/env python3
"""Each piece of a planned flexgen forward's host path, timed alone on a GPU machine.

    python3 benchmarks/host_pieces.py            (FLEXGEN_TREE=DIR: the flexgen package under DIR)

A bf16 causal call of B = 1, H = 2, N = 256, D = 64 is planned (flexgen/eager_plans.py), then the whole call and
each step of it (the signature, the plan lookup, the route check, the launch object's run and the pieces inside
it: allocations, the struct's copy and addresses, the maps, the stream, the tile counter, the context check, the
driver launch) run back to back, 5 x 20,000 times, and the median time per call is printed. A launch timed so is
bound by the kernel's own duration once the queue fills; the host's share of one call is what
`host_path.py`'s latency column shows. Pieces of one process compare with each other; between processes a host
may run everything a third faster or slower, so compare trees by alternating processes (host_path.py).
"""
from __future__ import annotations

import ctypes
import statistics
import timeit

import flexgen_tree  # noqa: E402  (benchmarks/ is the script's own directory)

TREE = flexgen_tree.select("host_pieces")

import torch  # noqa: E402


def timed(name: str, fn, calls: int = 20000) -> None:
    per_call = []
    for _ in range(5):
        per_call.append(timeit.timeit(fn, number=calls) / calls * 1e6)
        torch.cuda.synchronize()
    print(f"  {name:40s} {statistics.median(per_call):7.2f} us", flush=True)


def main() -> None:
    import flexgen
    from flexgen import eager_plans
    from flexgen.attention import _broadcast_kv_batch
    from flexgen.cache import kernel as kernel_mod
    from flexgen.runtime.call_checks import empty_like_layout
    from flexgen.runtime.schedule import tile_counter
    from flexgen.runtime.streams import current_stream_ptr

    b, h, n, d = 1, 2, 256, 64
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = flexgen.create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, n, n, device="cuda")
    torch.set_grad_enabled(False)
    for _ in range(50):
        flexgen.flex_attention(q, k, v, block_mask=mask)
    torch.cuda.synchronize()
    signature = (q, k, v, None, mask, None, False, False, None, None, None)
    sig = eager_plans.signature(*signature)
    plan = eager_plans.find(sig, None, mask)
    launch = plan.launch
    device, stream = q.device, current_stream_ptr(q.device)
    p = type(launch.params).from_buffer_copy(launch.params)
    launch.family.stream_fields(p, device, stream)
    address = q.data_ptr()

    def addresses():
        p.q, p.k, p.v, p.o, p.lse = address, address, address, address, address

    print(f"host pieces on {torch.cuda.get_device_name()} (torch {torch.__version__}); flexgen from {TREE}")
    timed("whole flex_attention (planned)", lambda: flexgen.flex_attention(q, k, v, block_mask=mask), 5000)
    timed("sdpa (causal)", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), 5000)
    timed("signature", lambda: eager_plans.signature(*signature))
    timed("plan lookup", lambda: eager_plans.find(sig, None, mask))
    timed("route check", lambda: plan.route_ok())
    timed("key / value batch broadcast", lambda: _broadcast_kv_batch(q, k, v))
    timed("launch object's run", lambda: launch.run(q, k, v), 5000)
    timed("O in the query's layout", lambda: empty_like_layout(q))
    timed("torch.empty of O's shape", lambda: torch.empty((b, h, n, d), dtype=q.dtype, device=device))
    timed("torch.empty of the lse", lambda: torch.empty(b, h, n, dtype=torch.float32, device=device))
    timed("struct copy", lambda: type(launch.params).from_buffer_copy(launch.params))
    timed("five addresses", addresses)
    if launch._maps is not None:
        maps = launch._maps

        def set_maps():
            p.q_map, p.k_map, p.v_map, p.o_map = (m.at(address) for m in maps)
        timed("four maps (cached)", set_maps)
    timed("current stream", lambda: current_stream_ptr(device))
    timed("tile counter", lambda: tile_counter(device, stream))
    timed("context check", kernel_mod.make_context_current)
    timed("launch (bound by the kernel)",
          lambda: launch.kernel.launch_dim3(launch.grid, launch.threads, launch.shared_memory, stream, p), 5000)
    torch.cuda.synchronize()
    print(f"  parameter struct: {ctypes.sizeof(p)} bytes")


if __name__ == "__main__":
    main()
