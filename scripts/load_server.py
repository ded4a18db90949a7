"""Load `entmtp serve` (or Ray Serve: `--ray`) on this machine with 1, 4, 8 and 16 concurrent streaming clients
(the official openai client), one server configuration after another; prints aggregate tokens/s, p50/p95
latency and time to first token per configuration and level, and writes every request's numbers to JSON
(with the machine: host, CPU and its flags, versions, commit).

    .venv/bin/python scripts/load_server.py --out load.json      # the three default configurations below
    .venv/bin/python scripts/load_server.py --configs "today=--max-batch 1" "batched=--max-batch 16" \\
        --serve-args "--dtype float32" --clients 1,4,8,16 --requests-per-level 16 --max-tokens 128
    .venv/bin/python scripts/load_server.py --url http://127.0.0.1:8000   # a server already running here

Each configuration NAME=ARGS starts its own `entmtp -v serve ARGS --serve-args` on 127.0.0.1 (a free port,
--max-queue large enough that no request gets a 503), warms it up with one request per client of the
largest level (calib prompts, not counted), runs the levels in order, and stops it. A configuration with
--ray is Ray Serve on a local Ray cluster of its own (`entmtp serve --ray`, docs/serving-ray.md), e.g.
    --configs "serve=--threads 2" "ray-1x2=--ray --replicas 1 --threads 2" "ray-2x1=--ray --replicas 2 --threads 1"
It counts as started once it says it serves (Ray: every replica is up) and /health answers 200; its engine
(backend, dtype, policy and why: the plan `-v` prints, or each Ray replica logs) is printed and recorded, with
a warning when configurations differ; once stopped (SIGTERM), anything of its session still running (a Ray
cluster's raylet, GCS, workers) is named, killed, recorded, and makes the exit code 1.

--overhead N: before the levels, N requests from one client of --overhead-tokens tokens each and a short
prompt: the time a configuration's path adds to a request (with Ray: proxy, front and replica hops), printed
as each configuration's p50 latency less the first's.

Every level sends the same N = --requests-per-level prompts, each once: held-out ("test" split) prompts of
the four tasks in turn (humaneval, sharegpt, gsm8k, writing), so levels and configurations do the same work.
Its C clients each take the next unsent prompt until none is left. Greedy (temperature 0) chat completions of
--max-tokens tokens, streamed with stream_options.include_usage (the server sends usage in the last chunk).

- tokens/s: completion tokens (from usage) of the level's good answers / the level's wall time (first request
  sent to last answer ended).
- latency: request sent to stream end; TTFT: request sent to the first chunk with text.
  p50 is the median, p95 the nearest rank (of 16 answers: the slowest).
- checked per answer: status 200, exactly one chunk with a finish_reason, usage present, the stream ends with
  `data: [DONE]`; anything else is an error (a stream's error event included).
- diff: answers whose text differs from the first configuration's first level for the same prompt (in
  float32 greedy, speculative and batched decoding should equal plain decoding token for token).

Bounded: loopback only (it refuses any other --url host and binds its servers to 127.0.0.1); no new request
after --level-timeout seconds in a level (those in flight then finish, each within the same timeout); a level
cut short reports fewer requests and the exit code is 1, as for any error.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import math
import os
import platform
import queue
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import openai

from entmtp.machine import cpu_info
from entmtp.prompts import FOUR_TASKS, load_prompts

# the HTTP library the installed openai client is built on (httpx, or httpx2 in newer releases)
httpx = importlib.import_module(openai.DefaultHttpxClient.__mro__[1].__module__.partition(".")[0])

DEFAULT_CONFIGS = (  # issue #22: today's one-at-a-time server, plain batched decoding, batched speculation
    "today=--max-batch 1",
    "plain-batched=--max-batch 8 --heads none",
    "batched=--max-batch 8",
)
LOOPBACK = ("127.0.0.1", "localhost", "::1")
RESERVED = ("--host", "--port", "--max-queue")  # the script sets these on the servers it starts
WARMUP_TOKENS = 8
START_TIMEOUT_S = 600  # model load, the cost probes on a fresh machine (~45 s a replica), Ray's cluster start
# `-v` prints the engine's plan: `entmtp serve` itself, each Ray replica in its log (Ray: "engine plan: ...")
PLAN_LINE = re.compile(r"\b(backend|dtype|policy): (\S+) \((.*)\)")
ENGINE_KEYS = ("backend", "dtype", "policy")  # what decides a configuration's speed, each with its reason
RAY_NOISE = re.compile(r"\x1b\[[0-9;]*m| \[repeated \d+x across cluster\]")  # Ray's colours, its dedup note
OVERHEAD_PROMPT = "Say hi."  # short: its prefill and steps are small next to the hops a request takes


@dataclass(frozen=True)
class Prompt:
    index: int  # position in the level's list: the same prompt has the same index in every level
    task: str
    text: str


@dataclass(frozen=True)
class Config:
    name: str
    serve_args: list[str]  # this configuration's arguments, then the shared --serve-args

    @property
    def ray(self) -> bool:
        """Whether it is Ray Serve (`entmtp serve --ray`): a local Ray cluster of its own, stopped with it."""
        return "--ray" in self.serve_args


def mixed_prompts(n: int, split: str) -> list[Prompt]:
    """The first n prompts of `split`, taking the four tasks in turn (a task that runs out is skipped)."""
    per_task = {task: load_prompts(task, split) for task in FOUR_TASKS}
    out: list[Prompt] = []
    for i in range(max(len(p) for p in per_task.values())):
        for task in FOUR_TASKS:
            if i < len(per_task[task]) and len(out) < n:
                out.append(Prompt(len(out), task, per_task[task][i]))
    if len(out) < n:
        raise SystemExit(
            f"only {len(out)} distinct {split} prompts, asked for {n}: lower --requests-per-level"
        )
    return out


class _Tail(httpx.SyncByteStream):
    """A response body passed through unchanged, its last bytes kept in `watch.tail`."""

    def __init__(self, inner, watch: DoneWatch):
        self.inner, self.watch = inner, watch

    def __iter__(self):
        for chunk in self.inner:
            self.watch.tail = (self.watch.tail + chunk)[-64:]
            yield chunk

    def close(self):
        self.inner.close()


class DoneWatch(httpx.BaseTransport):
    """The openai client's transport, which notes how the latest response body ended: the client stops at
    `data: [DONE]` without telling, and a stream cut short ends the same way for it."""

    def __init__(self):
        self.inner = httpx.HTTPTransport()
        self.tail = b""

    def handle_request(self, request):
        response = self.inner.handle_request(request)
        self.tail = b""
        body = _Tail(response.stream, self)
        return httpx.Response(
            response.status_code, headers=response.headers, stream=body, extensions=response.extensions
        )

    def ended_in_done(self) -> bool:
        return self.tail.rstrip().endswith(b"data: [DONE]")

    def close(self):
        self.inner.close()


def make_client(url: str, timeout: float) -> tuple[openai.OpenAI, DoneWatch]:
    watch = DoneWatch()
    http_client = openai.DefaultHttpxClient(transport=watch)
    client = openai.OpenAI(  # no retries: a refused request counts as an error
        base_url=f"{url}/v1", api_key="unused", timeout=timeout, max_retries=0, http_client=http_client
    )
    return client, watch


def one_request(client: openai.OpenAI, watch: DoneWatch, model: str, prompt: Prompt, max_tokens: int) -> dict:
    """One streamed greedy chat completion: its timings, usage, text and checks."""
    r = {"prompt": prompt.index, "task": prompt.task, "status": None, "error": None, "finish_reason": None}
    r.update(completion_tokens=0, prompt_tokens=None, ttft_s=None, latency_s=None, text="")
    pieces, finishes, usage = [], [], None
    t0 = time.perf_counter()
    r["sent_at"] = t0
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt.text}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        with stream:
            r["status"] = stream.response.status_code
            for chunk in stream:
                for choice in chunk.choices:
                    if choice.delta.content:
                        if r["ttft_s"] is None:
                            r["ttft_s"] = time.perf_counter() - t0
                        pieces.append(choice.delta.content)
                    if choice.finish_reason is not None:
                        finishes.append(choice.finish_reason)
                usage = chunk.usage or usage
    except openai.APIError as e:  # a non-200, a stream's error event, a timeout or a lost connection
        r["status"] = getattr(e, "status_code", r["status"])
        r["error"] = f"{type(e).__name__}: {e}"[:300]
        return r
    r["latency_s"] = time.perf_counter() - t0
    r["text"] = "".join(pieces)
    r["finish_reason"] = finishes[0] if finishes else None
    if usage is not None:
        r["completion_tokens"], r["prompt_tokens"] = usage.completion_tokens, usage.prompt_tokens
    r["error"] = _malformed(r["status"], finishes, usage, watch.ended_in_done())
    return r


def _malformed(status, finishes: list, usage, done: bool) -> str | None:
    problems = [
        f"status {status}" if status != 200 else "",
        f"{len(finishes)} finish chunks" if len(finishes) != 1 else "",
        "no usage" if usage is None else "",
        "no [DONE] at the end" if not done else "",
    ]
    return "; ".join(p for p in problems if p) or None


def run_level(
    url: str, model: str, clients: int, prompts: list[Prompt], max_tokens: int, timeout: float
) -> dict:
    """`clients` threads, each sending the next unsent prompt until none is left or `timeout` s have passed."""
    todo: queue.SimpleQueue[Prompt] = queue.SimpleQueue()
    for p in prompts:
        todo.put(p)
    answers: list[dict] = []
    lock = threading.Lock()
    pool = [make_client(url, timeout) for _ in range(clients)]  # built before the clock starts
    t0 = time.perf_counter()

    def client_loop(i: int):
        client, watch = pool[i]
        while time.perf_counter() < t0 + timeout:
            try:
                prompt = todo.get_nowait()
            except queue.Empty:
                return
            answer = one_request(client, watch, model, prompt, max_tokens)
            answer.update(client=i, sent_at=answer["sent_at"] - t0)
            with lock:
                answers.append(answer)

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for client, _ in pool:
        client.close()
    return summarize(clients, sorted(answers, key=lambda a: a["prompt"]), len(prompts), wall)


def _p95(xs: list[float]) -> float:
    return sorted(xs)[math.ceil(0.95 * len(xs)) - 1] if xs else float("nan")


def _p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(clients: int, answers: list[dict], planned: int, wall: float) -> dict:
    good = [a for a in answers if a["error"] is None]
    latency = [a["latency_s"] for a in good]
    ttft = [a["ttft_s"] for a in good if a["ttft_s"] is not None]
    tokens = sum(a["completion_tokens"] for a in good)
    return {
        "clients": clients,
        "planned": planned,
        "requests": len(answers),
        "errors": len(answers) - len(good),
        "wall_s": wall,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "latency_p50_s": _p50(latency),
        "latency_p95_s": _p95(latency),
        "ttft_p50_s": _p50(ttft),
        "ttft_p95_s": _p95(ttft),
        "answers": answers,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(config: Config, max_queue: int, log) -> tuple[subprocess.Popen, str, list[str]]:
    """`entmtp -v serve` on 127.0.0.1 with `config`'s arguments, in a session of its own (what it starts, a
    Ray cluster's processes included, is found again by it: `stop_server`); returns once it said it serves
    (Ray: once every replica is up) and /health answers 200."""
    port = _free_port()
    cmd = [sys.executable, "-m", "entmtp.cli", "-v", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--max-queue", str(max_queue), "--no-access-log", *config.serve_args]
    print(f"[{config.name}] server: {shlex.join(cmd[1:])}", flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            stop_server(proc, config.name)
            raise SystemExit(f"[{config.name}] the server exited with {proc.returncode}:\n{_tail(log)}")
        if b"entmtp: serving" in _read(log) and _healthy(url):
            return proc, url, cmd
        time.sleep(0.5)
    stop_server(proc, config.name)
    raise SystemExit(f"[{config.name}] the server did not start in {START_TIMEOUT_S} s:\n{_tail(log)}")


def _healthy(url: str) -> bool:
    try:
        r = httpx.get(f"{url}/health", timeout=5)
        return r.status_code == 200 and r.json().get("status") == "ok"
    except (httpx.HTTPError, ValueError):  # not up yet; Ray's proxy before the application: not JSON
        return False


def _read(log) -> bytes:
    log.seek(0)
    return log.read()


def _tail(log, lines: int = 20) -> str:
    return "\n".join(_read(log).decode("utf-8", "replace").splitlines()[-lines:])


def engine_plans(log) -> list[dict]:
    """The engine each replica decoded with (backend, dtype, policy and why), from the server's log: one entry for
    `entmtp serve`, one per replica line Ray relayed (Ray folds identical lines of several replicas into one)."""
    plans, plan = [], {}
    for line in _read(log).decode("utf-8", "replace").splitlines():
        m = PLAN_LINE.search(RAY_NOISE.sub("", line))
        if m is None:
            continue
        key, value, reason = m.groups()
        if key in plan:  # a second replica's plan begins
            plans.append(plan)
            plan = {}
        plan[key], plan[f"{key}_reason"] = value, reason
    return plans + [plan] if plan else plans


def stop_server(proc: subprocess.Popen, name: str) -> list[str]:
    """SIGTERM (graceful: nothing is in flight by now; `--ray` deletes its application and stops its
    cluster), SIGKILL past 90 s; then whatever of its session is still running (a Ray cluster's raylet, GCS,
    workers) is named and killed. Returns those leftovers (none when it stopped cleanly)."""
    proc.terminate()
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    time.sleep(2)  # Ray's last workers exit on their own once their raylet is gone
    leftovers = _session_processes(proc.pid)
    for pid, cmdline in leftovers:
        print(f"[{name}] left running after the server stopped, killed: {pid} {cmdline[:100]}", flush=True)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return [cmdline for _, cmdline in leftovers]


def _session_processes(sid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the live processes of session `sid` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = (
                stat.read_text().rpartition(")")[2].split()
            )  # after "pid (comm)": state, ppid, pgrp, session
            if int(fields[3]) == sid and fields[0] != "Z":
                cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append((int(stat.parent.name), cmdline.strip()))
        except (OSError, IndexError, ValueError):  # it ended while being read
            continue
    return found


def measure(config: Config, url: str, args, prompts: list[Prompt], warmup: list[Prompt]) -> dict:
    """Warm-up (one request per client of the largest level, not counted), the overhead level if asked, then
    each level in order."""
    client, _ = make_client(url, args.level_timeout)
    with client:
        model = client.models.list().data[0].id
    warm = run_level(url, model, len(warmup), warmup, WARMUP_TOKENS, args.level_timeout)
    if warm["errors"]:
        print(f"[{config.name}] warm-up: {warm['errors']} errors, e.g. {_first_error(warm)}", flush=True)
    out = {"levels": [], "overhead": None}
    if args.overhead:
        out["overhead"] = overhead_level(url, model, args)
        if out["overhead"]["errors"]:
            print(f"[{config.name}] overhead: e.g. {_first_error(out['overhead'])}", flush=True)
    for clients in args.clients:
        level = run_level(url, model, clients, prompts, args.max_tokens, args.level_timeout)
        out["levels"].append(level)
        if level["errors"]:
            print(f"[{config.name}] {clients} clients: e.g. {_first_error(level)}", flush=True)
    return out


def overhead_level(url: str, model: str, args) -> dict:
    """One client, --overhead requests of the same short prompt and --overhead-tokens tokens, one after
    another: a request's time is mostly its path (client, HTTP, server, and with Ray its proxy, front and
    replica hops), so the configurations' latencies differ by what their paths cost."""
    prompts = [Prompt(i, "overhead", OVERHEAD_PROMPT) for i in range(args.overhead)]
    return run_level(url, model, 1, prompts, args.overhead_tokens, args.level_timeout)


