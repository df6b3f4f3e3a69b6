"""Where the ranks' garbage collections fall in a real data-parallel DeepSpeed job.

    python bench/gc_alignment.py --ranks 2 --steps 150 -o traces/host-costs/gc/alignment-2.json

A full collection stops one rank's host for a pause that grows with the objects its
interpreter tracks (``bench/gc_pauses.py``); the other ranks wait for it at their next
collective. What the job pays depends on where the ranks' passes fall: at the same point
of the step, the job pays one pause per pass; each at its own phase, one per rank's pass
(``commsim.sim.host_gc``, ``--host-gc``'s ``aligned`` / ``independent``). This runs real
DeepSpeed (``runtime.examples.ds_train``, CPU accelerator, gloo, ``--ranks`` processes;
``--runner fsdp2``: PyTorch FSDP2, ``runtime.examples.fsdp_train``) on a deep, narrow
RoBERTa (``--layers`` layers of width 64: a step's Python is the depth's, its tensors
small) with ``--gc-log``, which times every collection of every rank with the step,
phase and module hooks run so far (the program position), and reports:

* per rank, the collections per generation, the objects promoted to the oldest generation
  a step (the survivors of its generation-1 passes), and each full pass (step, phase,
  hook, pause, the objects it visited and the time per object);
* alignment: the collections (from step 3 on, after start-up's rank-dependent work) that
  every rank ran at the same step and hook, and for the full passes, the spread of their
  start times across the ranks;
* what the job paid: each step with a full pass against the median step, in pauses.

``--gc-threshold`` lowers CPython's thresholds (700, 10, 10) so that a short run collects
as often as a long one does; the program positions, not the thresholds, are what is
compared. The figures are this machine's; traces/README.md ("gc/") has runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTLED_STEP = 3  # collections from this step on are compared (start-up differs by rank)


def alignment(logs: list[dict]) -> dict:
    """The alignment report of every rank's ``--gc-log`` (rank order)."""
    assert logs, "no rank's log"
    ranks = []
    for d in logs:
        ev = [e for e in d["events"] if e["step"] >= SETTLED_STEP]
        full = [e for e in d["events"] if e["generation"] == 2 and e["step"] >= 0]
        # the objects generation-1 passes promoted to the oldest generation, per step
        # settled (logs that counted them: ds_train's --gc-log does)
        promoted = [e["survivors"] for e in ev if e["generation"] == 1 and "survivors" in e]
        settled = len(d["step_times_s"]) - SETTLED_STEP
        ranks.append({"collections": {str(g): sum(e["generation"] == g for e in ev) for g in (0, 1, 2)},
                      "promoted_per_step": round(sum(promoted) / settled, 1) if promoted and settled > 0 else None,
                      "full_passes": [{"step": e["step"], "phase": e["phase"], "hooks": e["hooks"],
                                       "pause_ms": round(e["pause_s"] * 1e3, 1),
                                       **({"objects": e["examined"],
                                           "us_per_object": round(e["pause_s"] * 1e6 / e["examined"], 3)}
                                          if "examined" in e else {})} for e in full]})
    # collections by program position (several may fall between two hooks)
    positions = [Counter((e["step"], e["hooks"]) for e in d["events"] if e["step"] >= SETTLED_STEP) for d in logs]
    common, union = positions[0], positions[0]
    for c in positions[1:]:
        common, union = common & c, union | c
    # the full passes each rank ran, by program position; those every rank ran there
    full_at = [{(e["step"], e["hooks"]): e for e in d["events"] if e["generation"] == 2 and e["step"] >= 0}
               for d in logs]
    shared = sorted(set.intersection(*(set(f) for f in full_at)))
    spreads = [(max(f[p]["at_s"] for f in full_at) - min(f[p]["at_s"] for f in full_at)) * 1e3 for p in shared]
    # what the job paid: a step with a full pass against the rank's median step
    paid = []
    for step in sorted({p[0] for f in full_at for p in f}):
        extra = statistics.fmean(d["step_times_s"][step] - statistics.median(d["step_times_s"][SETTLED_STEP:])
                                 for d in logs)
        pause = statistics.fmean(e["pause_s"] for f in full_at for p, e in f.items() if p[0] == step)
        paid.append({"step": step, "extra_ms": round(extra * 1e3, 1), "pause_ms": round(pause * 1e3, 1),
                     "pauses_paid": round(extra / pause, 2) if pause else None})
    return {"ranks": ranks,
            "positions_shared": sum(common.values()), "positions_any": sum(union.values()),
            "full_passes_shared": len(shared), "full_passes_any": len(set.union(*(set(f) for f in full_at))),
            "full_pass_start_spread_ms": [round(s, 1) for s in spreads],
            "steps_with_a_full_pass": paid,
            "median_step_ms": [round(statistics.median(d["step_times_s"][SETTLED_STEP:]) * 1e3, 1) for d in logs]}


