"""Tensor-parallel workers never outlive their engine: shut down, garbage-collected, the interpreter
exiting, the driver SIGKILLed, or a worker killed or hung mid-run (a typed error within 30 s, and
the other workers go too). Checked on the processes themselves (psutil), not on our bookkeeping.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from tiny_models import tiny_model

from lifeofprompt.distributed.group import ParallelGroup
from lifeofprompt.engine.llm import LLM
from lifeofprompt.engine.sampling_params import SamplingParams
from lifeofprompt.errors import WorkerFailedError
from lifeofprompt.lessons.agreement import teacher_forced_logits

T = 3
ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=128, log_stats=False)
TESTS = Path(__file__).resolve().parent
DEADLINE_S = 30

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.ranks]


def gone(pid: int) -> bool:
    """Exited (a zombie waiting for a reaper has exited too)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids, seconds: float = 15) -> list[int]:
    """The pids still running after ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(gone(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if not gone(p)]


def spawned_children() -> list[int]:
    """This process's children started by multiprocessing's spawn (workers; not its resource tracker)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if any("spawn_main" in part for part in child.cmdline()) and not gone(child.pid):
                found.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def tiny_llm(**kwargs):
    model, tokenizer = tiny_model()
    return LLM(model, tokenizer=tokenizer, tensor_parallel_size=T, **ENGINE, **kwargs)


def test_garbage_collection_ends_the_workers():
    llm = tiny_llm()
    pids = llm.engine.parallel.worker_pids
    assert sorted(pids) == sorted(spawned_children())
    del llm
    gc.collect()
    assert wait_gone(pids, 10) == []
    assert spawned_children() == []


def test_a_worker_killed_mid_run_gives_the_typed_error_and_no_process_survives():
    llm = tiny_llm()
    pids = llm.engine.parallel.worker_pids
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    start = None
    with pytest.raises(WorkerFailedError, match=r"rank 2 was killed by signal 9") as info:
        for out in llm.stream([[5, 6, 7, 8]], params):
            if start is None and len(out.outputs[0].token_ids) >= 3:
                os.kill(pids[1], signal.SIGKILL)
                start = time.monotonic()
    assert start is not None and time.monotonic() - start < DEADLINE_S
    assert info.value.rank == 2 and info.value.exitcode == -signal.SIGKILL
    assert wait_gone(pids, 5) == [] and spawned_children() == []
    with pytest.raises(WorkerFailedError):  # the engine stays failed, and says so at once
        llm.generate([[5, 6]], params)
    llm.shutdown()


def test_a_hung_worker_gives_the_typed_error_within_the_timeout():
    """SIGSTOP: the worker is alive but answers nothing; rank 0's collective timeout (3 s here) catches it."""
    model, _ = tiny_model()
    group, shard = ParallelGroup.launch(model, T, num_blocks=8, block_size=4, timeout_s=3)
    try:
        pids = group.worker_pids
        teacher_forced_logits(shard, [5, 6, 7], [8, 9])  # a forward that works
        os.kill(pids[0], signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerFailedError, match="did not answer within 3 s"):
            teacher_forced_logits(shard, [5, 6, 7], [8, 9])
        assert time.monotonic() - start < DEADLINE_S
        assert wait_gone(pids, 5) == [] and spawned_children() == []
    finally:
        group.shutdown()


# ----------------------------------------------------------------------------- the driver in a subprocess

DRIVER = """
import json, sys, time
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
from tiny_models import tiny_model
from lifeofprompt import LLM, SamplingParams
model, tokenizer = tiny_model()
llm = LLM(model, tokenizer=tokenizer, tensor_parallel_size={T}, dtype="float32", block_size=4, num_kv_blocks=64,
          log_stats=False)
print(json.dumps(llm.engine.parallel.worker_pids), flush=True)
if {mode!r} == "run":
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    while True:
        llm.generate([[5, 6, 7, 8]], params)
"""


def start_driver(mode: str, script: Path | None = None) -> tuple[subprocess.Popen, list[int]]:
    """The driver as ``python -c``, or as a script file with no ``__main__`` guard (spawn re-runs such files)."""
    code = DRIVER.format(tests=str(TESTS), T=T, mode=mode)
    if script is not None:
        script.write_text(code)
    driver = subprocess.Popen(
        [sys.executable, *(["-c", code] if script is None else [str(script)])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = driver.stdout.readline()
    assert line, driver.stderr.read()[-3000:]
    return driver, json.loads(line)


def descendants(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def test_interpreter_exit_ends_the_workers_of_an_unguarded_script(tmp_path):
    driver, pids = start_driver("exit", tmp_path / "unguarded.py")
    assert driver.wait(60) == 0, driver.stderr.read()[-3000:]
    assert wait_gone(pids, 10) == []
    assert "Traceback" not in driver.stderr.read()  # the workers did not re-run the script


def test_sigkill_of_the_driver_mid_run_leaves_no_worker_behind():
    driver, pids = start_driver("run")
    try:
        time.sleep(1.0)  # generating now
        everything = set(pids) | set(descendants(driver.pid))
        assert set(pids) <= everything and len(pids) == T - 1
        driver.kill()
        driver.wait(10)
        assert wait_gone(sorted(everything), 15) == []
    finally:
        if driver.poll() is None:
            driver.kill()


def test_the_server_answers_503_in_openais_shape_when_a_worker_dies():
    pytest.importorskip("fastapi")
    import httpx

    from lifeofprompt.lessons.server_thread import ServerThread

    llm = tiny_llm()
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    try:
        with ServerThread(llm.engine, model_name="tiny") as server:
            assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
            os.kill(llm.engine.parallel.worker_pids[0], signal.SIGKILL)
            for _ in range(2):  # the failing step, then a dead engine: both answer
                response = httpx.post(server.url + "/v1/completions", json=body, timeout=DEADLINE_S)
                assert response.status_code == 503
                error = response.json()["error"]
                assert error["type"] == "engine_unavailable" and "rank 1" in error["message"]
    finally:
        llm.shutdown()
    assert spawned_children() == []