def _first_error(level: dict) -> str:
    return next(a["error"] for a in level["answers"] if a["error"] is not None)


def run_configs(configs: list[Config], args, prompts: list[Prompt], warmup: list[Prompt]) -> list[dict]:
    results = []
    for config in configs:
        if args.url is not None:
            measured = measure(config, args.url, args, prompts, warmup)
            results.append({"name": config.name, "url": args.url, **measured})
            continue
        with tempfile.TemporaryFile() as log:
            proc, url, cmd = start_server(config, max(args.clients) + 1, log)
            try:
                measured = measure(config, url, args, prompts, warmup)
            finally:
                leftovers = stop_server(proc, config.name)
            engines = engine_plans(log)
        print(f"[{config.name}] engine: {describe_engines(engines)}", flush=True)
        results.append(
            {
                "name": config.name,
                "server_command": shlex.join(cmd[1:]),
                "ray": config.ray,
                "engines": engines,  # one per replica whose plan the log holds
                "leftover_processes": leftovers,
                **measured,
            }
        )
    return results


def describe_engines(engines: list[dict]) -> str:
    """The engines' backends, dtypes and policies, each once, with why: what the configuration decoded with."""
    seen = {", ".join(f"{e.get(k)} ({e.get(k + '_reason')})" for k in ENGINE_KEYS) for e in engines}
    return "; ".join(sorted(seen)) or "unknown (no plan in the server's log)"


