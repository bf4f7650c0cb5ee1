"""Run the real clients people point at an OpenAI-compatible server against ours, offline, and write what happened.

    bash benchmarks/clients/setup.sh                      # once: one venv per client (see setup.sh)
    python3 benchmarks/clients/run_clients.py             # all; writes benchmarks/results/clients_<cpu>_<date>.md
    python3 benchmarks/clients/run_clients.py --only guidellm lm-eval --out /tmp/clients.md

Only the standard library is used here, so any python3 runs it. The server is ``PYTHON -m lifeofprompt serve``
on 127.0.0.1 with a free port, where PYTHON is ``--server-python``, else ``$LIFEOFPROMPT_SERVER_PYTHON``, else
this checkout's ``.venv/bin/python``, else the Python running it. The runner waits for ``/health``, runs
each check (a client with its default settings on a small bounded workload) in that client's venv with
HF_HUB_OFFLINE=1, then stops the server; every process it starts is in its own process group and is killed
on exit, on a timeout and on Ctrl-C. A check passes when the client's protocol worked (exit 0, and for the
benchmarks no request failed); what the 135M model answered is printed, never judged.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import http.server
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CACHE = Path(os.environ.get("LIFEOFPROMPT_CACHE", Path.home() / ".cache" / "lifeofprompt"))
VENVS = CACHE / "clients"
TOKENIZER_DIR = VENVS / "smollm2-tokenizer"
MODEL = "smollm2-135m"
OUTPUT_LINES = 40
# Offline, and no proxy between the clients and 127.0.0.1.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "OPENAI_API_KEY": "x",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}


@dataclass
class Context:
    """What a check's command and verdict need: where the server is and where to write."""

    port: int
    workdir: Path
    refusals: list[str] = field(default_factory=list)  # the current check's refused requests, as the proxy kept them

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root_url}/v1"


@dataclass
class Check:
    """One client run: ``argv(ctx)`` in ``venv``; ``verdict(rc, output, ctx)`` says pass or fail and why."""

    client: str
    name: str
    what: str
    venv: str | None  # a folder under VENVS, or None for the server's own python
    argv: Callable[[Context], list[str]]
    verdict: Callable[[int, str, Context], tuple[bool, str]] | None = None
    package: str = ""
    cwd: Path | None = None
    timeout: int = 300
    drop_env: tuple[str, ...] = ()  # variables of OFFLINE_ENV this client must not see
    result: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- verdicts


def error_messages(output: str) -> list[str]:
    """The server's error messages as clients print them (OpenAI's ``{"error": {"message": ...}}``)."""
    found = re.findall(r"""['"]message['"]\s*:\s*(['"])(.+?)(?<!\\)\1""", output)
    return list(dict.fromkeys(message for _, message in found))


def exit_code_verdict(rc: int, output: str, ctx: Context) -> tuple[bool, str]:
    """Exit 0 passes (and says the last line printed); else the exit code, and the error unless the proxy kept it."""
    last = [line for line in output.strip().splitlines() if line.strip()][-1:] or [""]
    if rc == 0:
        return True, f"exit 0; {last[0][:300]}"
    if ctx.refusals:
        return False, f"exit {rc}"
    messages = error_messages(output)
    return False, f"exit {rc}: " + ("server said: " + " | ".join(messages[:2]) if messages else last[0][:300])


