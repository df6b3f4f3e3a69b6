"""The GPU path's logic, on CPUs: calibration's agreements on the process group's device,
the executor's per-buffer stream bookkeeping, its per-stream memory and GEMM operands,
pinned copies in the right direction, and data checks that are exact in any dtype for
any group size. What needs a GPU (CUDA streams and events, NCCL) is left to
bench/gpu_check.py."""

import itertools
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from commsim.ir import ops as O
from commsim.ir.schedule import Program
from runtime.collectives import SUM_TERMS, max_expected, shard_values, sum_expected, sum_terms
from runtime.gpu_rank import BufferStreams
from runtime.kernels import PinnedCopies, StreamKernels, plan_operands

ROOT = Path(__file__).resolve().parents[2]

# Two gloo ranks calibrate with every torch.distributed call wrapped so that a tensor
# off the group's device (the host, for gloo) raises what an NCCL group raises for a host
# tensor, while every tensor made without a device lands on "meta". On a GPU the
# default device is the host and the group's is CUDA; here the default is meta and the
# group's the host: an agreement made on the default device instead of the group's
# fails here as it fails under NCCL.
_REFUSING_GROUP = r"""
import sys
import torch
import torch.distributed as dist

rank, port = int(sys.argv[1]), int(sys.argv[2])
GROUP_DEVICE = torch.device("cpu")
calls = []


def refusing(name, fn):
    def wrapped(*args, **kw):
        for a in list(args) + list(kw.values()):
            for t in (a if isinstance(a, (list, tuple)) else [a]):
                if isinstance(t, torch.Tensor) and t.device != GROUP_DEVICE:
                    raise RuntimeError(f"No backend type associated with device type {t.device.type}")
        calls.append(name)
        return fn(*args, **kw)
    return wrapped


for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
             "reduce_scatter_single", "broadcast", "gather", "reduce"):
    if hasattr(dist, name):
        setattr(dist, name, refusing(name, getattr(dist, name)))
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
torch.set_default_device("meta")
from runtime.calibrate import Calibrator  # noqa: E402 (after the wrapping: it binds the collectives)

profile = Calibrator(rank, 2, "gloo", quick=True, log=lambda m: None).run()
dist.barrier()
dist.destroy_process_group()
if rank == 0:
    print("agreed", calls.count("all_reduce"), ",".join(sorted(profile["collectives"])), profile["world_size"])
"""