def count_diffs(results: list[dict]):
    """Each level's `diff`: good answers whose text differs from the first configuration's first level."""
    reference = {a["prompt"]: a["text"] for a in results[0]["levels"][0]["answers"] if a["error"] is None}
    for config in results:
        for level in config["levels"]:
            good = [a for a in level["answers"] if a["error"] is None and a["prompt"] in reference]
            level["diff"] = sum(a["text"] != reference[a["prompt"]] for a in good)


def print_table(results: list[dict]):
    width = max(len("config"), *(len(c["name"]) for c in results))
    print(
        f"{'config':<{width}} {'clients':>7} {'reqs':>5} {'errors':>6} {'tok/s':>7} {'p50 lat':>8} {'p95 lat':>8} "
        f"{'p50 TTFT':>9} {'p95 TTFT':>9} {'diff':>4}"
    )
    for config in results:
        for r in config["levels"]:
            print(
                f"{config['name']:<{width}} {r['clients']:>7} {r['requests']:>2}/{r['planned']:<2} {r['errors']:>6} "
                f"{r['tokens_per_s']:>7.1f} {r['latency_p50_s']:>7.2f}s {r['latency_p95_s']:>7.2f}s "
                f"{r['ttft_p50_s']:>8.2f}s {r['ttft_p95_s']:>8.2f}s {r['diff']:>4}"
            )
    print(
        f"diff: answers whose text differs from {results[0]['name']} at {results[0]['levels'][0]['clients']} client(s)"
    )
    if results[0].get("overhead"):
        print_overhead(results, width)
    engines = {c["name"]: describe_engines(c["engines"]) for c in results if "engines" in c}
    if len(set(engines.values())) > 1:
        print(f"warning: the configurations decoded with different engines: {engines}")