def guidellm_verdict(rc: int, output: str, ctx: Context) -> tuple[bool, str]:
    """guidellm exits 0 even when every request failed, so count them in its JSON report."""
    report = ctx.workdir / "guidellm" / "benchmarks.json"
    if not report.exists():
        return exit_code_verdict(rc, output, ctx) if rc else (False, "exit 0 but no benchmarks.json was written")
    data = json.loads(report.read_text())
    counts, errors = Counter(), []
    for benchmark in data.get("benchmarks", []):
        for status, requests in (benchmark.get("requests") or {}).items():
            if status == "total":
                continue
            counts[status] += len(requests or [])
            errors += [r.get("info", {}).get("error") or r.get("error") for r in requests or [] if status == "errored"]
    errors = [e for e in errors if e]
    summary = ", ".join(f"{n} {status}" for status, n in counts.items()) or "no requests recorded"
    ok = rc == 0 and counts["successful"] > 0 and counts["errored"] == 0
    first_error = f"; first error: {str(errors[0])[:300]}" if errors and not ctx.refusals else ""
    return ok, f"exit {rc}; {summary}{first_error}"


def aiperf_verdict(subdir: str) -> Callable[[int, str, Context], tuple[bool, str]]:
    """aiperf's exit code and its profile export (under ``aiperf/<subdir>``): requests made, errors counted."""

    def verdict(rc: int, output: str, ctx: Context) -> tuple[bool, str]:
        exports = sorted((ctx.workdir / "aiperf" / subdir).rglob("profile_export_aiperf.json"))
        if not exports:
            return exit_code_verdict(rc, output, ctx) if rc else (False, "exit 0 but no profile_export_aiperf.json")
        data = json.loads(exports[-1].read_text())
        count = (data.get("request_count") or {}).get("avg")
        error_summary = data.get("error_summary") or []
        errors = (data.get("error_request_count") or {}).get("avg") or sum(e.get("count", 0) for e in error_summary)
        detail = f"; errors: {json.dumps(error_summary)[:300]}" if error_summary else ""
        ok = rc == 0 and bool(count) and not errors
        return ok, f"exit {rc}; {count} requests, {errors or 0} errors{detail}"

    return verdict


def lm_eval_verdict(rc: int, output: str, ctx: Context) -> tuple[bool, str]:
    """lm_eval prints a results table; its acc row shows the task was scored."""
    match = re.search(r"\|\s*easy_facts\s*\|.*?\|\s*acc\s*\|[^|]*\|\s*([0-9.]+)", output)
    if rc == 0 and match:
        return True, f"exit 0; acc = {match.group(1)} (the 135M model's score, not judged)"
    return exit_code_verdict(rc, output, ctx) if rc else (False, "exit 0 but no acc row in its table")


# ----------------------------------------------------------------------------- the checks


def venv_bin(venv: str, program: str) -> str:
    return str(VENVS / venv / "bin" / program)


def guidellm_argv(ctx: Context) -> list[str]:
    """guidellm's default backend (openai_http: streamed /v1/chat/completions), 5 synthetic requests one at a time."""
    return [
        venv_bin("guidellm", "guidellm"), "run",
        "--backend", f"kind=openai_http,target={ctx.root_url},model={MODEL}",
        "--tokenizer", f"kind=huggingface_auto,model={TOKENIZER_DIR}",
        "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
        "--profile", "kind=synchronous",
        "--constraint", "kind=max_requests,count=5",
        "--constraint", "kind=max_duration,seconds=120",
        "--output", f"kind=json,path={ctx.workdir / 'guidellm' / 'benchmarks.json'}",
        "--disable-progress",
    ]  # fmt: skip


# aiperf 0.13.0 with HF_HUB_OFFLINE set looks a tokenizer up only in the Hub's cache, even a local folder
# ("Repo id must be in the form 'repo_name'"); without it a local folder loads from disk and nothing is fetched.
AIPERF_ONLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def aiperf_argv(ctx: Context, *extra: str) -> list[str]:
    return [
        venv_bin("aiperf", "aiperf"), "profile",
        "--model", MODEL,
        "--url", ctx.root_url,
        "--endpoint-type", "chat",
        "--streaming",
        "--tokenizer", str(TOKENIZER_DIR),
        "--synthetic-input-tokens-mean", "32",
        "--output-tokens-mean", "16",
        "--request-count", "5",
        "--concurrency", "1",
        "--ui-type", "none",
        "--no-gpu-telemetry",
        "--artifact-dir", str(ctx.workdir / "aiperf" / ("per_chunk" if extra else "default")),
        *extra,
    ]  # fmt: skip


