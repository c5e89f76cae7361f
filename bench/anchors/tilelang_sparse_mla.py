"""TileLang's own DeepSeek-V3.2 sparse MLA kernels at the attention table's MLA shape (issue 20): an anchor.

    python3 -m bench.anchors.tilelang_sparse_mla --bundle bench/anchors/.bundle/tilelang.tar.xz \
        --seq 16384 --out $OUT/tilelang.json
    python3 -m bench.anchors.tilelang_sparse_mla --compile-only   # no GPU: build every kernel for sm_90a
    python3 -m bench.anchors.tilelang_sparse_mla --smoke --out /tmp/anchor.json   # CPU: a stand-in bundle

A script on the GPU machine, beside `python -m bench.sparse_attention table` in the same call, so our
Pallas kernels and TileLang's are timed on the same card at the same shape. Nothing in hyscale_jax/,
pallas_kernels/ or tests/ imports it, and it refuses to be imported: TileLang's code lives only in the
git-ignored bundle (build_tilelang_bundle.sh), which this script unpacks to /tmp and puts on
PYTHONPATH, running itself again under it (the script uses nothing of this repository, so
`python3 bench/anchors/tilelang_sparse_mla.py` runs it too).

Shape (`mla64`): GLM-5.1's absorbed MLA in MQA form, batch 1, H 64 query heads, one KV head of
576 (values = the key row's first 512), k 2048 selected keys per query, bf16, T = --seq.
Kernels (examples/deepseek_v32/ at the bundle's PROVENANCE commit), called as the examples call them:
  sparse_mla_fwd            sparse_mla_fwd.sparse_mla_fwd_interface(q, kv, idx): out, lse
  sparse_mla_fwd_pipelined  sparse_mla_fwd_pipelined.sparse_mla_fwd_interface(q, kv, idx, 0, 1,
                            return_kernel=True), then kernel(q, kv, idx, q_start=[0]) (as its test)
  sparse_mla_bwd            sparse_mla_bwd.sparse_mla_bwd(q, kv, out, do, idx, lse): dq, dkv
                            (preprocess + zeroed f32 dkv + bwd + postprocess to bf16, as its test)
  sparse_mla_bwd_kernel     sparse_mla_bwd.bwd(...) alone (as its run_regression_perf), dkv in f32
Layouts: q [1, T, H, 576], kv [1, T, 1, 576], idx [1, T, 1, k] int32, out [1, T, H, 512], lse
[1, T, H] f32 in log2 units (log2 of the sum of exp), dq like q, dkv like kv. Scale 1/sqrt(576).
The kernels treat a selected index s as valid for query t when s <= t and mask the rest.

Selections (--selection): `distinct` (default, the examples' kind): query t selects min(k, t + 1)
distinct keys uniformly from [0, t]; rows with t + 1 < k are padded with distinct keys above t, which
the kernels mask (in bounds: the examples pad with T itself, one row past kv, which the gathering
kernels read and the backward's atomics add zeros to). `ours`: bench/sparse_attention.py's
randint % (t + 1), all valid, repeats allowed.

Checks: a float32 torch reference (the selected keys gathered, in chunks of queries) at --check-rows
rows (0: all; then dq and dkv are checked too); before each checked call, NaN-filled buffers of the
outputs' sizes are allocated and freed, so an output element a kernel never writes most likely reads
back as NaN. Timing: CUDA events around each call after --warmup calls, a queued spin before each so
the host's launch overhead is hidden; the median of --reps. FLOPs as TileLang counts them: forward
2 T k H (576 + 512), backward 2 T k H (512 + 3 * 576 + 512).

`--smoke` needs neither torch nor a GPU: it builds a stand-in bundle (a `tilelang` package that only
has a version, the examples' PROVENANCE.txt and utils.py, and example modules with no kernels) and
runs the GPU path's setup on it: the unpack, the run again with the bundle on PYTHONPATH, the
examples' utils.py stand-in (it imports triton), tilelang and the example modules imported from the
bundle, and the JSON. Its rows say where each module came from; the kernel rows say they were skipped.
"""

