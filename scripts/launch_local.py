"""Starts N processes of train.py on this machine, as one multi-process run (CPU devices, gloo).

Usage: python scripts/launch_local.py N [--devices-per-process=K] [--port=P] -- <train.py args>

Each process gets $JAX_COORDINATOR_ADDRESS=localhost:P, $JAX_NUM_PROCESSES=N, $JAX_PROCESS_ID=i and
K CPU devices (XLA_FLAGS), so `--config.mesh.*` sees N * K devices. Output lines are prefixed with
`[i]`. When one process exits non-zero the others are stopped (SIGTERM, then SIGKILL after 10 s),
and the launcher exits with the first failure's status.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def process_env(process_id: int, n: int, *, devices_per_process: int, port: int, base: dict | None = None) -> dict:
  """The environment of process `process_id` of `n` on CPU: coordinator, rank and fake device count."""
  env = dict(os.environ if base is None else base)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
  env.update(JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(process_id),
             JAX_PLATFORMS=env.get("JAX_PLATFORMS") or "cpu",
             XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={devices_per_process}"]))
  return env


def start(n: int, args: list[str], *, devices_per_process: int, port: int | None = None, base_env: dict | None = None,
          **popen) -> list[subprocess.Popen]:
  """Starts the N processes of `python train.py <args>` (from the repository root) and returns them."""
  port = port or free_port()
  return [subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT,
                           env=process_env(i, n, devices_per_process=devices_per_process, port=port, base=base_env),
                           **popen)
          for i in range(n)]


def wait_all(procs: list[subprocess.Popen], *, grace_s: float = 10.0) -> int:
  """Waits for every process; after the first non-zero exit, stops the rest. Returns 0 or that status."""
  failed = 0
  while any([p.poll() is None for p in procs]):  # a list: poll every process, not up to the first alive
    bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode not in (None, 0)]
    if bad and not failed:
      lost, failed = bad[0]
      how = f"was killed by {signal.Signals(-failed).name}" if failed < 0 else f"exited with status {failed}"
      print(f"launch_local: process {lost} {how}; stopping the others", file=sys.stderr, flush=True)
      for p in procs:
        if p.poll() is None:
          p.send_signal(signal.SIGTERM)
      deadline = time.time() + grace_s
      while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
      for p in procs:
        if p.poll() is None:
          p.kill()
    time.sleep(0.1)
  return failed or next((p.returncode for p in procs if p.returncode), 0)


def _relay(i: int, stream) -> None:
  for line in stream:
    sys.stdout.write(f"[{i}] {line}")
    sys.stdout.flush()


def main() -> int:
  argv = sys.argv[1:]
  split = argv.index("--") if "--" in argv else len(argv)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("n", type=int, help="number of processes")
  parser.add_argument("--devices-per-process", type=int, default=1, help="CPU devices per process")
  parser.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
  opts = parser.parse_args(argv[:split])
  if opts.n < 1 or opts.devices_per_process < 1:
    parser.error(f"n={opts.n} and --devices-per-process={opts.devices_per_process} must be >= 1")
  procs = start(opts.n, argv[split + 1:], devices_per_process=opts.devices_per_process, port=opts.port or None,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  relays = [threading.Thread(target=_relay, args=(i, p.stdout), daemon=True) for i, p in enumerate(procs)]
  for t in relays:
    t.start()
  status = wait_all(procs)
  for t in relays:
    t.join(timeout=5)
  return status


if __name__ == "__main__":
  sys.exit(main())