def lm_eval_argv(ctx: Context, backend: str) -> list[str]:
    model_args = [
        f"model={MODEL}",
        f"base_url={ctx.base_url}/completions",
        f"tokenizer_backend={backend}",
        "num_concurrent=1",
        "max_retries=1",
    ]
    if backend == "huggingface":
        model_args.append(f"tokenizer={TOKENIZER_DIR}")
    return [
        venv_bin("lm-eval", "lm_eval"), "--model", "local-completions",
        "--model_args", ",".join(model_args),
        "--include_path", str(HERE / "lm_eval_task"),
        "--tasks", "easy_facts",
        "--limit", "8",
    ]  # fmt: skip


def script_check(client: str, venv: str | None, script: str, name: str, what: str, package: str) -> Check:
    """A check that runs one of our small client scripts (``<script> <name>``) in a venv."""

    def argv(ctx: Context, venv=venv, script=script, name=name) -> list[str]:
        python = venv_bin(venv, "python") if venv else SERVER_PYTHON
        return [python, str(HERE / script), name]

    return Check(client, name, what, venv, argv, package=package, timeout=180)


def all_checks() -> list[Check]:
    lm_eval_task = HERE / "lm_eval_task"
    return [
        Check("guidellm", "benchmark", "streaming chat benchmark, synchronous, 5 synthetic requests "
              "(32 prompt / 16 output tokens); its streaming sends stream_options.continuous_usage_stats",
              "guidellm", guidellm_argv, guidellm_verdict, package="guidellm"),
        Check("aiperf", "profile", "streaming chat profile, 5 synthetic requests at concurrency 1",
              "aiperf", aiperf_argv, aiperf_verdict("default"), package="aiperf", drop_env=AIPERF_ONLINE),
        Check("aiperf", "profile --per-chunk-usage", "the same with usage on every chunk "
              "(stream_options.continuous_usage_stats)",
              "aiperf", lambda ctx: aiperf_argv(ctx, "--per-chunk-usage", "--use-server-token-count"),
              aiperf_verdict("per_chunk"), package="aiperf", drop_env=AIPERF_ONLINE),
        Check("lm-eval", "local-completions, huggingface tokenizer", "multiple-choice log-likelihood on 8 questions "
              "of our easy_facts task: completions with echo, logprobs, max_tokens 0",
              "lm-eval", lambda ctx: lm_eval_argv(ctx, "huggingface"), lm_eval_verdict, package="lm_eval",
              cwd=lm_eval_task, timeout=400),
        Check("lm-eval", "local-completions, remote tokenizer", "the same with tokenizer_backend=remote "
              "(vLLM's /tokenizer_info)",
              "lm-eval", lambda ctx: lm_eval_argv(ctx, "remote"), lm_eval_verdict, package="lm_eval",
              cwd=lm_eval_task, timeout=400),
        script_check("instructor", "instructor", "instructor_checks.py", "parallel_tools",
                     "Mode.PARALLEL_TOOLS: Iterable[Weather | SearchQuery] (tools, tool_choice auto)", "instructor"),
        script_check("instructor", "instructor", "instructor_checks.py", "tools",
                     "Mode.TOOLS: one pydantic model (a named tool_choice)", "instructor"),
        script_check("instructor", "instructor", "instructor_checks.py", "partial",
                     "Mode.TOOLS streamed with create_partial", "instructor"),
        script_check("langchain-openai", "langchain-openai", "langchain_checks.py", "invoke",
                     "ChatOpenAI(...).invoke", "langchain-openai"),
        script_check("langchain-openai", "langchain-openai", "langchain_checks.py", "stream",
                     "ChatOpenAI(...).stream", "langchain-openai"),
        script_check("langchain-openai", "langchain-openai", "langchain_checks.py", "bind_tools",
                     "ChatOpenAI(...).bind_tools([get_weather]).invoke (tool_choice auto)", "langchain-openai"),
        script_check("langchain-openai", "langchain-openai", "langchain_checks.py", "responses_api",
                     "ChatOpenAI(use_responses_api=True).invoke (/v1/responses)", "langchain-openai"),
        script_check("openai", None, "openai_checks.py", "responses", "client.responses.create", "openai"),
        script_check("openai", None, "openai_checks.py", "responses_stream",
                     "client.responses.create(stream=True): the typed events, from response.created to the end",
                     "openai"),
        script_check("openai", None, "openai_checks.py", "chat_tools_stream",
                     "streamed chat with tools and no tool_choice (auto)", "openai"),
        script_check("openai", None, "openai_checks.py", "chat_required_stream",
                     "streamed chat with tools, tool_choice required (deltas must concatenate to JSON)", "openai"),
        script_check("openai", None, "openai_checks.py", "chat_named_stream",
                     "streamed chat with a named tool_choice (deltas must concatenate to JSON)", "openai"),
    ]  # fmt: skip


