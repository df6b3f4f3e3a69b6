"""How a measured hardware profile enters a prediction: the cost model it becomes (for
a framework's run of the schedule or commsim's executor's, ``RUNNERS``), the checks that
refuse a scenario it cannot price, the report lines saying what came from it, and which
host costs the schedule's host ops were priced from.

Scenario-level helpers of ``commsim.api.predict``; they take the scenario as ``sc``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from commsim.hardware.costs import CostModel, SpecCostModel
from commsim.hardware.specs import cluster_preset
from commsim.ir.errors import CommsimInputError
from commsim.ir.schedule import Schedule

if TYPE_CHECKING:
    from commsim.api import Scenario

RUNNERS = ("framework", "executor")


def cost_model(sc: Scenario, precision: str) -> tuple[CostModel, str]:
    if sc.runner not in RUNNERS:
        raise CommsimInputError(f"--runner {sc.runner}: must be one of {', '.join(RUNNERS)}")
    if sc.hw_profile:
        from commsim.hardware.profile_doc import load_profile

        prof = load_profile(sc.hw_profile, precision)
        if sc.runner == "framework":
            prof = prof.run_by_framework()
        return prof, f"profile {sc.hw_profile}"
    cluster = cluster_preset(sc.cluster, sc.nodes, sc.net, sc.gpus_per_node, sc.nccl_stack)
    return SpecCostModel(cluster, precision), cluster.name


def _ranks_per_node(sc: Scenario, schedule: Schedule, cluster) -> int:
    """How many of the schedule's ranks share a node: --gpus-per-node, else the
    schedule file's own, else the cluster's; never more than the schedule has."""
    per_node = sc.gpus_per_node or (schedule.meta.gpus_per_node if sc.schedule else None) or \
        cluster.node.gpus_per_node
    return max(1, min(per_node, schedule.world_size))


def check_profile_fits(prof: Any, path: str, sc: Scenario, schedule: Schedule, cluster) -> tuple[str, ...]:
    """Refuse (one line naming the profile and the mismatch) a scenario the measured
    profile cannot price, before simulating; returns what the prediction takes from the
    profile and what from the preset, for the report.

    * another backend than the cluster's platform: every cluster preset is a GPU
      cluster (NCCL); naming one (``--cluster`` other than the default, or a fabric with
      ``--net``) asks for it, which a CPU (gloo) profile has never measured. Without
      them the default cluster only lends the world's shape and price, and the
      profile's machine is what is predicted;
    * more ranks on a node than were measured on one: they share the node's links and
      cores, which the profile measured with fewer;
    * collectives over more ranks than any group measured in their placement (inside a
      node, across nodes), unless ``extrapolate``: the nearest measured group then
      prices them, and a warning says so."""
    from commsim.hardware.profile import INTER_NODE, INTRA_NODE
    from commsim.ir import ops as O

    named = [f for f, given in (("--net " + str(sc.net), sc.net is not None),
                                ("--cluster " + sc.cluster, sc.cluster != type(sc).cluster)) if given]
    if named and prof.backend != "nccl":
        raise CommsimInputError(f"--hw-profile {path}: a {prof.backend} profile of {', '.join(prof.devices)} cannot "
                                f"price the GPU cluster {cluster.name} ({' '.join(named)}); calibrate that cluster with "
                                "--backend nccl, or leave out --net / --cluster to predict the profiled machine")
    per_node = _ranks_per_node(sc, schedule, cluster)
    if per_node > prof.ranks_per_node:
        raise CommsimInputError(f"--hw-profile {path}: measured {prof.ranks_per_node} rank(s) per node, the scenario "
                                f"puts {per_node} on a node; calibrate with {per_node} ranks per node or set "
                                f"--gpus-per-node {prof.ranks_per_node}")
    measured: dict[str, int] = {}
    for place, size in prof.groups_measured:
        measured[place] = max(measured.get(place, 0), size)
    asked: dict[str, int] = {}
    for program in schedule.programs:
        for op in program.step:
            if isinstance(op, O.Collective) and len(op.group) >= 2:
                place = INTRA_NODE if len({r // per_node for r in op.group}) == 1 else INTER_NODE
                asked[place] = max(asked.get(place, 0), len(op.group))
    words = {INTRA_NODE: "inside a node", INTER_NODE: "across nodes"}
    beyond = [(place, p) for place, p in sorted(asked.items()) if p > measured.get(place, 0)]
    for place, p in beyond:
        have = (f"groups of at most {measured[place]}" if place in measured else "no group") + f" {words[place]}"
        if not sc.extrapolate:
            raise CommsimInputError(f"--hw-profile {path}: the schedule has collectives over {p} ranks {words[place]}, "
                                    f"the profile measured {have}; calibrate a job that large, or pass --extrapolate "
                                    "to price them from the nearest measured group")
        sc.warnings.append(f"--extrapolate: collectives over {p} ranks {words[place]} priced from the profile's "
                           f"nearest measured group ({have})")
    return _profile_sources(prof, path, sc, schedule, cluster, per_node)


def _profile_sources(prof: Any, path: str, sc: Scenario, schedule: Schedule, cluster,
                     per_node: int) -> tuple[str, ...]:
    """Two report lines: what the profile gave the prediction, what the preset did."""
    from commsim.util.files import read_json

    groups = ", ".join(f"{size} {'inside a node' if place == 'intra_node' else 'across nodes'}"
                       for place, size in prof.groups_measured) or "none (one rank)"
    fields = ["GEMMs by size" + (" and exact shape" if prof.gemm_shapes else ""), "memory-bound kernels",
              "copies", f"collectives (groups measured: {groups})",
              *(["collectives' stall when compute follows them"]
                if any(f.in_step_points for fits in prof.collectives.values() for f in fits.values()) else []),
              "compute/communication contention",
              *(["executor overheads (--runner executor)"] if sc.runner == "executor" else []),
              *([f"a framework's memory-bound kernels by class ({prof.precision})"]
                if sc.runner == "framework" and prof.framework_kernels is not None else []),
              "allocation costs", f"memory size ({prof.hbm_bytes / 1e9:.1f} GB)"]
    if prof.cpu_cores:
        fields.append(f"CPU cores ({prof.cpu_cores})" + (", OS time slice" if prof.time_slice_ns else ""))
    if prof.rank_noise_sd or prof.rank_noise_slow_sd:
        fields.append("rank speed drift")
    if prof.platform.stalls:
        fields.append("rank stalls")
    doc = read_json(path, CommsimInputError)
    if isinstance(doc, dict) and "host_costs" in doc and sc.host_costs is None:
        fields.append("framework host costs")
    nodes = -(-schedule.world_size // per_node)
    return (f"from profile {path} ({prof.backend}, {', '.join(prof.devices)}; {prof.ranks_per_node} rank(s) per node "
            f"x {prof.nodes} node(s)): {', '.join(fields)}",
            f"from cluster preset {cluster.node.name}: the world's shape ({nodes} node(s) x {per_node} rank(s)) and the "
            f"price per hour")


def host_costs_used(sc: Scenario, schedule: Schedule) -> str:
    """Where the schedule's host-op durations came from; a warning when a profile measured
    host costs that a schedule file does not carry (a file's host ops are durations: they
    cannot be priced again, only generated again)."""
    used = schedule.meta.host_costs or "not recorded in the schedule (written before commsim recorded it)"
    if not sc.schedule or not sc.hw_profile:
        return used
    from commsim.util.files import read_json

    obj = read_json(sc.hw_profile, CommsimInputError)
    if isinstance(obj, dict) and "host_costs" in obj and f"measured into {sc.hw_profile}" not in used:
        sc.warnings.append(f"--hw-profile {sc.hw_profile}: its measured host costs do not reach --schedule "
                           f"{sc.schedule} (its host ops were priced from: {used}); generate the schedule with "
                           f"`commsim schedule --hw-profile {sc.hw_profile}` to use them")
    return f"from the schedule file: {used}"