def print_overhead(results: list[dict], width: int):
    """Each configuration's overhead level, and its p50 latency less the first configuration's: the time its
    path adds to one request (with Ray: proxy, front and replica hops)."""
    first = results[0]["overhead"]
    print(
        f"\noverhead: 1 client, {first['planned']} requests of {first['completion_tokens'] // max(1, first['requests'])}"
        f" token(s) each, one after another; +p50: p50 latency less {results[0]['name']}'s"
    )
    print(
        f"{'config':<{width}} {'reqs':>5} {'errors':>6} {'p50 lat':>9} {'p95 lat':>9} {'p50 TTFT':>9} {'+p50':>9}"
    )
    for config in results:
        r = config["overhead"]
        extra = (r["latency_p50_s"] - first["latency_p50_s"]) * 1000
        print(
            f"{config['name']:<{width}} {r['requests']:>2}/{r['planned']:<2} {r['errors']:>6} "
            f"{r['latency_p50_s'] * 1000:>7.1f}ms {r['latency_p95_s'] * 1000:>7.1f}ms "
            f"{r['ttft_p50_s'] * 1000:>7.1f}ms {extra:>+7.1f}ms"
        )


def machine() -> dict:
    """The CPU (model, cores, the flags that decide its kernels), GPU if any, versions and the checkout."""
    cpu = cpu_info()
    info = {"host": platform.node(), "cpu": cpu["name"], "cpus": os.cpu_count(), "cpu_flags": cpu["flags"]}
    if shutil.which("nvidia-smi"):
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
        info["gpus"] = gpu.stdout.split("\n")[:-1]
    info["python"] = platform.python_version()
    for package in ("torch", "transformers", "entmtp", "openai"):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = None
    repo = Path(__file__).resolve().parents[1]
    git = ["git", "-C", str(repo)]
    info["commit"] = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    status = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    info["uncommitted_changes"] = bool(status.stdout.strip())
    return info


