"""The hook plumbing's measurement (runtime/ds_host_plumbing.py): the forward + backward
window and what it subtracts, on a small torch module with hooks of known cost."""

import time

import pytest

torch = pytest.importorskip("torch")

from runtime.ds_host_plumbing import ForwardBackwardWindow, plumbing, wrapper_overhead_ns  # noqa: E402
from runtime.ds_host_timing import Recorder  # noqa: E402


def test_plumbing_subtracts_the_plain_step_and_the_recorders_own_cost():
    got = plumbing([5_000_000, 4_000_000, 4_500_000], [1_200_000, 1_000_000], {"fetch": 100, "release": 100,
                                                                             "grad_hook": 50}, 2_000.0)
    # (4.0 ms - 1.0 ms - 250 wrapped calls x 2 us) / 200 hook calls
    assert got["per_hook_call_ns"] == 12_500 and got["hook_calls"] == 200 and got["wrapped_calls"] == 250
    assert plumbing([1000], [2000], {"fetch": 1}, 0.0)["per_hook_call_ns"] == 0  # never negative
    with pytest.raises(AssertionError):
        plumbing([1], [1], {"grad_hook": 3}, 0.0)


def _spin(ns: int) -> None:
    end = time.thread_time_ns() + ns
    while time.thread_time_ns() < end:
        pass


def test_the_window_holds_forward_and_backward_and_the_routines_inside_them():
    rec = Recorder()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    timed = rec.wrap("fetch", lambda: _spin(200_000), None)
    for m in model:  # a timed routine and 1 ms of untimed Python per module, as hooks
        m.register_forward_pre_hook(lambda mod, args: (timed(), _spin(1_000_000), None)[-1])
    x = torch.randn(2, 4)

    def step():
        rec.calls["release"].append((1, {}))  # before the window: not counted
        loss = model(x).sum()
        loss.backward()
        timed()  # after the window: not counted

    window = ForwardBackwardWindow(torch, model, rec)
    window.run(step)
    assert window.calls == {"fetch": 2, "release": 0}
    # Two 200 us routines; the bound leaves room for a slow machine's noise (a hypervisor's
    # stolen time counts as thread time) but not for the 2 ms of untimed hook Python.
    assert 400_000 <= window.routines_ns < 1_400_000
    assert window.elapsed_ns - window.routines_ns >= 2_000_000  # the untimed hook Python is left
    assert torch.Tensor.backward.__name__ == "backward" and "forward" not in vars(model)  # restored


def test_the_recorders_wrapper_costs_something():
    assert 0 < wrapper_overhead_ns(torch.nn.Sequential(torch.nn.Linear(2, 2))) < 1e6
