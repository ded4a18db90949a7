"""Idle CPU of a local `entmtp serve --ray` cluster, per process (for choosing Ray settings).

    python docs/results/ray-serve/floor/idle_cpu.py [ENV=VALUE ...] [extra serve args]   (from the checkout's root)

Starts `entmtp serve --ray --replicas 1 --threads 2` (float32, transformers) with the given environment, waits
until it serves and 15 s more, then prints the CPU seconds each process on the machine took over 30 s, and stops
it; `--no-ray` measures `entmtp serve` itself. X_DASH=0 needs experiment.patch applied (it is not shipped)."""

import os
import signal
import subprocess
import sys
import time

import psutil

env = dict(os.environ, PYTHONPATH="src")
env.update(dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a))
args = [a for a in sys.argv[1:] if "=" not in a]
ray = [] if "--no-ray" in args else ["--ray", "--replicas", "1"]  # --no-ray: `entmtp serve` itself
args = [a for a in args if a != "--no-ray"]
log = open("idle_serve.log", "w")
p = subprocess.Popen(
    [
        sys.executable,
        "-m",
        "entmtp.cli",
        "serve",
        *ray,
        "--threads",
        "2",
        "--backend",
        "transformers",
        "--dtype",
        "float32",
        "--max-batch",
        "8",
        "--port",
        "8941",
        *args,
    ],
    env=env,
    stdout=log,
    stderr=subprocess.STDOUT,
)
for _ in range(300):
    time.sleep(1)
    if "serving" in open("idle_serve.log").read():
        break
time.sleep(15)


def snap():
    out = {}
    for q in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
        try:
            t = q.info["cpu_times"]
            out[q.info["pid"]] = (t.user + t.system, " ".join(q.info["cmdline"] or [])[:90])
        except Exception:
            pass
    return out


a = snap()
time.sleep(30)
b = snap()
rows = sorted(((b[k][0] - a[k][0], b[k][1]) for k in b if k in a), reverse=True)
tot = sum(r[0] for r in rows)
print(f"total CPU over 30 s idle: {tot:.2f} s ({100 * tot / 30:.1f}% of a core)")
for d, c in rows[:12]:
    print(f"{d:6.2f}  {c}")
p.send_signal(signal.SIGTERM)
p.wait(timeout=120)