import argparse
import hashlib
import io
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import types

if __name__ != "__main__":
  raise ImportError("bench/anchors/tilelang_sparse_mla.py is a script; the project never imports TileLang")

PIPELINED_FIRST_ROW = 128
DIM, TAIL = 512, 64  # values = the first 512 of the 576-wide key row; the rope tail is 64
# The pipelined kernel runs last: at T 64K its first device run ended the process (2026-12-04).
KERNELS = ["sparse_mla_fwd", "sparse_mla_bwd", "sparse_mla_bwd_kernel", "sparse_mla_fwd_pipelined"]
MODULES = ["sparse_mla_fwd", "sparse_mla_fwd_pipelined", "sparse_mla_bwd"]  # the examples' files the kernels are in
# Set to the bundle's folder when the script runs itself again with the bundle on PYTHONPATH.
_RERUN = "TILELANG_ANCHOR_RERUN"
_SMOKE_FOLDER = "TILELANG_ANCHOR_SMOKE_FOLDER"
# --smoke's stand-in bundle: a path under tilelang_anchor/ -> its text.
SMOKE_VERSION = "0.0.0+smoke"
SMOKE_FILES = {
    "site/tilelang/__init__.py": f'__version__ = "{SMOKE_VERSION}"  # the smoke\'s stand-in\n',
    "examples/PROVENANCE.txt": "repository: none (the smoke's stand-in)\ncommit: smoke\n",
    "examples/utils.py": "import triton  # noqa: F401 (as the examples' utils.py)\n",
    **{f"examples/{m}.py": "import tilelang  # noqa: F401\nfrom utils import assert_tensors_similar  # noqa: F401\n"
       for m in MODULES},
}


def unpack(bundle, root):
  """The bundle's top folder under `root`, unpacked once per bundle content (keyed by its sha256)."""
  with open(bundle, "rb") as f:
    digest = hashlib.sha256(f.read()).hexdigest()[:16]
  dest = os.path.join(root, digest)
  top = os.path.join(dest, "tilelang_anchor")
  if not os.path.exists(os.path.join(dest, ".complete")):
    shutil.rmtree(dest, ignore_errors=True)
    t0 = time.time()
    with tarfile.open(bundle, "r:xz") as tar:
      tar.extractall(dest, filter="data")
    open(os.path.join(dest, ".complete"), "w").close()
    print(f"unpacked {bundle} to {dest} in {time.time() - t0:.1f} s", flush=True)
  return top


def cuda_home():
  """CUDA_HOME as nvcc itself reports it (`--dryrun` prints TOP). TileLang's own guess is the folder
  above `which nvcc`, which is wrong where nvcc on PATH is a wrapper script (/usr/local/bin/nvcc
  exec'ing /usr/local/cuda-13.0/bin/nvcc, as on this workplace's machines): it would compile without
  the toolkit's headers."""
  nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
  try:
    out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                         capture_output=True, text=True, timeout=60)
    top = re.search(r"^#\$ TOP=(.*)$", out.stdout + out.stderr, re.M)
    if top and os.path.exists(os.path.join(top.group(1), "include", "cuda_runtime.h")):
      return os.path.realpath(top.group(1))
  except (OSError, subprocess.SubprocessError):
    pass
  return "/usr/local/cuda" if os.path.exists("/usr/local/cuda/include/cuda_runtime.h") else None


