"""runtime.page_reporting: finding a guest that reports free memory, its period, and the
reported pages among fresh-page timings (pure: a fake /sys)."""

import time

import pytest

from runtime.page_reporting import (PAGE_REPORTING_DELAY_S, PassWatch, balloon_reports, reported_extra,
                                    reported_met, reporting_passes, reporting_period_s, slow_pieces)


def fake_sys(tmp_path, device="0x0005", features="0110010100", passes=None, module=True):
    if module:
        params = tmp_path / "module" / "page_reporting" / "parameters"
        params.mkdir(parents=True)
        if passes is not None:
            (params / "passes").write_text(f"{passes}\n")
    dev = tmp_path / "bus" / "virtio" / "devices" / "virtio0"
    dev.mkdir(parents=True)
    (dev / "device").write_text(device + "\n")
    (dev / "features").write_text(features + "\n")
    return str(tmp_path)


def test_a_balloon_with_the_reporting_feature_reports(tmp_path):
    assert balloon_reports(fake_sys(tmp_path / "a"))  # feature bit 5 set on the balloon (device 5)
    assert not balloon_reports(fake_sys(tmp_path / "b", features="0110000100"))  # bit 5 clear
    assert not balloon_reports(fake_sys(tmp_path / "c", device="0x0002"))  # a block device
    assert not balloon_reports(fake_sys(tmp_path / "d", module=False))  # no page reporting in the kernel
    assert not balloon_reports(str(tmp_path / "nothing"))


def test_the_period_from_the_pass_counter_else_the_kernel_delay(tmp_path):
    assert reporting_passes(fake_sys(tmp_path / "a", passes=18125)) == 18125
    assert reporting_passes(fake_sys(tmp_path / "b")) is None  # upstream kernels keep no count
    # passes every 2.05 s while memory is freed, 5 s apart while none was
    assert reporting_period_s([10.0, 12.05, 14.1, 19.1, 24.2]) == pytest.approx(2.05)
    assert reporting_period_s([3.0]) == reporting_period_s([]) == PAGE_REPORTING_DELAY_S  # too few counted
    assert reporting_period_s([1.0, 1.5, 5.0]) == PAGE_REPORTING_DELAY_S  # never below the kernel's delay


def test_the_pass_watch_records_when_the_counter_moves(tmp_path):
    root = fake_sys(tmp_path, passes=5)
    counter = tmp_path / "module" / "page_reporting" / "parameters" / "passes"
    watch = PassWatch(root).start()
    counter.write_text("6\n")  # right after start: a move, even if the thread starts late

    def seen(n):  # wait for the sampler (a loaded machine may hold it back for long)
        deadline = time.monotonic() + 30
        while len(watch.times_s) < n and time.monotonic() < deadline:
            time.sleep(PassWatch.SAMPLE_S)

    seen(1)
    counter.write_text("8\n")
    seen(2)
    time.sleep(5 * PassWatch.SAMPLE_S)  # no further move: no further time
    times = watch.stop()
    assert len(times) == 2 and times[0] < times[1]
    assert PassWatch(fake_sys(tmp_path / "upstream")).start().stop() == []  # no counter: no thread, no times


def test_reported_pieces_and_their_extra():
    # the probe's shape: fast pieces first, then reported ones (traces/README.md)
    rates = [0.55, 0.54, 0.55, 0.59, 2.9, 3.5, 4.0, 3.8]
    assert slow_pieces(rates) == [False] * 4 + [True] * 4  # calibrate stops after four slow in a row
    assert slow_pieces([3.0, 3.1, 2.9, 3.2]) == [False] * 4  # no fast piece to tell reported ones by
    assert reported_met(rates) and not reported_met(rates[:7])
    # five pieces, one unusually fast: the other four look slow beside it alone, so the
    # probe goes on (a quick calibration stopped here with an extra of 0.56 ns a byte)
    few = [0.30, 0.80, 0.85, 0.90, 0.82]
    assert all(slow_pieces(few)[-4:]) and not reported_met(few)
    assert reported_extra(rates) == pytest.approx((2.9 + 3.5 + 4.0 + 3.8) / 4 - (0.55 + 0.54 + 0.55 + 0.59) / 4)
    assert reported_extra([0.4, 0.45, 0.5, 0.42, 0.6, 0.48]) is None  # all fast: none met
    assert reported_extra([0.4, 0.45, 0.5, 0.42, 1.6, 0.48]) is None  # one slow piece is not enough
    assert reported_extra([0.4, 3.0, 3.1]) is None  # too few pieces to tell
