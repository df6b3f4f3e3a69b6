"""The notebooks run headless, with small parameters, and their own assertions hold.

Each notebook has one cell tagged ``parameters`` (papermill's convention); the test
inserts a cell after it with smaller values, executes the notebook in a fresh kernel
(this interpreter) and fails on any error, the notebooks' claim assertions included.
"""

from pathlib import Path

import pytest

NB_DIR = Path(__file__).resolve().parents[1] / "notebooks"
# Small parameters: the same stories on smaller models / clusters, where the claims
# still hold (each notebook says which claims it asserts).
SMALL = {
    # the seed's model on 2 nodes: roberta-large's 0.5.10 baseline is host-bound on both
    # networks (at 4 nodes its loss on EFA ties ZeRO-2's, 12.07% / 12.14%, and host time
    # outweighs its communication stalls), so it no longer tells the seed's story
    "01_efa_vs_infiniband.ipynb": {"MODEL": "roberta-10b", "NODES": 2},
    "02_ablation.ipynb": {"MODELS": ["roberta-base"], "NODES": 2},
    "03_allocator_flushes.ipynb": {"SEEDS": 3, "MICRO_BATCHES": [24, 28], "WARMUP_STEPS_MAX": 1},
    "04_predicted_vs_measured.ipynb": {"ROWS": ["small_z3_opt", "small_z2", "small_z3_baseline",
                                                "small_z3_opt_slow_link", "small_z3_opt_fast_link"]},
    "05_tuning.ipynb": {"MODEL": "roberta-large", "NODES": 2,
                        "SEARCH": ["stage3_param_persistence_threshold", "stage3_max_live_parameters",
                                   "checkpointing"]},
}


def test_every_notebook_is_covered_and_stored_without_outputs():
    nbformat = pytest.importorskip("nbformat")
    names = sorted(p.name for p in NB_DIR.glob("*.ipynb"))
    assert names == sorted(SMALL)
    for name in names:
        nb = nbformat.read(NB_DIR / name, as_version=4)
        nbformat.validate(nb)
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{name}: one cell tagged 'parameters'"
        for key in SMALL[name]:
            assert f"{key} = " in tagged[0].source, f"{name}: parameter {key} not in its parameters cell"
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{name}: stored with outputs"


@pytest.mark.parametrize("name", sorted(SMALL))
def test_notebook_runs_and_its_claims_hold(name, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NB_DIR / name, as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    values = dict(SMALL[name])
    if "OUT = " in nb.cells[at].source:  # files a notebook writes go to the test's folder
        values["OUT"] = str(tmp_path / "out.json")
    params = "\n".join(f"{k} = {v!r}" for k, v in values.items())
    cell = nbformat.v4.new_code_cell(params, metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(at + 1, cell)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(NB_DIR)}})
    client.execute()
