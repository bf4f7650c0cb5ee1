"""One measurement of this machine, shared by every notebook that quotes it.

Chapters 03 to 06, 08 to 10, 13 to 15 and the appendix all talk about the same few numbers: how
fast this machine reads memory, how fast it multiplies matrices, and how long the real engine's
decode step takes. If each measured them itself, at its own moment and under its own load, they would disagree with
each other. So ``machine_profile()`` measures them once, on first call, and caches the result
under ``$LIFEOFPROMPT_CACHE/machine/``, keyed by the CPU (or GPU), the thread count, torch's
version and a digest of the engine's code (the decode step it times). Every notebook reads the
same file and still runs on its own: the first one to ask measures. ``refresh=True`` measures again
(do it on a quiet machine; the profile records the load average it was taken under, and ``footer``
prints it under each figure).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..env import cache_dir, cpu_label, cpu_model
from . import roofline

VERSION = 1
PROFILE_CONTEXT = 128  # tokens of context of the timed decode steps
PROFILE_DECODE_STEPS = 8  # decode steps timed; the fastest is the profile's step


@dataclass(frozen=True)
class MachineProfile:
    """The machine's numbers, measured together."""

    name: str  # e.g. "AMD EPYC (AVX-512), 1 thread"
    read_bandwidth: float  # bytes/s a sum() reads (2 MiB pages on the CPU)
    copy_bandwidth: float  # bytes/s read + written by a copy
    matmul_flops: float  # operations/s of a square fp32 (CPU) or bf16 (GPU) product
    decode_step_s: float  # the engine's batch-1 decode step, SmolLM2-135M fp32, 128 tokens of context
    measured_at: str
    load_average: float  # 1-minute load average when measured

    @property
    def machine(self) -> roofline.Machine:
        """The roofline's view: copy bandwidth and matmul rate."""
        return roofline.Machine(self.name, self.copy_bandwidth, self.matmul_flops)

    @property
    def threads(self) -> int | None:
        """The CPU threads it was measured with (``name`` ends "N thread(s)"); None for a GPU profile."""
        last = self.name.rsplit(", ", 1)[-1].split()
        return int(last[0]) if len(last) == 2 and last[0].isdigit() and last[1].startswith("thread") else None

    def footer(self) -> str:
        """One line for under a figure: which machine, when, and how busy it was."""
        return (
            f"{self.name}; measured {self.measured_at}, load average {self.load_average:.2f}; "
            f"read {self.read_bandwidth / 1e9:.1f} GB/s, batch-1 step {self.decode_step_s * 1e3:.1f} ms"
        )


def load_now() -> float:
    """The 1-minute load average at this moment (NaN where the OS has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def run_footer(profile: MachineProfile, what: str = "measured in this run") -> str:
    """A footer for a figure timed now: this run's time and load, then the shared profile's line.

    The figure's own timings were taken under today's load, which may differ from the load the
    profile was measured under; the footer says both so a reader can judge the noise.
    """
    when = time.strftime("%H:%M UTC", time.gmtime())
    return f"{what} at {when}, load average {load_now():.2f}\nmachine profile: {profile.footer()}"


def engine_digest() -> str:
    """A digest of the model and engine code (Python and C): the profile times the engine's decode
    step, so a profile taken on other code is measured again rather than quoted for this one."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(
        [*root.glob("model/*.py"), *root.glob("model/*.c"), *root.glob("model/*.h"), *root.glob("engine/*.py")]
    ):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def profile_key(device: str = "cpu") -> dict:
    """What the numbers depend on: a change in any of it means measuring again."""
    if device == "cuda":
        what = torch.cuda.get_device_name()
    else:
        what = cpu_model()
    return dict(
        version=VERSION,
        device=device,
        what=what,
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        engine=engine_digest(),
    )


def profile_path(key: dict):
    """One file per key, engine digest included: checkouts of different code each keep their own profile."""
    name = f"{key['device']}-{key['what']}-{key['threads']}t-{key['torch']}-{key['engine'][:8]}"
    slug = "".join(c if c.isalnum() else "-" for c in name)
    return cache_dir() / "machine" / f"{slug.lower()}-v{key['version']}.json"


def measure_decode_step(context: int = PROFILE_CONTEXT) -> float:
    """The engine's batch-1 decode step on the embedded model in fp32: the fastest of ``PROFILE_DECODE_STEPS``.

    A fresh engine serves one request; the engine's step records time each step from after
    scheduling to the sampled token (the runner's ``execute``: forward and sampling).
    """
    from ..engine.llm_engine import LLMEngine
    from .serving_study import time_decode_steps

    engine = LLMEngine(
        "smollm2-135m",
        dtype=torch.float32,
        quantization=None,  # the profile's step is fp32's: chapter 06 sets the blocks' beside it
        device="cpu",
        num_kv_blocks=64,
        max_num_seqs=1,
        log_stats=False,
    )
    time_decode_steps(engine, 1, prompt_len=16, decode_steps=2)  # warm-up
    return time_decode_steps(engine, 1, prompt_len=context, decode_steps=PROFILE_DECODE_STEPS).step_s


def machine_profile(device: str = "cpu", refresh: bool = False) -> MachineProfile:
    """This machine's profile: read from the cache, or measured now (a few seconds) and cached."""
    key = profile_key(device)
    path = profile_path(key)
    if not refresh:
        try:
            stored = json.loads(path.read_text())
            if stored.get("key") == key:
                return MachineProfile(**stored["profile"])
        except (OSError, ValueError, TypeError, KeyError):
            pass
    threads = torch.get_num_threads()
    name = f"{cpu_label()}, {threads} thread{'s' if threads != 1 else ''}" if device == "cpu" else key["what"]
    load = load_now()
    machine = roofline.measure_machine(device)
    profile = MachineProfile(
        name=name,
        read_bandwidth=roofline.measure_read_bandwidth(device),
        copy_bandwidth=machine.bandwidth,
        matmul_flops=machine.flops,
        decode_step_s=measure_decode_step() if device == "cpu" else float("nan"),
        measured_at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        load_average=load,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".part")
    staging.write_text(json.dumps(dict(key=key, profile=asdict(profile)), indent=1))
    os.replace(staging, path)
    return profile