def set_up(top, cache):
  """Environment for the bundle's TileLang; returns the examples' folder.

  The bundle's site-packages and examples must be on sys.path: when they are not, the script runs
  itself again (same arguments) with them in front of PYTHONPATH. After that, only site-packages
  stays on PYTHONPATH, for the subprocesses TileLang and tvm-ffi start with sys.executable.
  """
  top = os.path.abspath(top)
  site, examples = os.path.join(top, "site"), os.path.join(top, "examples")
  if not os.environ.get("CUDA_HOME"):
    home = cuda_home()
    if home:
      os.environ["CUDA_HOME"] = home
  # Kernel and tvm-ffi caches in /tmp: the home folder on the device machine may not be writable.
  os.environ.setdefault("TILELANG_CACHE_DIR", os.path.join(cache, "tilelang"))
  os.environ.setdefault("TVM_FFI_CACHE_DIR", os.path.join(cache, "tvm_ffi"))
  if not {examples, site} <= set(sys.path):
    if os.environ.get(_RERUN) == top:
      raise RuntimeError(f"{examples} and {site} are on PYTHONPATH but not on sys.path")
    os.environ[_RERUN] = top
    os.environ["PYTHONPATH"] = os.pathsep.join([examples, site] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    print("running again with the bundle on PYTHONPATH", flush=True)
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
  os.environ["PYTHONPATH"] = os.pathsep.join(p for p in os.environ["PYTHONPATH"].split(os.pathsep) if p != examples)
  # The examples import `assert_tensors_similar` from their utils.py, which imports triton at the top;
  # this script checks with its own reference, so a stand-in does where triton is missing.
  try:
    import utils  # noqa: F401
  except ImportError as e:
    print(f"examples' utils.py not importable ({e}); using a stand-in", flush=True)
    stub = types.ModuleType("utils")
    stub.assert_tensors_similar = lambda *a, **k: None
    sys.modules["utils"] = stub
  return examples


def smoke_bundle(folder):
  """Writes --smoke's stand-in bundle (SMOKE_FILES) into `folder`; returns its path. The bytes are the
  same on every call (no dates in the archive): the run again finds the folder it unpacked to."""
  data = io.BytesIO()
  with tarfile.open(fileobj=data, mode="w:xz") as tar:
    for name, text in sorted(SMOKE_FILES.items()):
      info = tarfile.TarInfo(f"tilelang_anchor/{name}")  # mtime 0, mode 644
      info.size = len(text.encode())
      tar.addfile(info, io.BytesIO(text.encode()))
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, "smoke_bundle.tar.xz")
  with open(f"{path}.{os.getpid()}", "wb") as f:
    f.write(data.getvalue())
  os.replace(f"{path}.{os.getpid()}", path)
  return path


def provenance(top):
  path = os.path.join(top, "examples", "PROVENANCE.txt")
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return dict(line.split(": ", 1) for line in f.read().splitlines() if ": " in line)


def selections(torch, T, k, mode, seed, device):
  """[T, k] int32 selected keys per query (see the docstring's Selections)."""
  g = torch.Generator(device=device).manual_seed(seed)
  rows = torch.arange(T, device=device)
  if mode == "ours":
    return (torch.randint(0, T, (T, k), generator=g, device=device) % (rows[:, None] + 1)).int()
  assert T >= k, f"distinct selections need T >= k ({T} < {k})"
  idx = torch.empty(T, k, dtype=torch.int32, device=device)
  for s in range(0, T, 1024):
    u = torch.rand(min(1024, T - s), T, generator=g, device=device)
    # Keys above t score below every key in [0, t]: they are picked only to pad short rows.
    u.masked_fill_(rows[None, :] > rows[s:s + 1024, None], -1.0)
    idx[s:s + 1024] = u.topk(k, dim=1).indices.int()
  return idx


