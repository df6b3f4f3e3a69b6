"""Subcommands that explore many predictions: ``sweep`` (a grid into a table), ``tune``
(the best DeepSpeed config that fits) and ``plot`` (figures of a sweep table)."""

from __future__ import annotations

import argparse
import json
import sys

from commsim.cli.common import add_hardware_flags, add_scenario_flags, check_outputs, positive_int, warn_what_ifs
from commsim.ir.errors import CommsimInputError


def cmd_sweep(args: argparse.Namespace) -> int:
    from commsim.api import scenario_from_args
    from commsim.sweep import failed_points, parse_grid, sweep, text_progress

    check_outputs(("-o", args.output))
    if not args.grid:
        raise CommsimInputError("--grid: give at least one axis, NAME=V1,V2,...")
    grid = parse_grid(args.grid)
    base = scenario_from_args(args)
    for cluster in grid.get("cluster", [base.cluster]):
        for gpus in grid.get("gpus_per_node", [base.gpus_per_node]):
            warn_what_ifs(cluster, gpus)
    n = 1
    for v in grid.values():
        n *= len(v)
    runtime_env = None
    if args.ray_runtime_env is not None:
        try:
            runtime_env = json.loads(args.ray_runtime_env)
        except json.JSONDecodeError as e:
            raise CommsimInputError(f"--ray-runtime-env: not JSON ({e})") from None
        if not isinstance(runtime_env, dict):
            raise CommsimInputError("--ray-runtime-env: a JSON object, e.g. '{\"pip\": [\"commsim\"]}'")
    if args.backend == "ray":
        from commsim.sweep.ray_backend import require_ray

        require_ray()  # before any output: without Ray the one line is the error
    elif args.address is not None or args.ray_runtime_env is not None:
        raise CommsimInputError("--address / --ray-runtime-env: only with --backend ray")
    on = "" if args.backend == "local" else " on ray"
    print(f"sweep: {n} points over {', '.join(grid)}{on} -> {args.output}", file=sys.stderr)
    df = sweep(base, grid, jobs=args.jobs, output=args.output, progress=None if args.quiet else text_progress(),
               backend=args.backend, address=args.address, runtime_env=runtime_env)
    errors = int((df["error"].notna() & (df["error"] != "")).sum()) if "error" in df else 0  # empty: NaN
    print(f"{args.output}: {len(df)} rows ({errors} with errors)")
    # this grid's points, whether they ran now or in an earlier run of a resumed sweep
    failed_here = failed_points(args.output, base, grid)
    if failed_here:
        print(f"commsim: {failed_here} of {n} points failed; the error column of {args.output} says why",
              file=sys.stderr)
        return 1
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from commsim.api import scenario_from_args
    from commsim.tune import tune
    from commsim.util.files import atomic_write_text

    if args.output is None:
        args.output = "ds_config.tuned.json" if args.strategy == "deepspeed" else "fsdp_config.tuned.json"
    check_outputs(("-o", args.output))
    warn_what_ifs(args.cluster, args.gpus_per_node)
    dims = [d for d in (args.search or "").split(",") if d] or None
    base = scenario_from_args(args)
    show = None if args.quiet or args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    result = tune(base, dims, jobs=args.jobs, max_rounds=args.rounds, progress=show)
    if not result.best.fits:
        raise CommsimInputError("no configuration searched fits in memory; try more nodes, "
                                "--search train_micro_batch_size_per_gpu,checkpointing, or a larger GPU")
    atomic_write_text(args.output, json.dumps(result.config, indent=2) + "\n")
    if args.json:
        print(json.dumps({"output": args.output, **result.to_json()}, indent=1, default=str))
        return 0
    print(f"{args.output}: written")
    print(result.explain())
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    import pandas as pd

    from commsim.report.plots import save_png, scaling, stall_bars

    check_outputs(("-o", args.output))
    try:
        df = pd.read_csv(args.table)
    except (OSError, ValueError) as e:
        raise CommsimInputError(f"{args.table}: cannot read as a CSV table: {e}") from None

    def columns(flag: str, raw: str | None) -> list[str]:
        cols = [c for c in (raw or "").split(",") if c]
        for c in cols:
            if c not in df.columns:
                raise CommsimInputError(f"{flag} {c}: not a column of {args.table}; columns: {', '.join(df.columns)}")
        return cols

    if args.kind == "scaling":
        columns("--x", args.x)
        columns("--y", args.y)
        fig = scaling(df, args.x, args.y, columns("--hue", args.hue), args.title)
    else:
        if "step_time_s" not in df.columns:
            raise CommsimInputError(f"{args.table}: no step_time_s column (is it a commsim sweep table?)")
        fig = stall_bars(df, columns("--label", args.label), args.title)
    save_png(fig, args.output)
    print(f"{args.output}: {args.kind} plot of {len(df)} rows")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="predict a grid of scenarios in parallel into a table (resumable)",
                       description="Predict every combination of the --grid axes (on top of the other flags, which "
                       "set the base scenario), in parallel (a local process pool, or Ray tasks with --backend ray), "
                       "appending one CSV row per point as it finishes; a rerun with the same -o skips the points "
                       "already there.")
    add_scenario_flags(p)
    add_hardware_flags(p)
    p.add_argument("--grid", action="append", metavar="NAME=V1,V2",
                   help="an axis: a predict setting (stage, net, nodes, model, preset, micro_batch, strategy, ...), "
                   "knob.NAME, ds.KEY or, with --strategy fsdp2 / fsdp1, fsdp.KEY (an --fsdp-config key) "
                   "(repeatable)")
    p.add_argument("--jobs", type=positive_int, default=2,
                   help="parallel workers (default 2); with --backend ray, the CPUs of the Ray instance it starts")
    p.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="local: a process pool on this machine (default); ray: batches of points as Ray tasks "
                   "(needs pip install 'commsim[ray]')")
    p.add_argument("--address", help="--backend ray: the Ray cluster to run on (auto, HOST:PORT or ray://HOST:PORT); "
                   "default: RAY_ADDRESS when set, else a local Ray instance of --jobs CPUs, started and shut down "
                   "here")
    p.add_argument("--ray-runtime-env", metavar="JSON",
                   help="--backend ray: Ray's runtime_env for the workers, e.g. '{\"pip\": [\"commsim==0.1.0\"]}' "
                   "when the cluster's Python lacks commsim")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("-o", "--output", default="sweep.csv", help="results CSV (default sweep.csv)")
    p.set_defaults(func=cmd_sweep, schedule=None)

    p = sub.add_parser("tune", help="search DeepSpeed (or FSDP2, FSDP1) settings for the best predicted throughput "
                       "that fits",
                       description="Coordinate descent over DeepSpeed keys (bucket sizes, prefetch, max live "
                       "parameters, reuse distance, persistence threshold, hpZ group size, micro-batch) and "
                       "activation checkpointing, each point a full prediction; writes the winning ds_config.json "
                       "and explains, change by change, why it wins. With --strategy fsdp2: over FSDP2's "
                       "reshard_after_forward, explicit prefetch, HSDP, micro-batch and checkpointing, writing the "
                       "winning FSDP2 config; with --strategy fsdp1: over FSDP1's sharding strategy, rate limiter, "
                       "backward and forward prefetch, micro-batch and checkpointing, writing the winning FSDP1 "
                       "config.")
    add_scenario_flags(p)
    add_hardware_flags(p, simulation=False)
    p.add_argument("--search", help="comma-separated dimensions to search (default: all that apply): "
                   "reduce_bucket_size, stage3_prefetch_bucket_size, stage3_max_live_parameters, "
                   "stage3_max_reuse_distance, stage3_param_persistence_threshold, zero_hpz_partition_size, "
                   "train_micro_batch_size_per_gpu, checkpointing; with --strategy fsdp2: reshard_after_forward, "
                   "forward_prefetch, backward_prefetch, hsdp_replicas, micro_batch, checkpointing; with "
                   "--strategy fsdp1: sharding_strategy, limit_all_gathers, backward_prefetch, forward_prefetch, "
                   "micro_batch, checkpointing")
    p.add_argument("--rounds", type=positive_int, default=3, help="at most this many rounds (default 3)")
    p.add_argument("--jobs", type=positive_int, default=2, help="parallel workers (default 2)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("-o", "--output", help="the config to write (default ds_config.tuned.json, or "
                   "fsdp_config.tuned.json with --strategy fsdp2 or fsdp1)")
    p.set_defaults(func=cmd_tune, schedule=None)

    p = sub.add_parser("plot", help="plot a sweep table: scaling curves or stall bars",
                       description="scaling: a metric against a column, one line per --hue group; stalls: "
                       "each row's step time split into compute and compute-stream stalls by cause.")
    p.add_argument("kind", choices=("scaling", "stalls"), help="what to draw")
    p.add_argument("table", help="a commsim sweep CSV")
    p.add_argument("--x", default="nodes", help="scaling: the x column (default nodes)")
    p.add_argument("--y", default="model_tflops_per_gpu", help="scaling: the y column (default model_tflops_per_gpu)")
    p.add_argument("--hue", help="scaling: comma-separated columns, one line per combination")
    p.add_argument("--label", help="stalls: comma-separated columns naming each bar")
    p.add_argument("--title", default="", help="plot title")
    p.add_argument("-o", "--output", required=True, metavar="PNG", help="the PNG to write")
    p.set_defaults(func=cmd_plot)
