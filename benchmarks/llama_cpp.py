"""llama.cpp's ``llama-server`` as a benchmark peer that anyone can rebuild the same way.

Why this shape:

* **Source**: llama.cpp as vendored in one pinned ``llama-cpp-python`` sdist (version and sha256
  below), fetched with ``pip download``. PyPI is a registry every machine of this project reaches,
  and a pinned sdist gives every machine the same llama.cpp. The download is kept once, under the
  cache folder, and reused while its sha256 matches; ``source_dir()`` hands the extracted tree to
  other users too (a notebook takes TinyLlama's tokenizer from it).
* **Toolchain**: cmake and ninja, from their PyPI wheels (installed into this venv) when the
  machine has none.
* **Flags**: ``GGML_NATIVE=OFF`` with each x86 extension switched on only when /proc/cpuinfo lists
  it. A native build died with SIGILL on a VM whose CPU advertises AMX, so AMX is always off.
  One build is cached per flag set, so a cache folder shared by two machine types holds both.
* **Server**: started on 127.0.0.1 and a free port, waited for on ``/health`` with a deadline,
  stopped by a context manager, and tied to its parent's life (Linux), so it never outlives a
  benchmark.

Building takes minutes on 2 cores; it never runs as part of set-up or the tests.

    python benchmarks/llama_cpp.py flags      # the cmake flags this CPU gets
    python benchmarks/llama_cpp.py build      # download (once), build (once per flag set), print the binary
    python benchmarks/llama_cpp.py source     # print the extracted llama.cpp source folder
    python benchmarks/llama_cpp.py serve      # run llama-server on the embedded GGUF until Ctrl-C
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

# The pinned sdist and its download live in the package, which also takes TinyLlama's vocabulary from it.
from lifeofprompt.lessons.llama_cpp_sdist import (
    LLAMA_CPP_PYTHON_VERSION,
    SDIST_SHA256,
    cache_root,
    file_lock,
    source_dir,
)

# ggml's cmake option -> the /proc/cpuinfo flags it needs (all of them). ggml's AVX512 option
# compiles with -mavx512f/cd/vl/dq/bw together, so it asks for all five.
GGML_X86_OPTIONS = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_BMI2": ("bmi2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
}
ALWAYS_OFF = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")

# Everything but the server's own code stays out: no GPU backends, no BLAS, no web UI (its
# "prebuilt" path would download assets during the build), no HTTPS, no tests or examples.
FIXED_CMAKE_OPTIONS = {
    "CMAKE_BUILD_TYPE": "Release",
    "GGML_NATIVE": "OFF",
    "BUILD_SHARED_LIBS": "OFF",
    "LLAMA_CURL": "OFF",
    "LLAMA_OPENSSL": "OFF",
    "LLAMA_BUILD_UI": "OFF",
    "LLAMA_USE_PREBUILT_UI": "OFF",
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "LLAMA_BUILD_APP": "OFF",
    "LLAMA_BUILD_TOOLS": "ON",
    "LLAMA_BUILD_SERVER": "ON",
    "GGML_CUDA": "OFF",
    "GGML_VULKAN": "OFF",
    "GGML_METAL": "OFF",
    "GGML_HIP": "OFF",
    "GGML_SYCL": "OFF",
    "GGML_BLAS": "OFF",
}

HOST = "127.0.0.1"


# ----------------------------------------------------------------------------- the CPU and the flags


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``lifeofprompt.env`` reads them from /proc/cpuinfo)."""
    from lifeofprompt.env import cpu_flags as read_flags

    return set(read_flags())


def ggml_cpu_options(flags: set[str] | None = None) -> dict[str, str]:
    """ON/OFF per ggml x86 option from the CPU's flags, AMX always OFF.

    With ``GGML_NATIVE=OFF`` ggml turns SSE4.2 to FMA on by default, which a CPU without AVX2 cannot
    run, so every option is set explicitly. Off x86 all of them are OFF (ggml picks its own path).
    """
    flags = cpu_flags() if flags is None else flags
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
    options = {
        name: "ON" if x86 and all(f in flags for f in needs) else "OFF" for name, needs in GGML_X86_OPTIONS.items()
    }
    options.update({name: "OFF" for name in ALWAYS_OFF})
    return options


def flagset_name(options: dict[str, str]) -> str:
    """A readable folder name for a flag set: the options that are ON, e.g. ``avx.avx2.fma.f16c``."""
    on = [
        name.removeprefix("GGML_").lower()
        for name, value in options.items()
        if value == "ON" and name in GGML_X86_OPTIONS
    ]
    return ".".join(on) or f"generic-{platform.machine().lower()}"


