"""The shared machine profile: measured once, cached per machine and threads, re-measured on request."""

import torch

from lifeofprompt.lessons import machine_profile as mp
from lifeofprompt.lessons import roofline


def fake_measurements(monkeypatch, calls):
    def machine(device="cpu", dtype=None, name=None):
        calls.append("machine")
        return roofline.Machine("fake", 20e9, 1e11)

    monkeypatch.setattr(mp.roofline, "measure_machine", machine)
    monkeypatch.setattr(mp.roofline, "measure_read_bandwidth", lambda device="cpu": 30e9)
    monkeypatch.setattr(mp, "measure_decode_step", lambda context=128: calls.append("step") or 0.025)


def test_measured_once_then_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("LIFEOFPROMPT_CACHE", str(tmp_path))
    calls = []
    fake_measurements(monkeypatch, calls)
    first = mp.machine_profile()
    assert calls == ["machine", "step"]
    second = mp.machine_profile()
    assert calls == ["machine", "step"] and second == first  # read from the cache, not measured
    assert first.read_bandwidth == 30e9 and first.decode_step_s == 0.025
    assert "read 30.0 GB/s, batch-1 step 25.0 ms" in first.footer() and "load average" in first.footer()
    assert first.machine.bandwidth == 20e9
    mp.machine_profile(refresh=True)
    assert calls.count("machine") == 2


def test_another_thread_count_is_another_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("LIFEOFPROMPT_CACHE", str(tmp_path))
    calls = []
    fake_measurements(monkeypatch, calls)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = mp.machine_profile()
        torch.set_num_threads(2)
        two = mp.machine_profile()
    finally:
        torch.set_num_threads(previous)
    assert calls.count("machine") == 2
    assert one.name.endswith("1 thread") and two.name.endswith("2 threads")
    assert mp.profile_path(mp.profile_key()).parent == tmp_path / "machine"