# ----------------------------------------------------------------------------- processes


def server_python() -> str:
    """``--server-python``'s default: the env var, else this checkout's .venv (scripts/setup.sh makes it)."""
    if os.environ.get("LIFEOFPROMPT_SERVER_PYTHON"):
        return os.environ["LIFEOFPROMPT_SERVER_PYTHON"]
    candidate = REPO / ".venv" / "bin" / "python"
    return str(candidate) if candidate.exists() else sys.executable


SERVER_PYTHON = server_python()
SERVER_REPO = REPO  # the checkout whose lifeofprompt is served (--server-repo)


def server_env() -> dict:
    """The server runs from SERVER_REPO (``-m`` puts it first on sys.path), so it serves that checkout's code."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kill_group(process: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process's group (it was started in a session of its own), then SIGKILL what is left."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def run_capture(argv: list[str], env: dict, cwd: Path | None, timeout: int) -> tuple[int, str, float]:
    """Run in a new process group; on timeout kill the whole group. Returns (rc, stdout+stderr, seconds)."""
    start = time.monotonic()
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True, text=True
    )
    try:
        output, _ = process.communicate(timeout=timeout)
        rc = process.returncode
    except subprocess.TimeoutExpired:
        kill_group(process, grace=5)
        output, _ = process.communicate()
        rc, output = 124, (output or "") + f"\n[killed after {timeout} s]"
    finally:
        kill_group(process, grace=5)
    return rc, output or "", time.monotonic() - start


def wait_for_health(url: str, server: subprocess.Popen, limit: float) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} before /health answered")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"/health did not answer within {limit:.0f} s")


def make_tokenizer_dir() -> None:
    """SmolLM2's tokenizer files (and config) as a local Hugging Face folder, for the clients that count tokens."""
    if (TOKENIZER_DIR / "tokenizer.json").exists():
        return
    code = (
        "import shutil, sys; from pathlib import Path; from lifeofprompt.model.loader import smollm2_hf_dir; "
        "src = smollm2_hf_dir(); out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True); "
        "[shutil.copy(src / n, out / n) for n in "
        "('tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja', 'config.json') if (src / n).exists()]"
    )
    subprocess.run([SERVER_PYTHON, "-c", code, str(TOKENIZER_DIR)], check=True)


