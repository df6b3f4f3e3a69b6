"""What each of the seed's mechanisms costs in a predicted step: the table of
docs/deepspeed-versions.md.

    python bench/deepspeed_versions.py            # the seed scenario: roberta-10b, 8 p4d, EFA
    python bench/deepspeed_versions.py --json

Predicts the seed scenario with ``baseline`` (DeepSpeed 0.5.10) and ``optimized``
(0.6.0), finds each mechanism's ops in the predicted trace by their labels and kinds,
and sums them: how many, how long they ran on their streams (a host sync: how long it
blocked the host). It also predicts the baseline with each knob switched to 0.6.0's
side alone: the step time that saves. Figures, not fits: nothing here sets a constant.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from commsim.api import Scenario, predict  # noqa: E402
from commsim.ir import ops as O  # noqa: E402
from commsim.strategies.knobs import KNOB_PRESETS, Knobs  # noqa: E402

AG, RS = O.CollectiveKind.ALL_GATHER, O.CollectiveKind.REDUCE_SCATTER


def _label(op) -> str:
    return getattr(op, "label", "")


# mechanism -> (knob, predicate on an op); an op counts under the first that matches
MECHANISMS: list[tuple[str, str, object]] = [
    ("device sync before each prefetched gather (pp:882)", "fine_grained_sync",
     lambda op: isinstance(op, O.HostSync) and "before the prefetch all-gather" in op.label),
    ("device sync after a fetch's demand gathers (pp:984)", "fine_grained_sync",
     lambda op: isinstance(op, O.HostSync) and op.label.startswith("demand all-gather")),
    ("stream + device sync at a fetch needing a gather (s3:541-542)", "fine_grained_sync",
     lambda op: isinstance(op, O.HostSync) and op.label.startswith("fetch: ")),
    ("fetch event back-pressure (s3:321-326)", "max_outstanding_coalesced",
     lambda op: isinstance(op, O.HostSync) and op.label.startswith("fetch back-pressure")),
    ("demand all-gathers (fetch)", "precomputed_fetch",
     lambda op: isinstance(op, O.Collective) and op.kind is AG and ".fetch:" in op.label),
    ("prefetch all-gathers", "precomputed_fetch",
     lambda op: isinstance(op, O.Collective) and op.kind is AG and ".prefetch:" in op.label),
    ("zero fill of prefetch buffers (pp:875)", "empty_gather_buffers",
     lambda op: isinstance(op, O.Compute) and op.label.endswith(".zero_fill")),
    ("coalesced gather copy-in / copy-out (pp:877-879, 522-536)", "coalesced_collectives",
     lambda op: isinstance(op, O.Copy) and (op.label.endswith(".copy_in") or op.label.startswith("unflatten"))),
    ("debug-string norms: kernel (s3:454-458)", "debug_string_ops",
     lambda op: isinstance(op, O.Compute) and ".debug_norm:" in op.label),
    ("debug-string norms: .item() copy and host sync", "debug_string_ops",
     lambda op: (isinstance(op, O.Copy) and ".debug_item:" in op.label)
     or (isinstance(op, O.HostSync) and op.label.startswith("debug string"))),
    ("per-parameter overflow check: cast + sum (s3:2892-2910)", "fused_overflow_check",
     lambda op: isinstance(op, O.Compute) and op.label.startswith("optimizer.overflow:")),
    ("per-parameter overflow check: float() reads", "fused_overflow_check",
     lambda op: (isinstance(op, O.Copy) and op.label.startswith("optimizer.overflow_item:"))
     or (isinstance(op, O.HostSync) and op.label.startswith("float() of"))),
    ("inf/nan tracker per gradient (s3:2003-2010)", "fused_overflow_check",
     lambda op: isinstance(op, O.Compute) and (".isinf" in op.label or ".isnan" in op.label)),
    ("per-parameter norm .item() (s3:2443-2450)", "fused_grad_norm",
     lambda op: (isinstance(op, O.Copy) and "norm_item:" in op.label)
     or (isinstance(op, O.HostSync) and op.label.startswith(".item() of"))),
    ("list reduce-scatter flatten copy (pp:1114-1117)", "flat_reduce_scatter",
     lambda op: isinstance(op, O.Copy) and op.label.endswith(".flatten_list")),
    ("reduce-scatters", "coalesced_collectives",
     lambda op: isinstance(op, O.Collective) and op.kind is RS),
    ("whole-bucket divide per flush (s3:1950-1951)", "preallocated_reduce_buffers",
     lambda op: isinstance(op, O.Compute) and op.label.startswith("rs.divide:ipg_bucket")),
    ("shards stored a flush late on the copy stream (s3:2092-2147)", "preallocated_reduce_buffers",
     lambda op: isinstance(op, O.Copy) and op.label.startswith("store shard")),
    ("gradient partition zero-filled per step (s3:2063-2083)", "preallocated_reduce_buffers",
     lambda op: isinstance(op, O.Compute) and op.label.startswith("grads_in_partition.zero")),
    ("reduction stream sync per flush (s3:2159-2160, 2092-2093)", "max_outstanding_coalesced",
     lambda op: isinstance(op, O.HostSync) and ("before the flush" in op.label or "store shards" in op.label)),
    ("reduce event back-pressure (s3:1857-1860)", "max_outstanding_coalesced",
     lambda op: isinstance(op, O.HostSync) and op.label.startswith("reduce back-pressure")),
    ("persistent re-gather after the step (pp:919-986 / 1245-1312)", "",
     lambda op: isinstance(op, O.Collective) and op.kind is AG and ".persistent:" in op.label),
    ("module hooks' Python (fetch, release)", "",
     lambda op: isinstance(op, O.HostWork) and op.kind is O.HostKind.MODULE_HOOK),
    ("gather / wait / free Python", "",
     lambda op: isinstance(op, O.HostWork) and op.kind is O.HostKind.PYTHON),
    ("gradient hooks and bucket flushes' Python", "",
     lambda op: isinstance(op, O.HostWork) and op.kind is O.HostKind.GRAD_HOOK),
    ("debug strings' formatting", "debug_string_ops",
     lambda op: isinstance(op, O.HostWork) and op.kind is O.HostKind.DEBUG),
    ("kernel and collective launches", "",
     lambda op: isinstance(op, O.HostWork) and op.kind is O.HostKind.LAUNCH),
]


def mechanism_costs(pred) -> dict[str, tuple[int, float]]:
    """mechanism -> (ops, seconds) in rank 0's predicted step."""
    out = {name: [0, 0] for name, _, _ in MECHANISMS}
    recs = next(iter(pred.result.ranks.values())).records
    for r in recs:
        for name, _, match in MECHANISMS:
            if match(r.op):
                out[name][0] += 1
                out[name][1] += (r.end_ns - r.start_ns) / 1e9
                break
    return {k: (n, t) for k, (n, t) in out.items()}


