"""commsim's NCCL tuning tables equal the ones read out of the released binaries
(docs/nccl/*.json, written by bench/nccl_constants.py)."""

import json
from pathlib import Path

import pytest

from commsim.hardware.nccl_tuning import ALGORITHMS, NCCL_2_10, NCCL_2_18, NCCL_2_27, PROTOCOLS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "nccl"
CASES = [(NCCL_2_10, "2.10.3"), (NCCL_2_18, "2.18.3"), (NCCL_2_27, "2.27.7")]


def _binary(release: str) -> dict:
    return json.loads((DOCS / f"nccl-{release}.json").read_text())


@pytest.mark.parametrize("tuning, release", CASES, ids=[r for _, r in CASES])
def test_latency_tables_are_the_binarys(tuning, release):
    b = _binary(release)
    assert b["nccl_version"] == release
    for algo in ALGORITHMS:
        if algo not in tuning.base_lat_us:
            assert algo not in b["baseLat"]  # 2.10 has no NVLS
            continue
        assert dict(tuning.base_lat_us[algo]) == b["baseLat"][algo], algo
        for hw in ("nvlink", "pci", "net"):
            assert dict(tuning.hw_lat_us[hw][algo]) == b["hwLat"][hw][algo], (hw, algo)


@pytest.mark.parametrize("tuning, release", CASES, ids=[r for _, r in CASES])
def test_bandwidth_tables_are_the_binarys(tuning, release):
    b = _binary(release)
    for arch in ("volta", "ampere", "hopper"):
        # 2.10 has no Hopper rows: NCCL treats an unknown compute capability as Ampere
        src = arch if arch in b["llMaxBws"] else "ampere"
        assert list(tuning.ll_max_bw[arch]) == b["llMaxBws"][src]
        assert list(tuning.tree_max_bw_per_channel[arch]) == b["perChMaxTreeBws"][src]
        if "ll128MaxBwPerCh" in b:
            ring = tree = [b["ll128MaxBwPerCh"]] * 3
        else:
            ring, tree = b["perChMaxRingLL128Bws"][src], b["perChMaxTreeLL128Bws"][src]
        assert list(tuning.ring_ll128_max_bw_per_channel[arch]) == ring
        assert list(tuning.tree_ll128_max_bw_per_channel[arch]) == tree
    for proto in PROTOCOLS:
        assert list(tuning.tree_correction[proto]) == b["treeCorrectionFactor"][proto]