def cpu_file_slug() -> str:
    """The CPU part of a results file's name, as benchmarks/bench_engine.py writes it (``amd-epyc-avx-512``)."""
    code = "from bench_engine import cpu_description, cpu_file_slug; print(cpu_file_slug(cpu_description()))"
    out = subprocess.run([SERVER_PYTHON, "-c", code], cwd=REPO / "benchmarks", capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else "unknown-cpu"


def served_code() -> tuple[str, str]:
    """Where the served lifeofprompt lives, and its commit (saying so when lifeofprompt/ has uncommitted changes)."""
    code = "import lifeofprompt, os; print(os.path.dirname(os.path.dirname(lifeofprompt.__file__)))"
    argv = [SERVER_PYTHON, "-c", code]
    found = subprocess.run(argv, capture_output=True, text=True, cwd=SERVER_REPO, env=server_env())
    where = found.stdout.strip() or str(SERVER_REPO)
    git = ["git", "-C", where]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "lifeofprompt"], capture_output=True, text=True).stdout
    last = subprocess.run([*git, "log", "-1", "--format=%h", "--", "lifeofprompt"], capture_output=True, text=True)
    code = f"lifeofprompt/ last changed in {last.stdout.strip()}" if last.stdout.strip() else ""
    code += ", with uncommitted changes" if dirty.strip() else ""
    return where, (commit or "unknown") + (f" ({code})" if code else "")


def package_version(check: Check) -> str:
    python = venv_bin(check.venv, "python") if check.venv else SERVER_PYTHON
    code = f"import importlib.metadata as m; print(m.version({check.package!r}))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else "not installed"


def server_statuses(log: str) -> str:
    """Count uvicorn's access lines (``"POST /v1/... HTTP/1.1" 400``) in a slice of the server's log."""
    hits = Counter(re.findall(r'"(GET|POST) (\S+?)(?:\?\S*)? HTTP/[\d.]+" (\d{3})', log))
    return ", ".join(f"{n}× {method} {path} {status}" for (method, path, status), n in hits.most_common())


# ----------------------------------------------------------------------------- the recording proxy

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "upgrade"}


class RecordingProxy(http.server.ThreadingHTTPServer):
    """A pass-through between the clients and the server that keeps every refused request and the server's answer.

    Some clients print only "400 Bad Request" (guidellm, aiperf), and the server does not log why; this is how
    the report can still say what was sent and what the server said. Bodies stream through unchanged.
    """

    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A client that hangs up (a benchmark ending, a timeout) is not news; anything else is printed."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def __init__(self, upstream_port: int):
        super().__init__(("127.0.0.1", 0), ProxyHandler)
        self.upstream_port = upstream_port
        self.refusals: list[dict] = []
        self.lock = threading.Lock()

    def take_refusals(self) -> list[dict]:
        with self.lock:
            taken, self.refusals = self.refusals, []
        return taken


class ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet: the server logs every request
        pass

    def forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=600)
        upstream.request(self.command, self.path, body=body, headers=headers)
        response = upstream.getresponse()
        self.send_response(response.status, response.reason)
        for key, value in response.getheaders():
            if key.lower() not in HOP_HEADERS:
                self.send_header(key, value)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if response.status >= 400:  # kept before it is sent on: a client may hang up as soon as it reads the status
            answer = response.read()
            self.record(response.status, body, answer)
            if answer:
                self.write_chunk(answer)
        else:
            while chunk := response.read1(65536):
                self.write_chunk(chunk)
        self.write_chunk(b"")
        upstream.close()

    def write_chunk(self, data: bytes) -> None:
        """One piece of a chunked body; the empty piece ends it."""
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def record(self, status: int, body: bytes | None, answer: bytes) -> None:
        try:
            sent = json.loads(body or b"{}")
            sent = {k: v for k, v in sent.items() if k not in ("messages", "prompt", "input", "tools")} | {
                k: "..." for k in ("messages", "prompt", "input", "tools") if k in sent
            }
        except ValueError:
            sent = (body or b"")[:200].decode(errors="replace")
        try:
            said = json.loads(answer)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            said = answer[:300].decode(errors="replace")
        with self.server.lock:
            self.server.refusals.append(dict(status=status, path=f"{self.command} {self.path}", sent=sent, said=said))

    do_GET = do_POST = do_DELETE = do_PUT = forward