def run_job(ranks: int, steps: int, layers: int, stage: int, seq: int, threshold: str | None, folder: Path,
            steps_per_print: int | None = None, runner: str = "deepspeed") -> list:
    cfg = folder / "model" / "config.json"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(json.dumps({"model_type": "roberta", "hidden_size": 64, "num_hidden_layers": layers,
                               "num_attention_heads": 4, "intermediate_size": 256, "vocab_size": 1000,
                               "max_position_embeddings": seq + 2, "type_vocab_size": 1}))
    ds = folder / "ds.json"
    ds_cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    if steps_per_print:
        ds_cfg["steps_per_print"] = steps_per_print  # rank 0 alone logs its step line
    ds.write_text(json.dumps(ds_cfg))
    prefix = folder / "gc"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               TORCH_EXTENSIONS_DIR=str(ROOT / ".cache" / "torch_extensions"))
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    if runner == "fsdp2":  # FSDP2's defaults: every layer a unit, the root another
        cmd = launch + ["-m", "runtime.examples.fsdp_train", "--model", str(cfg), "--seq", str(seq), "--micro-batch",
                        "2", "--steps", str(steps), "--gc-log", str(prefix)]
    else:
        cmd = launch + ["-m", "runtime.examples.ds_train", "--model", str(cfg), "--seq", str(seq), "--ds-config",
                        str(ds), "--steps", str(steps), "--gc-log", str(prefix)]
    if threshold:
        cmd += ["--gc-threshold", threshold]
    what = "FSDP2" if runner == "fsdp2" else f"ZeRO-{stage}"
    print(f"running {ranks} ranks x {steps} steps of a {layers}-layer model ({what})...", file=sys.stderr)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"the job failed:\n{out.stderr[-3000:]}")
    return [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(ranks)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--runner", choices=("deepspeed", "fsdp2"), default="deepspeed",
                    help="real DeepSpeed (ds_train) or PyTorch FSDP2 (fsdp_train)")
    ap.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3), help="DeepSpeed's ZeRO stage")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--gc-threshold", metavar="T0,T1,T2", help="CPython's collector thresholds for the run")
    ap.add_argument("--steps-per-print", type=int,
                    help="DeepSpeed's steps_per_print: rank 0 alone logs a line every so many steps (Python work "
                    "the other ranks do not do; default: none, DeepSpeed 0.19's default)")
    ap.add_argument("-o", "--output", help="write the report (JSON) here")
    args = ap.parse_args()
    if args.ranks < 2 or args.steps <= SETTLED_STEP + 1:
        ap.error(f"--ranks must be at least 2 and --steps more than {SETTLED_STEP + 1}")
    with tempfile.TemporaryDirectory() as tmp:
        logs = run_job(args.ranks, args.steps, args.layers, args.stage, args.seq, args.gc_threshold, Path(tmp),
                       args.steps_per_print, args.runner)
    rep = {"runner": args.runner, "ranks": args.ranks, "steps": args.steps, "layers": args.layers,
           "stage": args.stage if args.runner == "deepspeed" else None, "seq": args.seq,
           "gc_threshold": args.gc_threshold, "steps_per_print": args.steps_per_print, "python": sys.version.split()[0], **alignment(logs)}
    for r, rr in enumerate(rep["ranks"]):
        print(f"rank {r}: collections (gen 0/1/2) {rr['collections']}; {rr['promoted_per_step']} objects promoted a "
              "step; full passes "
              + (", ".join(f"step {p['step']} {p['phase']} hook {p['hooks']} {p['pause_ms']} ms"
                           + (f" over {p['objects']} objects ({p['us_per_object']} us each)" if "objects" in p else "")
                           for p in rr["full_passes"]) or "none"))
    print(f"collections at the same step and hook on every rank: {rep['positions_shared']} of "
          f"{rep['positions_any']}; full passes: {rep['full_passes_shared']} of {rep['full_passes_any']}, "
          f"start spread {rep['full_pass_start_spread_ms']} ms")
    for p in rep["steps_with_a_full_pass"]:
        print(f"step {p['step']}: {p['extra_ms']} ms over the median step, pause {p['pause_ms']} ms: "
              f"{p['pauses_paid']} pauses paid")
    if args.output:
        tmp = Path(args.output + ".tmp")
        tmp.write_text(json.dumps(rep, indent=1) + "\n")
        tmp.replace(args.output)


if __name__ == "__main__":
    main()