def test_calibration_agrees_on_the_group_device(tmp_path):
    """Regression: calibrate all-reduced host tensors whatever the backend (its
    agreement, contention, executor-overhead and allocation results), so an NCCL group
    refused the first measurement. Every tensor handed to the group now lives on its
    device; a whole quick calibration runs through a group that refuses any other."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "refusing_group.py"
    script.write_text(_REFUSING_GROUP)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
             for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    word, n, kinds, world = outs[0][0].strip().splitlines()[-1].split(" ")
    assert word == "agreed" and int(n) > 20
    assert (kinds, world) == ("all_gather,all_reduce,broadcast,reduce_scatter", "2")


def test_a_buffer_freed_from_another_stream_is_recorded_on_its_users():
    """ZeRO-3 gathers a parameter into a buffer allocated on the all-gather stream, reads
    it on the compute stream and frees it from the compute stream: the allocator must
    keep the block until the compute stream is done with it, so the stream to record is
    compute (a user other than the allocation's stream), whichever stream frees it."""
    bs = BufferStreams()
    bs.allocated("w", "allgather")
    bs.used("w", "allgather")
    bs.used("w", "compute")
    assert bs.freed("w") == ["compute"]
    bs.allocated("g", "compute")  # used by its own stream only: nothing to record
    bs.used("g", "compute")
    assert bs.freed("g") == []
    bs.allocated("b", "compute")  # a bucket reduced on two side streams, freed from one of them
    for s in ("reduce", "compute", "copy"):
        bs.used("b", s)
    assert bs.freed("b") == ["copy", "reduce"]
    bs.used("gone", "compute")  # freed already, or never allocated: nothing held
    assert bs.freed("gone") == []


def _gemm(op_id, stream, m, n, k, buffers=(), batch=1):
    return O.Compute(O.OpId(op_id), stream, "g", O.ComputeKind.GEMM, 2 * m * n * k * batch, 0, 0,
                     O.GemmShape(m, n, k, batch), buffers=buffers)


def test_gemm_operands_come_from_the_ops_own_buffers():
    """A GEMM reads its inputs from the op's buffers where one is large enough (the
    weight first, each buffer once); the output, and any input no buffer holds, is in
    the stream's scratch, 256-byte aligned."""
    op = _gemm(1, "compute", 64, 32, 16, buffers=("w", "act"))  # a: 64x16, b: 16x32, c: 64x32, bf16
    plan = plan_operands(op, {"w": 16 * 32 * 2, "act": 64 * 32 * 2}, 2)
    assert (plan.b, plan.a) == ("w", "act") and (plan.c_at, plan.scratch_bytes) == (0, 4096)
    plan = plan_operands(op, {"w": 16 * 32 * 2}, 2)  # no activation buffer: a in the scratch
    assert (plan.b, plan.a, plan.a_at, plan.c_at, plan.scratch_bytes) == ("w", None, 0, 2048, 2048 + 4096)
    plan = plan_operands(op, {"w": 100, "act": 64 * 32 * 2}, 2)  # the weight buffer too small
    assert (plan.b, plan.a) == ("act", None)
    plan = plan_operands(_gemm(2, "compute", 10, 10, 10), {}, 4)
    assert (plan.a, plan.b, plan.a_at, plan.b_at, plan.c_at, plan.scratch_bytes) == (None, None, 0, 512, 1024, 1536)


def _program():
    setup = (O.Alloc(O.OpId(1), "compute", "w", "w", 16 * 32 * 2),)
    step = (
        O.Alloc(O.OpId(2), "allgather", "gathered", "g", 16 * 32 * 2),
        O.Alloc(O.OpId(3), "compute", "act", "act", 1 << 20),
        _gemm(4, "compute", 64, 32, 16, buffers=("g", "act")),
        O.Compute(O.OpId(5), "compute", "norm", O.ComputeKind.ELEMENTWISE, 0, 3 << 20, 3 << 20),
        O.Compute(O.OpId(6), "side", "cast", O.ComputeKind.ELEMENTWISE, 0, 4096, 4096),
        O.Copy(O.OpId(7), "offload", "to host", O.CopyDirection.D2H, 5000),
        O.Copy(O.OpId(8), "offload", "to device", O.CopyDirection.H2D, 3000),
        O.Free(O.OpId(9), "compute", "act", "act"),
    )
    return Program(setup, step)


def test_stream_kernels_size_every_streams_memory_before_the_first_step():
    """Each stream's ring, GEMM scratch and pinned copy buffers are sized from the
    program (its largest op) and allocated once: running the ops reallocates nothing,
    the GEMM reads the gathered weight and writes the stream's scratch."""
    k = StreamKernels(torch.device("cpu"), torch.bfloat16, _program())
    assert set(k.need) == {"compute", "side", "offload"}
    ring, scratch, copy = k.need["compute"]
    assert ring == 6 << 20 and scratch == 64 * 32 * 2 and copy == 0  # act (128 KiB) holds a; c in scratch
    assert k.need["offload"] == [0, 0, 5000] and k.need["side"][0] == 8192
    for s in k.need:
        k.allocate(s)
    assert k.memory["compute"].ring.numel() == max(6 << 20, k.ring_floor)
    assert k.memory["side"].ring.numel() == k.ring_floor  # at least twice the last-level cache
    before = {s: (m.ring.data_ptr(), m.scratch.data_ptr()) for s, m in k.memory.items()}
    buffers = {"w": torch.zeros(1024, dtype=torch.uint8), "act": torch.zeros(1 << 20, dtype=torch.uint8),
               "g": torch.ones(16 * 32, dtype=torch.bfloat16).view(torch.uint8)}
    buffers["act"][:64 * 16 * 2] = torch.ones(64 * 16, dtype=torch.bfloat16).view(torch.uint8)
    prog = _program()
    for op in prog.step:
        if isinstance(op, (O.Compute, O.Copy)):
            k.execute(op, buffers)
    out = k.memory["compute"].scratch[:64 * 32 * 2].view(torch.bfloat16)
    assert bool((out == 16).all())  # ones(64x16) @ ones(16x32): k = 16, from the op's own buffers
    assert {s: (m.ring.data_ptr(), m.scratch.data_ptr()) for s, m in k.memory.items()} == before
    assert k.nbytes == sum(m.nbytes for m in k.memory.values())


def test_pinned_copies_move_each_way():
    c = PinnedCopies(torch.device("cpu"), 64)
    c.host[:8] = 7
    c.run(O.CopyDirection.H2D, 8)
    assert c.dev[:8].tolist() == [7] * 8 and c.dev[8:].sum() == 0
    c.dev[:4] = 3
    c.run(O.CopyDirection.D2H, 4)
    assert c.host[:4].tolist() == [3] * 4 and c.host[4:8].tolist() == [7] * 4
    with pytest.raises(ValueError, match="host and device only"):
        c.run(O.CopyDirection.D2D, 4)


def _orders(n):
    """Addition orders a backend may use: in rank order, reversed, a tree, and a ring's
    rotation (each chunk starts at another rank)."""
    yield list(range(n))
    yield list(range(n))[::-1]
    yield [(i + n // 2) % n for i in range(n)]


def _sum_in(dtype, terms, order):
    acc = torch.zeros_like(terms[0], dtype=dtype)
    for r in order:
        acc = acc + terms[r].to(dtype)
    return acc


def _tree(dtype, terms):
    level = [t.to(dtype) for t in terms]
    while len(level) > 1:
        level = [level[i] + level[i + 1] if i + 1 < len(level) else level[i] for i in range(0, len(level), 2)]
    return level[0]


@pytest.mark.parametrize("p", [1, 2, 3, 22, 23, 64, 127, 128, 255, 300, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int32])
def test_checked_sums_are_exact_in_any_dtype_for_any_group(p, dtype):
    """Every partial sum of the check values is an integer of at most 254, so the
    result is exact whatever the dtype, the group size and the order of addition (filling
    rank r with r + 1 gave p(p + 1)/2, past bf16's exact integers from 23 ranks on)."""
    numel = 300
    terms = [sum_terms(r, p, numel) for r in range(p)]
    expected = sum_expected(p, numel)
    assert float(expected.max()) <= 2 * SUM_TERMS and float(expected.min()) >= 1
    for order in _orders(p):
        assert torch.equal(_sum_in(dtype, terms, order).to(torch.float64), expected)
    assert torch.equal(_tree(dtype, terms).to(torch.float64), expected)
    # a reduce-scatter keeps one chunk: the expected values at its offset
    chunk = numel // 3
    assert torch.equal(sum_expected(p, chunk, offset=chunk), expected[chunk:2 * chunk])
    # a member missing shows at the elements it adds to
    if p > 1:
        short = _sum_in(dtype, terms[:-1], range(p - 1)).to(torch.float64)
        assert not torch.equal(short, expected)


def test_checked_shards_and_max_are_exact_and_tell_members_apart():
    for dtype in (torch.bfloat16, torch.float16, torch.uint8):
        for r in (0, 1, 250, 1000):
            v = shard_values(r, 500, 7)
            assert float(v.min()) >= 1 and float(v.max()) <= 251
            assert torch.equal(v.to(dtype).to(torch.float64), v)  # exact in the dtype
    for a, b in itertools.combinations(range(12), 2):  # a chunk from another member or op differs
        assert not torch.equal(shard_values(a, 8, 3), shard_values(b, 8, 3))
    assert not torch.equal(shard_values(0, 8, 3), shard_values(0, 8, 4))
    p = 40
    got = torch.stack([shard_values(r, 100, 5) for r in range(p)]).to(torch.bfloat16).max(dim=0).values
    assert torch.equal(got.to(torch.float64), max_expected(p, 100, 5))
