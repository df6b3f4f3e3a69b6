"""From ``runtime.ds_host_costs``' measurements to ``knobs.HostCosts`` fields: several
processes' runs merged (each call's minimum), each release's calls fitted over two world
sizes (``derive``), and the releases derived from others' stored figures where they were
timed on another machine (0.5.4 beside 0.5.10: ``derive_before_pr1188``; the hook
plumbing: ``derive_plumbing``)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from runtime.ds_host_setup import FLUSH_COUNTS
from runtime.ds_host_timing import fit, min_over_steps

def min_over_runs(docs: list[dict]) -> dict:
    """One measurement from several processes' of the same release and world: each
    call's minimum over them (the same calls with the same counts in each). This
    machine's speed drifts between processes (the same flush 10-30% apart), so the
    fastest process's time of each call is what the routine costs, as each call's
    minimum over the steps is within one."""
    first = docs[0]
    assert all((d["deepspeed"], d["world"]) == (first["deepspeed"], first["world"]) for d in docs)
    for routine, rows in first["calls"].items():
        assert all([c for _, c in d["calls"][routine]] == [c for _, c in rows] for d in docs), routine
    calls = {k: [[t, c] for t, c in v] for k, v in min_over_steps([d["calls"] for d in docs]).items()}
    prims = {k: min(d["primitives"][k] for d in docs) for k in first["primitives"]}
    out = {**first, "calls": calls, "primitives": prims, "processes": len(docs)}
    if all("plumbing" in d for d in docs):
        # the fastest process's window less the fastest plain step, as for the calls (three
        # sets of twelve processes: 6.0% apart this way, 17.9% as the median of each
        # process's own difference; traces/README.md, "The plumbing over processes")
        pl = [d["plumbing"] for d in docs]
        assert all((p["wrapped_calls"], p["hook_calls"]) == (pl[0]["wrapped_calls"], pl[0]["hook_calls"]) for p in pl)
        untimed, plain = min(p["untimed_ns"] for p in pl), min(p["plain_ns"] for p in pl)
        wrapper = statistics.median(p["wrapper_ns"] for p in pl)
        per_call = (untimed - plain - wrapper * pl[0]["wrapped_calls"]) / pl[0]["hook_calls"]
        out["plumbing"] = {**pl[0], "per_hook_call_ns": max(0, round(per_call)), "untimed_ns": untimed,
                           "plain_ns": plain, "wrapper_ns": round(wrapper),
                           "per_process_ns": [p["per_hook_call_ns"] for p in pl]}
    return out


# cudaLaunchKernel's host-side cost: back-to-back launches of a short kernel take
# 3.8 us each when they overlap the kernels' execution (NVIDIA Developer Blog, A. Gray,
# "Getting Started with CUDA Graphs", 2019: 9.6 us per kernel with a synchronize after
# each, 3.8 us without, 3.4 us as a graph, for a 2.9 us kernel).
CUDA_LAUNCH_NS = 3_800
# The p4d host's CPU (Xeon Platinum 8275CL) against this machine's, per thread: no
# single-thread benchmark of both was at hand, so taken as equal (a Zen 4 core is
# likely somewhat faster per thread than a Cascade Lake one: the p4d's costs are then
# underestimated, not overestimated).
CPU_SCALE = 1.0


# HostCosts field <- (the routine's fit, its term)
FITTED = {"module_hook_ns": ("fetch", "fixed_ns"), "gather_param_ns": ("fetch", "per_gathered_ns"),
          "gather_param_rank_ns": ("fetch", "per_gathered_x_rank_ns"), "wait_param_ns": ("fetch", "per_waited_ns"),
          "wait_param_rank_ns": ("fetch", "per_waited_x_rank_ns"),
          "release_hook_ns": ("release", "fixed_ns"), "release_param_ns": ("release", "per_param_ns"),
          "free_param_ns": ("release", "per_freed_ns"), "grad_hook_ns": ("grad_hook", "fixed_ns"),
          "reduce_flush_ns": ("flush", "fixed_ns"), "reduce_flush_rank_ns": ("flush", "per_rank_ns"),
          "reduce_param_ns": ("flush", "per_grad_ns"), "reduce_param_rank_ns": ("flush", "per_grad_x_rank_ns")}


def derive(paths: list[str], exact: bool = False) -> dict[str, dict[str, int]]:
    """HostCosts fields per release from the measurements at two or more world sizes:
    the calls of all of them fitted together, the loops over ranks as a per-rank term.
    Rounded to 100 ns for knobs.HOST_COSTS; ``exact``: to 1 ns (a calibration's
    figures: its per-rank terms are a few hundred ns, where 100 ns steps would be a
    20-50% quantisation)."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    out = {}
    for version in sorted({d["deepspeed"] for d in docs}):
        ds = [d for d in docs if d["deepspeed"] == version]

        def joint(routine, features, per_rank=(), rank=False, relative=False, known_rank_ns=0.0):
            """``per_rank``: features whose cost also grows with the world (a loop over
            ranks per item); ``rank``: a part of the fixed cost that does (``per_rank_ns``);
            ``known_rank_ns``: such a part measured apart, taken off each call first."""
            calls = []
            for d in ds:
                for t, c in d["calls"].get(routine, []):
                    t = t - known_rank_ns * d["world"]
                    c = dict(c)
                    for f in per_rank:
                        c[f"{f}_x_rank"] = c.get(f, 0) * d["world"]
                    if rank:
                        c["rank"] = d["world"]
                    calls.append((t, c))
            return fit(calls, list(features) + [f"{f}_x_rank" for f in per_rank] + (["rank"] if rank else []),
                       relative=relative)

        fetch = joint("fetch", ["param", "gathered", "waited"], per_rank=("gathered", "waited"))
        release = joint("release", ["param", "freed"])
        grad = joint("grad_hook", [])
        # The flush timed alone over 1-40 gradients where measured (0.19.8), fitted on
        # relative residuals; else the step's own flushes. Its fixed part grows with the
        # world too: reduce_scatter_coalesced chunks the flat buffer into one view per
        # rank once per flush. Where the run timed torch.chunk's per view (primitives),
        # that is the per-rank term, taken off before the fit; else it is fitted (the
        # stored tables: an intercept between two worlds, 39% apart over three
        # calibrations, where the chunk alone is within 1%).
        sweep = all(d["calls"].get("flush_sweep") for d in ds)
        chunk = [d["primitives"].get("chunk_view_ns") for d in ds]
        chunk_ns = float(min(chunk)) if sweep and all(v is not None for v in chunk) else None
        flush = joint("flush_sweep" if sweep else "flush", ["grad"], per_rank=("grad",), rank=chunk_ns is None,
                      relative=sweep, known_rank_ns=chunk_ns or 0.0)
        if chunk_ns is not None:
            flush["per_rank_ns"] = chunk_ns
        debug = next((d["debug_string_ns"] for d in ds if d.get("debug_string_ns")), 0)
        # the hook plumbing (ds_host_plumbing): no loop over ranks, so the worlds' median
        hooks = [d["plumbing"]["per_hook_call_ns"] for d in ds if "plumbing" in d]
        small = [d for d in ds if d["world"] == min(x["world"] for x in ds)][0]
        prim = small["primitives"]

        def scaled(v: float) -> int:
            return int(round(v * CPU_SCALE, 0 if exact else -2))

        fits = {"fetch": fetch, "release": release, "grad_hook": grad, "flush": flush}
        out[version] = {
            "launch_ns": scaled(prim["torch_op_ns"]) + CUDA_LAUNCH_NS,
            "collective_launch_ns": scaled(prim["c10d_all_gather_ns"]) + CUDA_LAUNCH_NS,
            **{field: scaled(fits[routine][term]) for field, (routine, term) in FITTED.items()},
            "fetch_param_ns": scaled(max(0, fetch["per_param_ns"] - debug)),
            "debug_string_ns": scaled(debug),
            **({"hook_plumbing_ns": scaled(statistics.median(hooks))} if hooks else {}),
            "_fit": {"fetch_r2": fetch["r2"], "release_r2": release["r2"], "flush_r2": flush["r2"],
                     "fetch_rms_ns": fetch["rms_residual_ns"], "worlds": sorted(d["world"] for d in ds),
                     "flush_timed": f"alone, {FLUSH_COUNTS[0]}-{FLUSH_COUNTS[-1]} gradients" if sweep else "in the step",
                     "flush_per_rank": "torch.chunk per view, timed alone" if chunk_ns is not None else "fitted",
                     "date": ds[0]["date"], "cpu": ds[0]["machine"]["cpu"]},
        }
    return out