def reference(torch, q, kv, do, idx, rows, scale, chunk=256):
  """float32 out, lse (log2 units) and, given `do`, dq at `rows` and dkv (complete only when `rows`
  is every query), from the gathered selected keys."""
  kvf = kv[0, :, 0].float().requires_grad_(do is not None)
  outs, lses, dqs = [], [], []
  for s in range(0, len(rows), chunk):
    r = rows[s:s + chunk]
    with torch.enable_grad() if do is not None else torch.no_grad():
      qr = q[0, r].float().requires_grad_(do is not None)
      sel = idx[0, r, 0].long()
      keys = kvf[sel]  # [n, k, 576]
      score = torch.einsum("nhd,nkd->nhk", qr, keys) * scale
      score = score.masked_fill((sel > r[:, None])[:, None, :], float("-inf"))
      out = torch.einsum("nhk,nkd->nhd", torch.softmax(score, -1), keys[..., :DIM])
      if do is not None:
        (out * do[0, r].float()).sum().backward()
        dqs.append(qr.grad)
    outs.append(out.detach())
    lses.append(torch.logsumexp(score.detach(), -1) / math.log(2))
  ref = dict(out=torch.cat(outs), lse=torch.cat(lses))
  if do is not None:
    ref.update(dq=torch.cat(dqs), dkv=kvf.grad)
  return ref


def rel_err(a, b):
  a, b = a.float(), b.float()
  return float((a - b).norm() / b.norm().clamp_min(1e-30))


def poison(torch, *shapes):
  """Fills, then frees, NaN buffers of these (shape, dtype)s, for the caching allocator to hand out next."""
  for shape, dtype in shapes:
    x = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    del x