def knob_alone(sc: Scenario) -> dict[str, float]:
    """Seconds each knob saves when switched alone to 0.6.0's side on the baseline."""
    base = predict(sc.with_(preset="baseline")).metrics.step_time_s
    opt = KNOB_PRESETS["optimized"]
    out = {}
    for f in fields(Knobs):
        m = predict(sc.with_(preset="baseline", knobs=(f"{f.name}={getattr(opt, f.name)}",))).metrics
        out[f.name] = base - m.step_time_s
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="roberta-10b")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--net", default="efa")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    sc = Scenario(model=args.model, nodes=args.nodes, net=args.net)
    preds = {p: predict(sc.with_(preset=p)) for p in ("baseline", "optimized")}
    costs = {p: mechanism_costs(pred) for p, pred in preds.items()}
    alone = knob_alone(sc)
    if args.json:
        print(json.dumps({"costs": costs, "knob_alone_s": alone,
                          "step_s": {p: pred.metrics.step_time_s for p, pred in preds.items()},
                          "stalls_s": {p: pred.metrics.stalls_s for p, pred in preds.items()}}, indent=1))
        return 0
    print(f"{args.model}, {args.nodes} p4d nodes, {args.net}: step "
          + ", ".join(f"{p} {pred.metrics.step_time_s:.3f} s" for p, pred in preds.items()))
    print(f"{'mechanism':<64}{'knob':<28}{'0.5.10 ops':>11}{'s':>9}{'0.6.0 ops':>11}{'s':>9}")
    for name, knob, _ in MECHANISMS:
        (nb, tb), (no, to) = costs["baseline"][name], costs["optimized"][name]
        if nb or no:
            print(f"{name:<64}{knob:<28}{nb:>11}{tb:>9.3f}{no:>11}{to:>9.3f}")
    print("\nstep time saved by each knob alone on the baseline (s):")
    for k, v in alone.items():
        print(f"  {k:<28}{v:+.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