# ----------------------------------------------------------------------------- the run


def clean_output(output: str) -> str:
    """Drop colour codes and progress-bar redraws, keep the last OUTPUT_LINES lines."""
    output = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", output)
    lines = [line.split("\r")[-1].rstrip() for line in output.splitlines()]
    lines = [line for line in lines if line.strip() and "is ignored: it is neither a file" not in line]
    if len(lines) > OUTPUT_LINES:
        lines = [f"[... {len(lines) - OUTPUT_LINES} lines above]"] + lines[-OUTPUT_LINES:]
    return "\n".join(line[:400] for line in lines)


def summarize_refusals(refusals: list[dict]) -> list[str]:
    """``3× POST /v1/chat/completions → 400 "message" (sent: {...})``, one line per distinct answer."""
    groups: dict[tuple, list[dict]] = {}
    for refusal in refusals:
        groups.setdefault((refusal["status"], refusal["path"], refusal["said"]), []).append(refusal)
    return [
        f"{len(group)}× {path} → {status} {said!r} (one request sent: {json.dumps(group[0]['sent'])[:400]})"
        for (status, path, said), group in groups.items()
    ]


def run_check(check: Check, ctx: Context, server_log: Path, proxy: RecordingProxy) -> None:
    if check.venv and not (VENVS / check.venv / "bin" / "python").exists():
        check.result.update(ok=False, why=f"no venv {VENVS / check.venv}: run benchmarks/clients/setup.sh")
        return
    argv = check.argv(ctx)
    env = {**os.environ, **OFFLINE_ENV, "CLIENTS_BASE_URL": ctx.base_url, "CLIENTS_MODEL": MODEL}
    for name in ("PYTHONPATH", *check.drop_env):
        env.pop(name, None)
    log_start = server_log.stat().st_size
    proxy.take_refusals()
    print(f"-- {check.client}: {check.name}", flush=True)
    rc, output, seconds = run_capture(argv, env, check.cwd, check.timeout)
    with server_log.open(errors="replace") as log:
        log.seek(log_start)
        statuses = server_statuses(log.read())
    refusals = ctx.refusals = summarize_refusals(proxy.take_refusals())
    ok, why = (check.verdict or exit_code_verdict)(rc, output, ctx)
    if not ok and refusals:
        why += f"; server: {refusals[0].split(' (one request sent')[0]}"
    command = (f"cd {shlex.quote(str(check.cwd))} && " if check.cwd else "") + shlex.join(argv)
    check.result.update(ok=ok, why=why, rc=rc, seconds=seconds, output=clean_output(output), command=command,
                        server=statuses, refusals=refusals)  # fmt: skip
    print(f"   {'PASS' if ok else 'FAIL'} ({seconds:.0f} s): {why}", flush=True)