# DeepSpeed 0.5.4's routines that differ from 0.5.10's (its gather path builds the
# output list in a loop over the ranks; its release makes torch.ones(1) on the host):
# field -> the field whose machine ratio scales it where 0.5.10 has no such term
PR1188_CHANGED = {"gather_param_ns": "gather_param_ns", "gather_param_rank_ns": "gather_param_ns",
                  "free_param_ns": "free_param_ns"}


def derive_before_pr1188(stored_0510: dict[str, int], paths: list[str]) -> dict[str, int]:
    """0.5.4's HostCosts fields from a run of 0.5.4 beside 0.5.10 on one machine
    (``paths``: both releases, two worlds each) and 0.5.10's stored figures from
    another: 0.5.10's figures, with each routine whose code differs scaled by the two
    releases' ratio on the common machine (a term 0.5.10 lacks, by the ratio of that
    routine between the two machines), so that the releases differ by their code."""
    both = derive(paths)
    new, old = both["0.5.4"], both["0.5.10"]
    out = {k: v for k, v in stored_0510.items() if not k.startswith("_")}
    for field, base in PR1188_CHANGED.items():
        if old[field]:
            value = stored_0510[field] * new[field] / old[field]
        else:
            value = new[field] * stored_0510[base] / old[base]
        out[field] = int(round(value, -2))
    return out


