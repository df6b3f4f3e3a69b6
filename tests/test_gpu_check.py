"""bench/gpu_check.py, the prepared check for the day a GPU is lent: without one it
refuses in one line; its steps and comparisons run here as a CPU rehearsal."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def test_without_a_gpu_it_refuses_in_one_line():
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        f"gpu_check: no CUDA GPU visible (torch {__import__('torch').__version__}, torch.cuda.is_available() is "
        "False); run it where one is"]


def test_the_cpu_rehearsal_runs_every_check(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--timeout", "400", "--keep", str(tmp_path)],
                         capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    names = [ln.split(":", 1)[0] for ln in lines]
    assert names == ["schedule", "calibrate", "execute", "check-data", "predict with the profile",
                     "predict with the preset", "ops vs the profile", "memory", "host speed", "host round trips",
                     "device memory"]
    assert "FAILED" not in out.stdout and "skipped (needs" not in out.stdout
    assert lines[1].startswith("calibrate: ") and " on CPU" in lines[1]
    assert lines[3].startswith("check-data: every collective's result exact (tiny model, bf16, ")
    assert "vs measured" in lines[4] and "gemm " in lines[6] and "[kind median error / p90 |error| (ops)]" in lines[6]
    assert lines[7].startswith("memory: skipped: no caching allocator on this backend (gloo)")
    # the host-cost table was timed on this machine's kind of core: its routines take
    # about the table's time here (each within a factor of 1.5 on a shared 2-core VM)
    assert lines[8].startswith("host speed: ") and "--host-scale" in lines[8]
    ratios = [float(x) for x in __import__("re").findall(r" x(\d+\.\d+)", lines[8])]
    assert len(ratios) == 9 and all(1 / 1.5 < r < 1.5 for r in ratios), lines[8]
    assert lines[9] == "host round trips: none (CPU rehearsal)"
    assert lines[10] == "device memory: none (CPU rehearsal)"
    assert {p.name for p in tmp_path.iterdir()} >= {"schedule.json", "profile.json", "measured.json", "checked.json"}


def test_a_short_timeout_fails_the_check_that_ran_out():
    out = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--timeout", "3"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1
    assert "FAILED: not finished within --timeout 3 s" in out.stdout and "skipped (needs" in out.stdout


def _module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_host_speed_is_each_routine_over_the_tables_at_the_measured_world():
    from commsim.strategies.knobs import host_costs_for

    gc = _module()
    c, w = host_costs_for("0.19.8"), 8
    doc = {"world": w, "primitives": {"torch_op_ns": 2 * (c.launch_ns - 3_800),
                                      "c10d_all_gather_ns": 2 * (c.collective_launch_ns - 3_800)},
           "fits": {"fetch": {"fixed_ns": 2 * c.module_hook_ns,
                              "per_gathered_ns": 2 * (c.gather_param_ns + w * c.gather_param_rank_ns),
                              "per_waited_ns": 3 * (c.wait_param_ns + w * c.wait_param_rank_ns)},
                    "release": {"fixed_ns": 2 * c.release_hook_ns, "per_freed_ns": c.free_param_ns},
                    "grad_hook": {"fixed_ns": 2 * c.grad_hook_ns}}}
    ratios = gc.host_speed_ratios(doc)
    assert ratios == {"module hook": 2, "gather a parameter": 2, "wait for a parameter": 3, "release hook": 2,
                      "free a parameter": 1, "gradient hook": 2, "a torch op's dispatch": 2,
                      "a c10d collective call": 2}
    assert gc.host_speed_line(ratios, "Xeon") == (
        "Xeon: DeepSpeed 0.19.8's routines take module hook x2.00, gather a parameter x2.00, wait for a parameter "
        "x3.00, release hook x2.00, free a parameter x1.00, gradient hook x2.00, a torch op's dispatch x2.00, a c10d "
        "collective call x2.00 the table's time; median x2.00: --host-scale 2.00 prices this host")


def test_device_memory_against_the_presets_capacity():
    gc = _module()
    gib, mib = 2**30, 2**20
    mem = {"total": int(39.5 * gib), "in_use": 500 * mib, "reserved": 20 * mib}
    assert gc.device_memory_line(mem, "NVIDIA A100-SXM4-40GB", ("p4d", "p4d")) == (
        "NVIDIA A100-SXM4-40GB: 39.50 GiB in all as CUDA reports it, 480 MiB held by this process's CUDA context "
        "(in use 500 MiB less the caching allocator's 20 MiB); commsim's p4d gives its caching allocator 39.82 GiB, "
        "100.8% of it")
    assert gc.device_memory_line(mem, "NVIDIA L4", None).endswith("less the caching allocator's 20 MiB)")


def test_the_preset_of_a_device():
    from commsim.hardware.specs import H200, NODE_PRESETS

    gc = _module()
    assert gc.preset_for("NVIDIA A100-SXM4-40GB") == ("p4d", "p4d")
    assert gc.preset_for("NVIDIA A100-SXM4-80GB") == ("dgx-a100", "dgx-a100")
    assert gc.preset_for("NVIDIA H100 80GB HBM3") == ("p5", "p5")
    label, key = gc.preset_for("NVIDIA H200")
    try:
        assert label.startswith("p5 node with H200") and NODE_PRESETS[key].gpu == H200
        assert NODE_PRESETS[key].gpus_per_node == NODE_PRESETS["p5"].gpus_per_node
    finally:
        NODE_PRESETS.pop(key, None)  # registered for the check's own process only
    assert gc.preset_for("NVIDIA L4") is None and gc.preset_for("") is None


def test_per_op_errors_by_kind():
    from commsim.ir.trace import Trace, TraceMeta, TraceRecord, TraceSource

    gc = _module()

    def rec(op, kind, dur, step=0, stream="compute"):
        return TraceRecord(0, stream, op, kind, "x", 0, dur, 0, 0, step)

    pred = Trace(TraceMeta(TraceSource.PREDICTED), (rec(1, "gemm", 110), rec(2, "gemm", 90), rec(3, "all_gather", 50),
                                                    rec(4, "host_python", 5, stream="host")))
    meas = Trace(TraceMeta(TraceSource.MEASURED), tuple(
        r for s in range(3) for r in (rec(1, "gemm", 100 + s, s), rec(2, "gemm", 100, s), rec(3, "all_gather", 100, s),
                                      rec(4, "host_python", 1, s, stream="host"), rec(5, "gemm", 0, s))))
    errs = gc.per_kind_errors(pred, meas)  # host ops and ops measured at 0 ns left out
    assert errs == {"gemm": [(110 - 101) / 101, -0.1], "all_gather": [-0.5]}
    assert gc.p90([0.1, 0.2, 0.3]) == 0.3 and gc.p90([0.5]) == 0.5
    assert gc.error_line(errs) == ("gemm -1% / 10% (n=2); all_gather -50% / 50% (n=1)  "
                                   "[kind median error / p90 |error| (ops)]")


def test_the_round_trip_line_names_the_constants_it_checks():
    from commsim.hardware.gpu_kernels import SMALL_COPY_LATENCY_NS
    from commsim.hardware.specs import NODE_PRESETS
    from commsim.strategies.knobs import host_costs_for

    gc = _module()
    line = gc.round_trip_line({"kernel_then_item": 21.04, "pageable_h2d": 12.0, "idle_synchronize": 3.0,
                               "launch": 5.54}, "NVIDIA H200")
    copy, launch = SMALL_COPY_LATENCY_NS / 1e3, host_costs_for("0.19.8").launch_ns / 1e3
    kern = NODE_PRESETS["p4d"].gpu.kernel_overhead_ns / 1e3
    assert line == (f"NVIDIA H200: kernel then .item() 21.0 us (commsim: launch {launch:.1f} + kernel {kern:.1f} + small "
                    f"copy {copy:.1f} us); pageable torch.ones(1).to(cuda) 12.0 us (small copy {copy:.1f} us); idle "
                    f"synchronize 3.0 us; a small op's launch 5.5 us on the host (commsim's p4d: {launch:.1f} us)")


def test_round_trips_time_what_they_name():
    # a stand-in torch that counts the calls: the timing loop's code runs here
    from types import SimpleNamespace

    calls = {"add_": 0, "item": 0, "to": 0, "synchronize": 0}

    class T:
        def add_(self, v):
            calls["add_"] += 1
            return self

        def item(self):
            calls["item"] += 1
            return 0.0

        def to(self, device):
            assert device == "cuda"
            calls["to"] += 1
            return self

    def synchronize():
        calls["synchronize"] += 1

    fake = SimpleNamespace(zeros=lambda n, device: T(), ones=lambda n: T(), cuda=SimpleNamespace(synchronize=synchronize))
    us = _module().round_trips_us(fake, repeats=5)
    assert set(us) == {"kernel_then_item", "pageable_h2d", "idle_synchronize", "launch"}
    assert all(v >= 0 for v in us.values())
    # 5 kernel+item, 5 pageable copies, 5 timed synchronizes and one before and after, 5 launches
    assert calls == {"add_": 10, "item": 5, "to": 5, "synchronize": 7}