def write_report(path: Path, checks: list[Check], info: dict) -> None:
    lines = [
        f"# Clients against `lifeofprompt serve`, {info['date']}",
        "",
        f"Written by `benchmarks/clients/run_clients.py` on {info['cpu']} ({info['when']} UTC). Server: "
        f"`{info['server_command']}` (lifeofprompt from `{info['server_code']}`, commit {info['commit']}), the "
        f"embedded SmolLM2-135M-Instruct on the CPU. Clients ran offline (HF_HUB_OFFLINE=1), each in its own venv "
        f"under `~/.cache/lifeofprompt/clients/` (exact versions: `benchmarks/clients/lock/`), with SmolLM2's "
        f"tokenizer from a local folder. A check passes when the client's protocol worked; what the 135M model "
        f"answered is shown, not judged. The clients reached the server through the runner's pass-through proxy "
        f"(its port is the one in each command, free for this run only), which keeps every refused request and the "
        f"server's answer, since some clients print only the status.",
        "",
        "| client | version | check | result | why |",
        "| --- | --- | --- | --- | --- |",
    ]
    for check in checks:
        result = check.result
        status = "pass" if result.get("ok") else "**fail**"
        why = str(result.get("why", "not run")).replace("|", "\\|").replace("\n", " ")
        why = why if len(why) <= 260 else why[:260] + " …"
        lines.append(f"| {check.client} | {result.get('version', '')} | {check.name} | {status} | {why} |")
    for check in checks:
        result = check.result
        lines += ["", f"## {check.client}: {check.name}", "", check.what + ".", ""]
        if "command" not in result:
            lines += [f"Not run: {result.get('why')}"]
            continue
        lines += [
            f"Result: **{'pass' if result['ok'] else 'fail'}** ({result['seconds']:.0f} s) — {result['why']}",
            "",
            f"Server saw: {result['server'] or 'no request'}",
            "",
            *(
                ["Refused requests and the server's answer:", "", *[f"- {r}" for r in result["refusals"]], ""]
                if result["refusals"]
                else []
            ),
            "```bash",
            result["command"],
            "```",
            "",
            "```text",
            result["output"].replace("```", "'''") or "(no output)",
            "```",
        ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    global SERVER_PYTHON, SERVER_REPO
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", default=None, help="clients to run (guidellm aiperf lm-eval instructor "
                        "langchain-openai openai); default all")  # fmt: skip
    parser.add_argument("--out", default=None, help="the report (default benchmarks/results/clients_<cpu>_<date>.md)")
    parser.add_argument("--server-python", default=None, help=f"python with lifeofprompt (default {SERVER_PYTHON})")
    parser.add_argument("--server-repo", default=None, help="serve another checkout's lifeofprompt (default: this one)")
    parser.add_argument("--startup-timeout", type=float, default=600)
    args = parser.parse_args()
    SERVER_PYTHON = args.server_python or SERVER_PYTHON
    SERVER_REPO = Path(args.server_repo).resolve() if args.server_repo else REPO
    checks = [c for c in all_checks() if not args.only or c.client in args.only]
    make_tokenizer_dir()
    now = datetime.datetime.now(datetime.timezone.utc)
    cpu = cpu_file_slug()
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"clients_{cpu}_{now:%Y%m%d}.md"
    for check in checks:
        check.result["version"] = package_version(check)
    workdir = Path(tempfile.mkdtemp(prefix="lifeofprompt-clients-"))
    server_port = free_port()
    proxy = RecordingProxy(server_port)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    ctx = Context(port=proxy.server_address[1], workdir=workdir)
    server_argv = [SERVER_PYTHON, "-m", "lifeofprompt", "serve", "--port", str(server_port)]
    server_log = workdir / "server.log"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the server
    with server_log.open("w") as log:
        server = subprocess.Popen(
            server_argv, stdout=log, stderr=subprocess.STDOUT, cwd=SERVER_REPO, start_new_session=True, env=server_env()
        )
    try:
        print(f"server: {shlex.join(server_argv)} (log {server_log})", flush=True)
        wait_for_health(f"http://127.0.0.1:{server_port}", server, args.startup_timeout)
        for check in checks:
            run_check(check, ctx, server_log, proxy)
    finally:
        kill_group(server, grace=35)
        proxy.shutdown()
    server_code, commit = served_code()
    server_command = shlex.join([Path(SERVER_PYTHON).name, "-m", "lifeofprompt", "serve", "--port", "PORT"])
    info = dict(date=f"{now:%Y-%m-%d}", when=f"{now:%Y-%m-%d %H:%M}", cpu=cpu, server_code=server_code,
                commit=commit, server_command=server_command)  # fmt: skip
    write_report(out, checks, info)
    print(f"server log: {server_log}", flush=True)
    failed = [f"{c.client}: {c.name}" for c in checks if not c.result.get("ok")]
    print(f"wrote {out}; {len(checks) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
