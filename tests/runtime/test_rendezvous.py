"""Where a rank is, from its launcher's environment (runtime.rendezvous): torchrun's and
srun's variables, Slurm's compact node lists and task counts, the rendezvous address and
port, and which GPU a rank drives."""

import pytest

from commsim.ir.errors import CommsimInputError
from runtime.rendezvous import (SLURM_PORT_BASE, SLURM_PORT_SPAN, LaunchEnv, cuda_device_index, expand_nodelist,
                                launch_env, slurm_port, tasks_per_node)


def test_slurm_node_lists():
    assert expand_nodelist("node[01-04]") == ["node01", "node02", "node03", "node04"]
    assert expand_nodelist("gpu7") == ["gpu7"]
    assert expand_nodelist("a[1-2],b7,c[08-10,12]") == ["a1", "a2", "b7", "c08", "c09", "c10", "c12"]
    assert expand_nodelist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    assert expand_nodelist("127.0.0.[1-2]") == ["127.0.0.1", "127.0.0.2"]
    assert expand_nodelist("node[098-101]") == ["node098", "node099", "node100", "node101"]
    with pytest.raises(CommsimInputError, match=r"node list 'node\[1-x\]': '1-x' is not a number or a range"):
        expand_nodelist("node[1-x]")
    with pytest.raises(CommsimInputError, match=r"range '4-1' runs backwards"):
        expand_nodelist("n[4-1]")
    with pytest.raises(CommsimInputError, match=r"unbalanced brackets"):
        expand_nodelist("n[1-2")


def test_slurm_task_counts_and_port():
    assert tasks_per_node("2(x2)") == [2, 2]
    assert tasks_per_node("4(x3),2") == [4, 4, 4, 2]
    assert tasks_per_node("8") == [8]
    with pytest.raises(CommsimInputError, match=r"SLURM_TASKS_PER_NODE 'two': expected counts like 2\(x3\),1"):
        tasks_per_node("two")
    assert slurm_port("123456") == SLURM_PORT_BASE + 123456 % SLURM_PORT_SPAN
    assert slurm_port("777_3") == slurm_port("777")  # an array job's task: the job's number
    assert SLURM_PORT_BASE <= slurm_port("99999999") < SLURM_PORT_BASE + SLURM_PORT_SPAN


SRUN = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242"}


def test_srun_without_rendezvous_variables():
    """srun names the nodes and the job but sets no MASTER_ADDR / MASTER_PORT: the first
    host of the node list and a port from the job id, the same on every task."""
    e = launch_env(SRUN)
    assert e == LaunchEnv(3, 4, 1, 2, 2, "node01", SLURM_PORT_BASE + 4242, "srun")
    assert e.init_method == f"tcp://node01:{SLURM_PORT_BASE + 4242}"
    assert launch_env({**SRUN, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}).init_method == e.init_method
    # variables set by hand win; the older SLURM_NODELIST and SLURM_NTASKS_PER_NODE are read too
    e = launch_env({**SRUN, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"})
    assert (e.master_addr, e.master_port) == ("10.0.0.5", 29500)
    env = {k: v for k, v in SRUN.items() if k not in ("SLURM_JOB_NODELIST", "SLURM_TASKS_PER_NODE", "SLURM_NNODES")}
    e = launch_env({**env, "SLURM_NODELIST": "gpu[7-8]", "SLURM_NTASKS_PER_NODE": "2"})
    assert (e.master_addr, e.ranks_per_node, e.nodes) == ("gpu7", 2, 2)


def test_srun_task_layouts():
    e = launch_env({**SRUN, "SLURM_NTASKS": "16", "SLURM_PROCID": "9", "SLURM_TASKS_PER_NODE": "8(x2)"})
    assert (e.rank, e.world, e.ranks_per_node, e.nodes) == (9, 16, 8, 2)
    env = {k: v for k, v in SRUN.items() if k != "SLURM_TASKS_PER_NODE"}
    assert launch_env(env).ranks_per_node == 2  # from the tasks over the nodes
    with pytest.raises(CommsimInputError, match=r"SLURM_TASKS_PER_NODE=3,1: nodes run different numbers of tasks"):
        launch_env({**SRUN, "SLURM_TASKS_PER_NODE": "3,1"})
    with pytest.raises(CommsimInputError, match=r"no rendezvous address: set MASTER_ADDR and MASTER_PORT"):
        _ = launch_env({k: v for k, v in SRUN.items() if k != "SLURM_JOB_ID"}).init_method
    with pytest.raises(CommsimInputError, match=r"rank 5 of 4, local rank 1 of 2 per node: out of range"):
        launch_env({**SRUN, "SLURM_PROCID": "5"})


def test_torchrun_and_hand_set_variables():
    env = {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "host0", "MASTER_PORT": "29500"}
    e = launch_env(env)
    assert e == LaunchEnv(5, 16, 1, 4, 4, "host0", 29500, "torchrun")
    assert e.init_method == "env://"  # torchrun's agent serves the store: join it
    # set by hand (ranks in network namespaces): one machine unless told otherwise
    e = launch_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.1.0.1", "MASTER_PORT": "29400"})
    assert (e.local_rank, e.ranks_per_node, e.nodes) == (0, 2, 1)
    assert launch_env({}) is None and launch_env({"RANK": "0"}) is None
    with pytest.raises(CommsimInputError, match=r"WORLD_SIZE='x': not an integer"):
        launch_env({"RANK": "0", "WORLD_SIZE": "x"})


def test_which_gpu_a_rank_drives():
    assert cuda_device_index(3, 1) == 0  # srun --gpus-per-task=1: the task sees its own GPU as 0
    assert cuda_device_index(3, 8) == 3  # every GPU of the node visible: the rank's own
    with pytest.raises(CommsimInputError, match=r"local rank 4 needs GPU 4, but this task sees 2 GPU\(s\)"):
        cuda_device_index(4, 2)