def parse_configs(p: argparse.ArgumentParser, args) -> list[Config]:
    shared = shlex.split(args.serve_args)
    configs = []
    for spec in args.configs:
        name, sep, rest = spec.partition("=")
        if not sep or not name.strip():
            p.error(f"--configs takes NAME=ARGS, e.g. 'today=--max-batch 1'; got {spec!r}")
        configs.append(Config(name.strip(), [*shlex.split(rest), *shared]))
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        p.error(f"--configs names must differ, got {names}")
    for c in configs:
        taken = [a for a in c.serve_args if a.split("=")[0] in RESERVED]
        if taken:
            p.error(f"[{c.name}] the script sets {', '.join(RESERVED)} itself: drop {taken}")
    return configs


def parse_args() -> tuple[argparse.Namespace, list[Config]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--configs",
        nargs="+",
        default=None,
        metavar="NAME=ARGS",
        help=f"server configurations, run one after another (default: {' '.join(map(repr, DEFAULT_CONFIGS))})",
    )
    p.add_argument(
        "--serve-args",
        default=None,
        help="appended to every configuration's arguments (default: --dtype float32; "
        "a single flag needs =: --serve-args=--no-graphs)",
    )
    p.add_argument("--url", default=None, help="measure a server already running on this machine instead")
    p.add_argument(
        "--clients", default="1,4,8,16", help="concurrent clients of each level (default: %(default)s)"
    )
    p.add_argument(
        "--requests-per-level",
        type=int,
        default=16,
        help="distinct prompts every level sends, each once (default 16: one each at 16 clients)",
    )
    p.add_argument(
        "--max-tokens", type=int, default=128, help="max_tokens of each request (default: %(default)s)"
    )
    p.add_argument(
        "--level-timeout",
        type=float,
        default=600.0,
        help="seconds: no new request after this in a level, and each request's timeout (default: %(default)s)",
    )
    p.add_argument(
        "--overhead",
        type=int,
        default=0,
        metavar="N",
        help="before the levels, N requests from 1 client of --overhead-tokens tokens each: the time each "
        "configuration's path adds to a request (default 0: none)",
    )
    p.add_argument(
        "--overhead-tokens",
        type=int,
        default=1,
        help="max_tokens of the overhead requests (default: %(default)s)",
    )
    p.add_argument(
        "--out", "--json", dest="out", default=None, help="write every request's numbers to this JSON file"
    )
    args = p.parse_args()
    check_args(p, args)
    return args, parse_configs(p, args)