def time_ms(torch, fn, warmup, reps):
  for _ in range(warmup):
    fn()
  torch.cuda.synchronize()
  times = []
  for _ in range(reps):
    # A queued spin (about 2.5 ms at 2 GHz) keeps the GPU busy while the host records `start` and
    # launches, so the events time the kernels and not Python's dispatch.
    torch.cuda._sleep(5_000_000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    times.append(start.elapsed_time(end))
  return statistics.median(times), times


def kernel_calls(mods, torch, q, kv, do, idx, H, k):
  """name -> (setup() -> fn() -> outputs dict, output (shape, dtype)s to poison, which reference
  keys the outputs are checked against). Setup runs once (the pipelined kernel's compile)."""
  def mod(name):
    if isinstance(mods[name], Exception):
      raise RuntimeError(f"import {name} failed: {mods[name]!r}")
    return mods[name]

  T = q.shape[1]
  out_shapes = [((1, T, H, DIM), torch.bfloat16), ((1, T, H), torch.float32)]
  grad_shapes = [((1, T, H), torch.float32), (tuple(q.shape), torch.bfloat16), (tuple(kv.shape), torch.bfloat16)]
  state = {}

  def setup_fwd():
    fwd = mod("sparse_mla_fwd")
    return lambda: dict(zip(["out", "lse"], fwd.sparse_mla_fwd_interface(q, kv, idx)))

  def setup_pipe():
    q_start = torch.tensor([0], dtype=torch.int32, device="cuda")
    kernel = mod("sparse_mla_fwd_pipelined").sparse_mla_fwd_interface(q, kv, idx, 0, 1, return_kernel=True)
    return lambda: dict(zip(["out", "lse"], kernel(q, kv, idx, q_start)))

  def forward_for_bwd():
    # The backward takes the forward's out and lse (log2 units); TileLang's own forward makes them.
    if "fwd" not in state:
      state["fwd"] = mod("sparse_mla_fwd").sparse_mla_fwd_interface(q, kv, idx)
    return state["fwd"]

  def setup_bwd():
    bwd, (out, lse) = mod("sparse_mla_bwd"), forward_for_bwd()
    return lambda: dict(zip(["dq", "dkv"], bwd.sparse_mla_bwd(q, kv, out, do, idx, lse)))

  def setup_bwd_kernel():
    bwd, (out, lse) = mod("sparse_mla_bwd"), forward_for_bwd()
    delta = bwd.preprocess(out, do)
    dkv = torch.zeros_like(kv, dtype=torch.float32)

    def run():
      dkv.zero_()  # a fresh accumulator each call, so the checked call's dkv is one backward's
      dq = bwd.bwd(q, kv, do, idx, lse, delta, dkv, H, DIM, TAIL, k, 1, None, True)
      return dict(dq=dq, dkv=dkv)
    return run

  return {
      "sparse_mla_fwd": (setup_fwd, out_shapes, ["out", "lse"], 0),
      # The pipelined example never writes its Lse (T.empty), and its own test gives every query at
      # least 1,025 valid keys (q_start_s_index=1024). On the H200 (2026-12-04) the rows with fewer
      # than 2 x 64 valid keys (one block per pipeline stage) came back NaN, so its check starts at
      # row PIPELINED_FIRST_ROW and leaves lse out; the NaN rows it left are counted in the row.
      "sparse_mla_fwd_pipelined": (setup_pipe, out_shapes, ["out"], PIPELINED_FIRST_ROW),
      "sparse_mla_bwd": (setup_bwd, grad_shapes, ["dq", "dkv"], 0),
      "sparse_mla_bwd_kernel": (setup_bwd_kernel, grad_shapes[1:], ["dq", "dkv"], 0),
  }


def run_row(name, call, torch, ref, rows, all_rows, T, H, k, args):
  setup, shapes, checked, first_row = call
  fwd_flops = 2 * T * k * H * (DIM + TAIL + DIM)
  bwd_flops = 2 * T * k * H * (DIM + 3 * (DIM + TAIL) + DIM)
  flops = bwd_flops if "bwd" in name else fwd_flops
  row = dict(kernel=name, T=T, H=H, k=k, selection=args.selection)
  t0 = time.time()
  fn = setup()
  poison(torch, *shapes)
  outs = fn()
  torch.cuda.synchronize()
  row["first_call_s"] = round(time.time() - t0, 2)  # compiles included (TileLang JIT + nvcc)
  errs, nans = {}, {}
  for key in checked:
    got = outs[key]
    if first_row:
      nan_rows = torch.isnan(got[0].reshape(T, -1)).any(1).nonzero().flatten()
      row["nan_rows_before_first_checked"] = int((nan_rows < first_row).sum())
      row["first_checked_row"] = first_row
      got = got.clone()
      got[0, :first_row] = 0
    nans[key] = int(torch.isnan(got).sum())
    if ref is None or ref.get(key) is None or (key == "dkv" and not all_rows):
      continue
    if key == "dkv":
      errs[key] = rel_err(got[0, :, 0], ref[key])
    else:
      kept = rows >= first_row
      errs[key] = rel_err(got[0, rows[kept]], ref[key][kept])
  row["nan_count"] = nans
  row["rel_err"] = errs
  tol = 2e-2 if "bwd" in name else 1e-2
  row["check_ok"] = all(v == 0 for v in nans.values()) and all(e < tol for e in errs.values())
  del outs
  ms, times = time_ms(torch, fn, args.warmup, args.reps)
  row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1), ms_all=[round(t, 4) for t in times])
  return row