# the routines whose per-call minima measure a machine's speed on a release's code
SPEED_ROUTINES = ("fetch", "release", "grad_hook", "flush")


def machine_ratio(stored: list[dict], today: list[dict]) -> float:
    """How much slower the stored runs' machine ran one release's code than today's: its
    timed routines' per-call minima summed in the stored runs over the same sum in
    today's (the same calls with the same counts), the median over the stored worlds.
    Both lists hold runs of one release; several of today's at a world are merged
    (``min_over_runs``)."""
    ratios = []
    for old in stored:
        same = [d for d in today if d["world"] == old["world"]]
        assert same, f"{old['deepspeed']}: no run at {old['world']} ranks"
        new = min_over_runs(same) if len(same) > 1 else same[0]
        t_old = sum(t for r in SPEED_ROUTINES for t, _ in old["calls"].get(r, []))
        t_new = sum(t for r in SPEED_ROUTINES for t, _ in new["calls"].get(r, []))
        ratios.append(t_old / t_new)
    return statistics.median(ratios)


def derive_plumbing(stored: list[dict], today: list[dict]) -> dict[str, int]:
    """``hook_plumbing_ns`` per release, for releases whose stored figures were timed on
    another machine than the plumbing (``ds_host_plumbing``, which the stored runs did
    not measure). ``today``: runs with the plumbing, each release at the stored runs'
    worlds (``min_over_runs`` merges or not); ``stored``: the stored runs. A release's
    plumbing is its runs' median per hook call times that release's machine ratio
    (``machine_ratio``)."""
    out = {}
    for version in sorted({d["deepspeed"] for d in stored}):
        now = [d for d in today if d["deepspeed"] == version and "plumbing" in d]
        then = [d for d in stored if d["deepspeed"] == version]
        assert now, f"no run of {version} with the hook plumbing"
        per_call = statistics.median(d["plumbing"]["per_hook_call_ns"] for d in now)
        out[version] = int(round(per_call * CPU_SCALE * machine_ratio(then, now), -2))
    return out