def check_args(p: argparse.ArgumentParser, args):
    """Bounds (time and load stay bounded; every level has its concurrency) and the defaults that depend on
    --url."""
    args.clients = [int(c) for c in args.clients.split(",")]
    if not all(1 <= c <= 64 for c in args.clients):
        p.error(f"--clients must be between 1 and 64, got {args.clients}")
    if not max(args.clients) <= args.requests_per_level <= 256:
        p.error(
            f"--requests-per-level must be from the largest level ({max(args.clients)}) to 256, "
            f"got {args.requests_per_level}"
        )
    if not 1 <= args.max_tokens <= 1024 or not 0 < args.level_timeout <= 1800:
        p.error("bounded: --max-tokens 1..1024, --level-timeout up to 1800 s")
    if not 0 <= args.overhead <= 1000 or not 1 <= args.overhead_tokens <= 16:
        p.error(
            "bounded: --overhead 0..1000 requests, --overhead-tokens 1..16 (short: the path, not decoding)"
        )
    if args.url is not None:
        if urlparse(args.url).hostname not in LOOPBACK:
            p.error(f"--url must be on this machine (loopback), got {args.url}")
        if args.configs is not None or args.serve_args is not None:
            p.error("--url measures a running server: --configs and --serve-args start servers, drop them")
        args.configs = ["url="]
    args.configs = args.configs or list(DEFAULT_CONFIGS)
    args.serve_args = "--dtype float32" if args.serve_args is None else args.serve_args


def main() -> int:
    args, configs = parse_args()
    prompts = mixed_prompts(args.requests_per_level, "test")
    warmup = mixed_prompts(max(args.clients), "calib")  # warm-up text the measured levels never see
    results = run_configs(configs, args, prompts, warmup)
    count_diffs(results)
    host = machine()
    print(
        f"machine: {host['host']}, {host['cpu']} ({host['cpus']} CPUs{', ' if host['cpu_flags'] else ''}"
        f"{' '.join(host['cpu_flags'])})"
    )
    print_table(results)
    if args.out:
        record = {
            "command": shlex.join([sys.executable, *sys.argv]),
            "machine": host,
            "settings": vars(args),
            "configs": results,
        }
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")
    levels = [level for config in results for level in [*config["levels"], config["overhead"]] if level]
    clean = all(not config.get("leftover_processes") for config in results)
    return 0 if clean and all(lv["errors"] == 0 and lv["requests"] == lv["planned"] for lv in levels) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