def compile_only(mods, torch, H, k):
  """Builds each kernel for sm_90a from CPU placeholder tensors (TileLang needs only shapes and
  dtypes to compile): a check that the bundle, nvcc and the examples' API agree, with no GPU."""
  T, S = 256, 4096
  bf, f32, i32 = torch.bfloat16, torch.float32, torch.int32
  q, kv = torch.empty(1, T, H, DIM + TAIL, dtype=bf), torch.empty(1, S, 1, DIM + TAIL, dtype=bf)
  idx, do = torch.empty(1, T, 1, k, dtype=i32), torch.empty(1, T, H, DIM, dtype=bf)
  lse, dkv = torch.empty(1, T, H, dtype=f32), torch.empty(1, S, 1, DIM + TAIL, dtype=f32)
  fwd, pipe, bwd = mods["sparse_mla_fwd"], mods["sparse_mla_fwd_pipelined"], mods["sparse_mla_bwd"]
  builds = {
      "sparse_mla_fwd": lambda: fwd.sparse_mla_fwd.compile(q, kv, idx, H, DIM, TAIL, k, 1, None, True,
                                                           block_I=64, num_stages=2, threads=256),
      "sparse_mla_fwd_pipelined": lambda: pipe.sparse_mla_fwd.compile(
          q, kv, idx, torch.zeros(1, dtype=i32), H, DIM, TAIL, k, 1, 1, None, True, True),
      "sparse_mla_bwd.preprocess": lambda: bwd.preprocess.compile(do, do),
      "sparse_mla_bwd.bwd": lambda: bwd.bwd.compile(q, kv, do, idx, lse, lse, dkv, H, DIM, TAIL, k, 1, None, True),
      "sparse_mla_bwd.postprocess": lambda: bwd.postprocess.compile(dkv, DIM, TAIL, 1),
  }
  rows = []
  for name, build in builds.items():
    t0 = time.time()
    try:
      kernel = build()
      rows.append(dict(kernel=name, compiled=True, compile_s=round(time.time() - t0, 1),
                       source_chars=len(kernel.get_kernel_source())))
    except Exception as e:  # noqa: BLE001 - one kernel that does not build is a row
      traceback.print_exc()
      rows.append(dict(kernel=name, compiled=False, error=f"{type(e).__name__}: {str(e)[:500]}"))
    print(json.dumps(rows[-1]), flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--bundle", default="bench/anchors/.bundle/tilelang.tar.xz")
  parser.add_argument("--unpack-dir", default=None,
                      help="where the bundle is unpacked (default /tmp/tilelang_anchor; --smoke: a fresh temporary folder)")
  parser.add_argument("--seq", type=int, nargs="+", default=[16384])
  parser.add_argument("--heads", type=int, default=64)
  parser.add_argument("--topk", type=int, default=2048)
  parser.add_argument("--selection", choices=["distinct", "ours"], default="distinct")
  parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=KERNELS)
  parser.add_argument("--check-rows", type=int, default=0, help="queries checked against the reference (0: all, dq/dkv too)")
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--compile-only", action="store_true", help="build the kernels for sm_90a on CPU tensors; no GPU")
  parser.add_argument("--smoke", action="store_true", help="the setup on a stand-in bundle: no torch, no GPU")
  parser.add_argument("--out", default=None)
  args = parser.parse_args()

  own_folder = args.unpack_dir is None and args.smoke
  if own_folder:
    # The smoke deletes what it unpacked: a folder of its own (the same one after set_up's run again),
    # so two smokes at once never meet.
    if _SMOKE_FOLDER not in os.environ:
      os.environ[_SMOKE_FOLDER] = tempfile.mkdtemp(prefix="tilelang_anchor_smoke_")
    args.unpack_dir = os.environ[_SMOKE_FOLDER]
  elif args.unpack_dir is None:
    args.unpack_dir = "/tmp/tilelang_anchor"
  if args.smoke:
    args.bundle = smoke_bundle(args.unpack_dir)
  top = unpack(args.bundle, args.unpack_dir)
  set_up(top, os.path.join(args.unpack_dir, "cache"))
  if args.compile_only:
    # No GPU to ask: name the H200's target (TileLang takes a JSON dict, not a CLI string).
    os.environ.setdefault("TILELANG_DEFAULT_TARGET", json.dumps({"kind": "cuda", "arch": "sm_90a"}))
  if args.smoke:  # the stand-in bundle has no kernels to run: no torch
    torch = None
  else:
    import torch
  import tilelang

  meta = dict(anchor="tilelang", tilelang=tilelang.__version__, torch=torch and torch.__version__,
              cuda_home=os.environ.get("CUDA_HOME"), examples=provenance(top),
              gpu=torch.cuda.get_device_name() if torch and torch.cuda.is_available() else None, argv=sys.argv[1:],
              note="kernels from TileLang's examples/deepseek_v32, run unchanged from the git-ignored bundle")
  try:
    meta["nvcc"] = subprocess.run([os.path.join(meta["cuda_home"] or "", "bin", "nvcc"), "--version"],
                                  capture_output=True, text=True).stdout.strip().splitlines()[-1]
  except (OSError, IndexError):
    meta["nvcc"] = None
  print(json.dumps(meta), flush=True)
  result = dict(meta=meta, rows=[])

  def save():
    if args.out:
      os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
      with open(args.out, "w") as f:
        json.dump(result, f, indent=1)

  import importlib
  mods = {}
  for m in MODULES:
    try:
      mods[m] = importlib.import_module(m)
    except Exception as e:  # noqa: BLE001 - rows that need this module report it
      traceback.print_exc()
      mods[m] = e
  bad = {m: f"import {m}: {type(e).__name__}: {e}" for m, e in mods.items() if isinstance(e, Exception)}
  if args.smoke:  # where each module came from (utils: None for the stand-in), then the kernels, not run
    files = {"tilelang": tilelang, "utils": sys.modules["utils"], **mods}
    result["rows"] = [dict(module=m, error=bad[m]) if m in bad else dict(module=m, file=getattr(mod, "__file__", None))
                      for m, mod in files.items()]
    result["rows"] += [dict(kernel=name, skipped="--smoke: the stand-in bundle has no kernels")
                       for name in args.kernels]
    save()
    if own_folder:
      shutil.rmtree(args.unpack_dir)
    else:
      shutil.rmtree(os.path.dirname(top))
      os.remove(args.bundle)
    return
  if args.compile_only:
    if bad:
      result["rows"] = [dict(kernel=m, compiled=False, error=msg) for m, msg in bad.items()]
    else:
      result["rows"] = compile_only(mods, torch, args.heads, args.topk)
    save()
    return

  H, k = args.heads, args.topk
  for T in args.seq:
    torch.manual_seed(args.seed)
    q = torch.randn(1, T, H, DIM + TAIL, dtype=torch.bfloat16, device="cuda")
    kv = torch.randn(1, T, 1, DIM + TAIL, dtype=torch.bfloat16, device="cuda")
    do = torch.randn(1, T, H, DIM, dtype=torch.bfloat16, device="cuda")
    idx = selections(torch, T, k, args.selection, args.seed, "cuda").view(1, T, 1, k).contiguous()
    all_rows = args.check_rows <= 0 or args.check_rows >= T
    if all_rows:
      rows = torch.arange(T, device="cuda")
    else:
      # The first rows (short, padded selections) and a random spread of the rest.
      rest = torch.randperm(T - 8, device="cuda")[:max(args.check_rows - 8, 0)] + 8
      rows = torch.cat([torch.arange(8, device="cuda"), rest.sort().values])
    ref = None
    try:
      t0 = time.time()
      ref = reference(torch, q, kv, do if all_rows else None, idx, rows, (DIM + TAIL) ** -0.5)
      print(f"T={T}: reference at {len(rows)} rows in {time.time() - t0:.1f} s", flush=True)
    except Exception as e:  # noqa: BLE001 - without a reference the kernels are still timed
      traceback.print_exc()
      result["rows"].append(dict(kernel="reference", T=T, error=f"{type(e).__name__}: {str(e)[:500]}"))
    calls = kernel_calls(mods, torch, q, kv, do, idx, H, k)
    for name in args.kernels:
      try:
        row = run_row(name, calls[name], torch, ref, rows, all_rows, T, H, k, args)
      except Exception as e:  # noqa: BLE001 - one failing kernel (compile error, OOM) is a row, not the end
        traceback.print_exc()
        row = dict(kernel=name, T=T, H=H, k=k, selection=args.selection, error=f"{type(e).__name__}: {str(e)[:2000]}")
      print(json.dumps({k_: v for k_, v in row.items() if k_ != "ms_all"}), flush=True)
      result["rows"].append(row)
      save()
    del q, kv, do, idx, ref, calls
    torch.cuda.empty_cache()
  save()


if __name__ == "__main__":
  main()
