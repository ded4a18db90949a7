"""Load `entmtp serve` on this machine with 1, 4, 8 and 16 concurrent streaming clients (the official openai
client), one server configuration after another; prints aggregate tokens/s, p50/p95 latency and time to first
token per configuration and level, and writes every request's numbers to JSON.

    .venv/bin/python scripts/load_server.py --out load.json      # the three default configurations below
    .venv/bin/python scripts/load_server.py --configs "today=--max-batch 1" "batched=--max-batch 16" \\
        --serve-args "--dtype float32" --clients 1,4,8,16 --requests-per-level 16 --max-tokens 128
    .venv/bin/python scripts/load_server.py --url http://127.0.0.1:8000   # a server already running here

Each configuration NAME=ARGS starts its own `entmtp serve ARGS --serve-args` on 127.0.0.1 (a free port,
--max-queue large enough that no request gets a 503), warms it up with one request per client of the
largest level (calib prompts, not counted), runs the levels in order, and stops it.

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
import shlex
import shutil
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
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")  # what decides CPU kernels (and bf16 speed)
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Prompt:
    index: int  # position in the level's list: the same prompt has the same index in every level
    task: str
    text: str


@dataclass(frozen=True)
class Config:
    name: str
    serve_args: list[str]  # this configuration's arguments, then the shared --serve-args


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
    """`entmtp serve` on 127.0.0.1 with `config`'s arguments; returns once /health answers 200."""
    port = _free_port()
    cmd = [sys.executable, "-m", "entmtp.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--max-queue", str(max_queue), "--no-access-log", *config.serve_args]
    print(f"[{config.name}] server: {shlex.join(cmd[1:])}", flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300  # model load, plus the batched cost probe on a fresh machine (~30 s)
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"[{config.name}] the server exited with {proc.returncode}:\n{_tail(log)}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url, cmd
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise SystemExit(f"[{config.name}] the server did not start in 300 s:\n{_tail(log)}")


def _tail(log, lines: int = 20) -> str:
    log.seek(0)
    return "\n".join(log.read().decode("utf-8", "replace").splitlines()[-lines:])


def stop_server(proc: subprocess.Popen):
    proc.terminate()  # graceful: nothing is in flight by now
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure(config: Config, url: str, args, prompts: list[Prompt], warmup: list[Prompt]) -> list[dict]:
    """Warm-up (one request per client of the largest level, not counted), then each level in order."""
    client, _ = make_client(url, args.level_timeout)
    with client:
        model = client.models.list().data[0].id
    warm = run_level(url, model, len(warmup), warmup, WARMUP_TOKENS, args.level_timeout)
    if warm["errors"]:
        print(f"[{config.name}] warm-up: {warm['errors']} errors, e.g. {_first_error(warm)}", flush=True)
    levels = []
    for clients in args.clients:
        level = run_level(url, model, clients, prompts, args.max_tokens, args.level_timeout)
        levels.append(level)
        if level["errors"]:
            print(f"[{config.name}] {clients} clients: e.g. {_first_error(level)}", flush=True)
    return levels


def _first_error(level: dict) -> str:
    return next(a["error"] for a in level["answers"] if a["error"] is not None)


def run_configs(configs: list[Config], args, prompts: list[Prompt], warmup: list[Prompt]) -> list[dict]:
    results = []
    for config in configs:
        if args.url is not None:
            results.append(
                {
                    "name": config.name,
                    "url": args.url,
                    "levels": measure(config, args.url, args, prompts, warmup),
                }
            )
            continue
        with tempfile.TemporaryFile() as log:
            proc, url, cmd = start_server(config, max(args.clients) + 1, log)
            try:
                levels = measure(config, url, args, prompts, warmup)
            finally:
                stop_server(proc)
        results.append({"name": config.name, "server_command": shlex.join(cmd[1:]), "levels": levels})
    return results


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


def machine() -> dict:
    """The CPU (model, cores, the flags that decide its kernels), GPU if any, versions and the checkout."""
    info = {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "cpu_flags": []}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    first_cpu = cpuinfo.split("\n\n")[0].splitlines()
    fields = dict(line.split(":", 1) for line in first_cpu if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    info["cpu"] = fields.get("model name", info["cpu"])
    info["cpu_flags"] = [f for f in CPU_FLAGS if f in fields.get("flags", "").split()]
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
    print_table(results)
    if args.out:
        record = {
            "command": shlex.join([sys.executable, *sys.argv]),
            "machine": machine(),
            "settings": vars(args),
            "configs": results,
        }
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")
    levels = [level for config in results for level in config["levels"]]
    return 0 if all(lv["errors"] == 0 and lv["requests"] == lv["planned"] for lv in levels) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