def build_dir(options: dict[str, str] | None = None) -> Path:
    options = ggml_cpu_options() if options is None else options
    return cache_root() / f"{LLAMA_CPP_PYTHON_VERSION}-{flagset_name(options)}"


# ----------------------------------------------------------------------------- the toolchain


def find_tool(name: str) -> str | None:
    """``name`` from this venv's bin first (where pip puts the wheels), then from PATH."""
    venv_bin = Path(sys.executable).parent  # not resolved: a venv's python is a symlink
    candidate = venv_bin / name
    if candidate.exists() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which(name)


def toolchain() -> dict[str, str]:
    """cmake and ninja (pip-installed into this venv when missing) and a C++ compiler (never installed)."""
    missing = [name for name in ("cmake", "ninja") if find_tool(name) is None]
    if missing:
        print(f"installing {' '.join(missing)} from PyPI into {sys.prefix}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", *missing], check=True)
    tools = {name: find_tool(name) for name in ("cmake", "ninja")}
    compiler = next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if compiler is None or None in tools.values():
        raise RuntimeError(
            f"no C++ compiler or build tool found ({tools}, compiler {compiler}); "
            "on Debian: apt-get install build-essential"
        )
    return tools


def niced(command: list[str]) -> list[str]:
    """Compile at low priority: the build must not starve whatever else shares the machine."""
    return (["nice", "-n", "15"] + command) if shutil.which("nice") else command


# ----------------------------------------------------------------------------- the build


def server_binary(options: dict[str, str] | None = None) -> Path:
    return build_dir(options) / "build" / "bin" / "llama-server"


def cmake_arguments(source: Path, build: Path, ninja: str, options: dict[str, str]) -> list[str]:
    defines = {**FIXED_CMAKE_OPTIONS, **options, "CMAKE_MAKE_PROGRAM": ninja}
    return ["-S", str(source), "-B", str(build), "-G", "Ninja"] + [f"-D{k}={v}" for k, v in defines.items()]


def run_logged(command: list[str], log: Path) -> None:
    """Run one build step with its output appended to ``log``; on failure raise with the log's tail."""
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(command)}\n")
        out.flush()
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise RuntimeError(f"build step failed ({result.returncode}): {' '.join(command)}\n{tail}\n(full log: {log})")


def build(jobs: int = 2, force: bool = False) -> Path:
    """``llama-server`` for this CPU's flag set, built once (Release, static, ``-j jobs``, niced).

    ``build.json`` beside the build records the flags, versions and how long it took.
    """
    options = ggml_cpu_options()
    folder = build_dir(options)
    binary = server_binary(options)
    stamp = folder / "build.json"
    if binary.exists() and stamp.exists() and not force:
        return binary
    source = source_dir()
    tools = toolchain()
    with file_lock(folder / ".lock"):
        if binary.exists() and stamp.exists() and not force:
            return binary
        log = folder / "build.log"
        log.write_text("")
        print(f"building llama-server ({flagset_name(options)}) in {folder}; log: {log}", flush=True)
        start = time.perf_counter()
        run_logged(niced([tools["cmake"], *cmake_arguments(source, folder / "build", tools["ninja"], options)]), log)
        run_logged(
            niced([tools["cmake"], "--build", str(folder / "build"), "--target", "llama-server", "-j", str(jobs)]), log
        )
        seconds = time.perf_counter() - start
        stamp.write_text(
            json.dumps(
                dict(
                    llama_cpp_python=LLAMA_CPP_PYTHON_VERSION,
                    sdist_sha256=SDIST_SHA256,
                    options=options,
                    fixed_options=FIXED_CMAKE_OPTIONS,
                    jobs=jobs,
                    build_seconds=round(seconds, 1),
                    built=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                ),
                indent=2,
            )
        )
        print(f"built {binary} in {seconds / 60:.1f} min", flush=True)
    return binary


def server_version(binary: Path) -> str:
    """``llama-server --version``'s first line: names the llama.cpp commit the sdist vendors."""
    result = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("version")]
    return lines[0] if lines else "unknown"


def build_info(binary: Path) -> dict:
    """What ``build()`` recorded for ``binary`` (empty for a binary built elsewhere)."""
    stamp = binary.parents[2] / "build.json"
    return json.loads(stamp.read_text()) if stamp.exists() else {}


