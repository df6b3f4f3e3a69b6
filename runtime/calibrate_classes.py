"""Calibration of a framework's own memory-bound kernels, by class and dtype (CPUs).

The executor runs every memory-bound op as one stand-in kernel (``runtime.kernels``:
a copy over the op's bytes), and the profile's ``elementwise_points`` price exactly
that. A framework's run launches the real kernels: LayerNorm, softmax, dropout (a
random mask per element), a reduction over rows, an embedding lookup, an add. On a CPU
they differ from a copy, and from each other, by several times per byte, and their
dtype changes them in different ways: without bf16 units, a bf16 LayerNorm or softmax
computes in fp32 per element, so its time per byte is about twice fp32's, while a bf16
copy moves half the bytes in half the time. One rate per byte for all of them prices
a bf16 step's non-GEMM work at half its fp32 time, which it does not take.

So calibrate times, on each rank at once, the ATen kernel each ``ComputeKind`` stands
for, forward and backward, in fp32 and bf16, at a few sizes, on operands cycled through
a ring larger than the last-level cache (a step's activations come from memory), and
records (bytes, seconds) per kernel, the bytes counted as the generators count them
(``commsim.models.eager``: what the kernel reads plus what it writes). The cost model
(``commsim.hardware.framework_kernels``) prices a framework's ops from them. GPUs: not
measured (None); their kernels are priced from the executor's stand-in, as before.

A mixin of ``runtime.calibrate.Calibrator``: it uses ``platform``, ``device``,
``quick``, ``timer``, ``log`` and ``_together``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from commsim.hardware.framework_kernels import KINDS as PRICED
from runtime.kernels import MIN_RING_BYTES, last_level_cache_bytes

WIDTH = 1024  # the row width of the row-wise kernels (a hidden size)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MAX_SETS = 64  # operand sets per ring: enough to leave the cache with all but the smallest


def _operands(kind: str, rows: int, dtype: torch.dtype, device: torch.device) -> tuple[Callable, Callable, int, int]:
    """(forward, backward, forward bytes, backward bytes) of one operand set of ``rows``
    x WIDTH elements: closures calling the ATen kernel ``kind`` stands for, and each
    call's bytes as ``commsim.models.eager`` counts them (read + written)."""
    a = torch.tensor([], dtype=dtype).element_size()
    n, w = rows * WIDTH, WIDTH
    x = torch.randn(rows, w, device=device).to(dtype)
    g = torch.randn(rows, w, device=device).to(dtype)
    if kind == "elementwise":  # an add: two inputs, one output (and the same in backward)
        y = torch.randn(rows, w, device=device).to(dtype)
        f = (lambda: torch.add(x, y))
        return f, f, 3 * n * a, 3 * n * a
    if kind == "reduction":  # a bias gradient: the sum over rows
        f = (lambda: x.sum(0))
        return f, f, n * a + w * a, n * a + w * a
    if kind == "norm":
        wt = torch.ones(w, device=device, dtype=dtype)
        b = torch.zeros(w, device=device, dtype=dtype)
        _, mean, rstd = torch.native_layer_norm(x, (w,), wt, b, 1e-5)
        fwd = (lambda: torch.native_layer_norm(x, (w,), wt, b, 1e-5))
        bwd = (lambda: torch.ops.aten.native_layer_norm_backward(g, x, (w,), mean, rstd, wt, b, [True, True, True]))
        return fwd, bwd, 2 * n * a + 2 * w * a + 2 * rows * 4, 3 * n * a + 2 * rows * 4 + 4 * w * a
    if kind == "softmax":
        out = torch._softmax(x, -1, False)
        fwd = (lambda: torch._softmax(x, -1, False))
        bwd = (lambda: torch._softmax_backward_data(g, out, -1, dtype))
        return fwd, bwd, 2 * n * a, 3 * n * a
    if kind == "dropout":  # native_dropout: the output and a one-byte mask; backward applies it
        _, mask = torch.native_dropout(x, 0.1, True)
        fwd = (lambda: torch.native_dropout(x, 0.1, True))
        bwd = (lambda: torch.ops.aten.native_dropout_backward(g, mask, 1 / 0.9))
        return fwd, bwd, 2 * n * a + n, 2 * n * a + n
    if kind == "embedding":  # rows token ids into a table of rows rows; backward: the dense gradient
        table = torch.randn(rows, w, device=device).to(dtype)
        idx = torch.randint(0, rows, (rows,), device=device)
        fwd = (lambda: torch.nn.functional.embedding(idx, table))
        bwd = (lambda: torch.ops.aten.embedding_dense_backward(g, idx, rows, -1, False))
        return fwd, bwd, 2 * n * a + rows * 8, 2 * n * a + rows * 8
    raise AssertionError(f"no kernel for {kind}")


KINDS = tuple(PRICED)  # every class the cost model prices from the table


class FrameworkKernelMeasurements:
    """Benchmarks of a framework's memory-bound kernels for a ``Calibrator``."""

    platform: Any
    device: Any
    quick: bool
    timer: Any

    def framework_kernels(self) -> dict[str, Any] | None:
        """dtype -> kind -> {"fwd": [[bytes, s], ...], "bwd": ...} of the real kernels
        (the ranks' mean per call: see ``Calibrator._together``), plus a ``source`` line; None on GPUs."""
        if not self.platform.inline_kernels:
            return None
        sizes = (4, 1024) if self.quick else (4, 128, 1024)  # rows of WIDTH: 16 KiB to 4 MiB of fp32
        ring = max(MIN_RING_BYTES, 2 * last_level_cache_bytes(self.device))
        out: dict[str, Any] = {}
        for dname, dtype in DTYPES.items():
            table: dict[str, dict[str, list[list[float]]]] = {}
            for kind in KINDS:
                pts: dict[str, list[list[float]]] = {"fwd": [], "bwd": []}
                for rows in sizes:
                    first = _operands(kind, rows, dtype, self.device)
                    sets = [first] + [_operands(kind, rows, dtype, self.device)
                                      for _ in range(min(MAX_SETS, ring // max(first[2], 1)) - 1)]
                    for d, (call, nbytes) in (("fwd", (0, 2)), ("bwd", (1, 3))):
                        at = [0]

                        def one(sets=sets, call=call, at=at) -> None:
                            sets[at[0]][call]()
                            at[0] = (at[0] + 1) % len(sets)

                        pts[d].append([float(first[nbytes]), self._together(one)])
                    del sets, first
                table[kind] = pts
            out[dname] = table
            self.log(f"framework kernels ({dname}, {sizes[-1] * WIDTH} elements): " + ", ".join(
                f"{k} {table[k]['fwd'][-1][1] * 1e3:.2f}/{table[k]['bwd'][-1][1] * 1e3:.2f} ms" for k in KINDS))
        out["source"] = ("ATen kernels timed by commsim calibrate on this machine (fwd/bwd, fp32 and bf16, operands "
                         "cycled through a ring larger than the last-level cache)")
        return out
