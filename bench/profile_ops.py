"""Where a traced train step's device time goes, op by op, and what differs between two steps.

    python train.py ... --config.train.profile_steps="(3, 6)"          # traces into <workdir>/profile/step_N
    python -m bench.profile_ops <workdir>/profile/step_6 <workdir>/profile/step_3   # a slow step against a fast one
    python -m bench.profile_ops --workdir <workdir>    # its slowest traced step against its fastest
    python -m bench.profile_ops --smoke --out /tmp/profile_ops.json   # traces 2 steps of the tiny model on CPU

For each trace (a folder that `jax.profiler` wrote), the device's events are summed by kernel name: on a
GPU the `/device:` planes (CUPTI's kernel and copy records), on a CPU the XLA client's op events. The
report gives each trace's busy time (the union of its events' intervals), its span (first start to
last end: busy time plus the device's idle gaps, where the host or a sync held it up) and its top ops;
with two traces, the ops whose summed time differs most, first minus second. `--workdir` picks the two
from a run's traced steps by their `step_time_s` in `metrics.jsonl` (so log every traced step).
"""

import argparse
import collections
import glob
import json
import os
import subprocess
import sys
import tempfile

from jax.profiler import ProfileData


def _events(trace_dir: str) -> list:
  files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
  if not files:
    raise FileNotFoundError(f"{trace_dir!r} holds no *.xplane.pb (is it a jax.profiler trace folder?)")
  data = ProfileData.from_file(files[-1])
  device = [e for plane in data.planes if plane.name.startswith("/device:") for line in plane.lines
            for e in line.events]
  if device:
    return device
  # A CPU run: the XLA client's thread records each op (its "end: ..." markers are not ops).
  return [e for plane in data.planes if plane.name == "/host:CPU" for line in plane.lines
          if "PjRtCpuClient" in line.name for e in line.events
          if e.duration_ns > 0 and not e.name.startswith(("end:", "ThreadpoolListener"))]


def summarize(trace_dir: str, top: int = 20) -> dict:
  """Seconds per op name, busy time and span of one trace."""
  events = _events(trace_dir)
  per_op, count = collections.Counter(), collections.Counter()
  intervals = []
  for e in events:
    per_op[e.name] += e.duration_ns * 1e-9
    count[e.name] += 1
    intervals.append((e.start_ns, e.start_ns + e.duration_ns))
  intervals.sort()
  busy, end = 0.0, None
  for start, stop in intervals:
    if end is None or start > end:
      busy, end = busy + stop - start, stop
    elif stop > end:
      busy, end = busy + stop - end, stop
  span = (max(stop for _, stop in intervals) - intervals[0][0]) if intervals else 0
  return dict(trace=trace_dir, events=len(events), busy_s=busy * 1e-9, span_s=span * 1e-9,
              ops={name: dict(seconds=s, count=count[name]) for name, s in per_op.most_common()},
              top=[(name, s) for name, s in per_op.most_common(top)])


def compare(first: dict, second: dict, top: int = 20) -> list[tuple[str, float, float]]:
  """(op, first's seconds, second's seconds) of the `top` ops whose time differs most (first - second)."""
  names = set(first["ops"]) | set(second["ops"])
  seconds = lambda summary, name: summary["ops"].get(name, {}).get("seconds", 0.0)  # noqa: E731
  rows = [(name, seconds(first, name), seconds(second, name)) for name in names]
  return sorted(rows, key=lambda r: abs(r[1] - r[2]), reverse=True)[:top]


def slowest_and_fastest(workdir: str) -> list[str]:
  """The trace folders of the slowest and the fastest traced step of a train.py run, by `step_time_s`."""
  traced = {int(name.removeprefix("step_")): os.path.join(workdir, "profile", name)
            for name in os.listdir(os.path.join(workdir, "profile")) if name.startswith("step_")}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    seconds = {row["step"]: row["step_time_s"] for row in map(json.loads, f) if row["step"] in traced}
  if len(seconds) < 2:
    raise ValueError(f"{workdir} has {len(seconds)} traced step(s) with a logged step_time_s; trace two or more "
                     "(train.profile_steps) and log each (train.log_every=1)")
  order = sorted(seconds, key=seconds.get)
  print(f"slowest traced step {order[-1]} ({seconds[order[-1]]:.3f} s), fastest {order[0]} "
        f"({seconds[order[0]]:.3f} s)")
  return [traced[order[-1]], traced[order[0]]]


def _smoke_traces(tmp: str) -> list[str]:
  """Traces steps 2 and 3 of the tiny model through train.py; their two folders, slowest first."""
  workdir = os.path.join(tmp, "run")
  subprocess.run([sys.executable, "train.py", "--config=configs/glm5_1.py:tiny", f"--workdir={workdir}",
                  "--config.data.source=pydoc", "--config.data.batch_size=2", "--config.train.steps=3",
                  "--config.train.warmup_steps=0", "--config.train.checkpoint_every=0",
                  "--config.train.progress_bar=false", "--config.train.log_every=1",
                  '--config.train.profile_steps=(2, 3)'],
                 check=True, env=dict(os.environ, PYTHONPATH="."), capture_output=True, text=True)
  return slowest_and_fastest(workdir)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("traces", nargs="*", help="one or two jax.profiler trace folders")
  parser.add_argument("--workdir", default=None,
                      help="a train.py workdir: compare its slowest traced step with its fastest")
  parser.add_argument("--top", type=int, default=20)
  parser.add_argument("--out", default=None, help="also write the report as JSON")
  parser.add_argument("--smoke", action="store_true", help="trace 2 steps of the tiny model (CPU) and report them")
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory() as tmp:
    traces = (_smoke_traces(tmp) if args.smoke else slowest_and_fastest(args.workdir) if args.workdir
              else args.traces)
    if not 1 <= len(traces) <= 2:
      parser.error("give one trace folder, or two to compare")
    summaries = [summarize(t, args.top) for t in traces]
  for s in summaries:
    print(f"{s['trace']}: busy {s['busy_s']:.4f} s, span {s['span_s']:.4f} s, {s['events']} events")
    for name, seconds in s["top"]:
      print(f"  {seconds:10.4f} s  {name[:140]}")
  report = dict(summaries=[{k: v for k, v in s.items() if k != "ops"} for s in summaries])
  if len(summaries) == 2:
    report["difference"] = compare(*summaries, top=args.top)
    print("largest differences (first - second):")
    for name, a, b in report["difference"]:
      print(f"  {a - b:+10.4f} s  ({a:.4f} against {b:.4f})  {name[:120]}")
  if args.out:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)
  return report


if __name__ == "__main__":
  main()