# ----------------------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def supported_options(binary: Path) -> set[str]:
    """The flags ``llama-server --help`` lists: they change between versions, so they are checked."""
    result = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", result.stdout + result.stderr))


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to send SIGTERM when the parent dies, even by SIGKILL.

    Linux sends it when the *thread* that started the server ends, so start servers from the
    main thread (bench_engine.py does).
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class LlamaServer:
    """``llama-server`` on loopback for one benchmark: ``with LlamaServer(...) as server: server.complete(...)``.

    ``slots`` parallel sequences share ``ctx_per_slot * slots`` tokens of KV cache (llama.cpp gives
    each slot an equal share). Start-up waits for ``/health`` at most ``startup_timeout`` seconds.
    """

    def __init__(
        self,
        model: Path,
        binary: Path | None = None,
        slots: int = 8,
        ctx_per_slot: int = 512,
        threads: int = 1,
        startup_timeout: float = 180,
        extra_args: tuple[str, ...] = (),
    ):
        self.model, self.binary = Path(model), Path(binary) if binary else build()
        self.slots, self.ctx, self.threads = slots, ctx_per_slot * slots, threads
        self.startup_timeout, self.extra_args = startup_timeout, tuple(extra_args)
        self.port = None
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        return [
            str(self.binary),
            "-m",
            str(self.model),
            "--host",
            HOST,
            "--port",
            str(self.port),
            "-np",
            str(self.slots),
            "-c",
            str(self.ctx),
            "-t",
            str(self.threads),
            "-tb",
            str(self.threads),
            "--no-webui",
            *self.extra_args,
        ]

    def check_options(self) -> None:
        known = supported_options(self.binary)
        unknown = [a for a in self.command() if a.startswith("-") and a not in known]
        if unknown:
            raise RuntimeError(f"{self.binary} does not list {unknown} in --help")

    def start(self) -> LlamaServer:
        self.check_options()
        self.port = free_port()
        handle, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        self.log_path = Path(name)
        with os.fdopen(handle, "w") as log:
            self.process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while the model loads
            time.sleep(0.25)
        raise TimeoutError(f"llama-server not healthy after {self.startup_timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s: bounded, and the process is gone when this returns."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def post(self, path: str, payload: dict, timeout: float = 600) -> dict:
        request = urllib.request.Request(
            self.url + path, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return json.loads(reply.read())

    def complete(self, prompt_ids: list[int], n_predict: int, timeout: float = 600) -> dict:
        """Greedy ``/completion`` on token ids: exactly ``n_predict`` tokens (EOS ignored), no prompt
        cache (every request pays its prefill, as in our engine with prefix caching off)."""
        return self.post(
            "/completion",
            dict(
                prompt=list(prompt_ids),
                n_predict=n_predict,
                ignore_eos=True,
                cache_prompt=False,
                temperature=0,
                stream=False,
                return_tokens=True,
            ),
            timeout=timeout,
        )


def default_model() -> Path:
    """The embedded model's Q4_1 GGUF (the file our engine dequantizes)."""
    from lifeofprompt.model.loader import smollm2_gguf_path

    return smollm2_gguf_path()


# ----------------------------------------------------------------------------- the command line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("flags", help="print the cmake options this CPU gets")
    built = sub.add_parser("build", help="download and build llama-server (once), print its path")
    built.add_argument("-j", "--jobs", type=int, default=2)
    built.add_argument("--force", action="store_true", help="rebuild even when a build exists")
    sub.add_parser("source", help="print the extracted llama.cpp source folder")
    serve = sub.add_parser("serve", help="run llama-server on the embedded GGUF until Ctrl-C")
    serve.add_argument("--slots", type=int, default=8)
    serve.add_argument("--ctx-per-slot", type=int, default=512)
    serve.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.command == "flags":
        options = ggml_cpu_options()
        print(" ".join(f"-D{k}={v}" for k, v in {**FIXED_CMAKE_OPTIONS, **options}.items()))
        print(f"build folder: {build_dir(options)}")
    elif args.command == "build":
        print(build(jobs=args.jobs, force=args.force))
    elif args.command == "source":
        print(source_dir())
    else:
        with LlamaServer(
            default_model(), slots=args.slots, ctx_per_slot=args.ctx_per_slot, threads=args.threads
        ) as server:
            print(f"llama-server at {server.url} (Ctrl-C stops it)", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                server.process.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
