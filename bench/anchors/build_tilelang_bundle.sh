#!/usr/bin/env bash
# Builds bench/anchors/.bundle/tilelang.tar.xz: TileLang's wheel and the three it needs that the GPU
# machine's image lacks, unpacked into one site folder, plus TileLang's DeepSeek-V3.2 sparse MLA
# examples, in one xz tarball that the device tool can carry (the GPU machine reaches no registry).
# Run it here (it needs PyPI), from the repository root or anywhere:
#
#   bench/anchors/build_tilelang_bundle.sh EXAMPLES_DIR [OUT]   # OUT: bench/anchors/.bundle/tilelang.tar.xz
#
# EXAMPLES_DIR holds sparse_mla_fwd.py, sparse_mla_fwd_pipelined.py, sparse_mla_bwd.py and utils.py
# (extract_tilelang_examples.sh writes it from a TileLang git repository). PYTHON (default python3)
# runs pip; pip's own Python version does not matter, the wheels are chosen for cp312 x86-64.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  sed -n '2,10p' "$0" >&2
  exit 2
fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
examples=$(cd "$1" && pwd)
out=${2:-$here/.bundle/tilelang.tar.xz}
py=${PYTHON:-python3}

# Pinned together: tilelang 0.1.15's METADATA asks for apache-tvm-ffi >=0.1.11,<0.1.13 and
# z3-solver >=4.13.0,<4.15.5, and its libtvm_compiler.so links libz3.so.4.15 by that name, so a
# z3-solver 5.x (what pip picks unpinned) would leave the compiler library unloadable.
# torch-c-dlpack-ext ships addons up to torch 2.9; with torch 2.11 tvm-ffi uses torch's own DLPack
# exchange API instead, so it is carried only because tilelang declares it.
# The image already has tilelang's other needs (torch, numpy, ml-dtypes, cloudpickle, psutil, tqdm,
# typing-extensions; KINDS.md's package list).
wheels=(tilelang==0.1.15 apache-tvm-ffi==0.1.12 z3-solver==4.15.4.0 torch-c-dlpack-ext==0.1.5)
needed=(sparse_mla_fwd.py sparse_mla_fwd_pipelined.py sparse_mla_bwd.py utils.py)
for f in "${needed[@]}"; do
  [[ -f "$examples/$f" ]] || { echo "missing $examples/$f (see extract_tilelang_examples.sh)" >&2; exit 1; }
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
top=$work/tilelang_anchor
mkdir -p "$work/wheels" "$top/site" "$top/examples"

# pip matches manylinux tags exactly, so each tag the four wheels carry is named (z3-solver 4.15.4
# is manylinux_2_17, tilelang manylinux_2_27/2_28; the image is Ubuntu with Python 3.12.3).
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$work/wheels" "${wheels[@]}"

# Unpacked by Python rather than pip install --target: the target Python is not this one, and pip would
# try to compile and resolve. Mode bits are kept (zipfile drops them).
"$py" - "$work/wheels" "$top/site" <<'EOF'
import pathlib, sys, zipfile
wheels, site = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for whl in sorted(wheels.glob("*.whl")):
  with zipfile.ZipFile(whl) as z:
    for info in z.infolist():
      path = z.extract(info, site)
      mode = info.external_attr >> 16 & 0o777
      if mode and not info.is_dir():
        pathlib.Path(path).chmod(mode)
EOF

# Dropped: the z3 command-line solver (z3_solver-*.data/, 20+ MB; TileLang loads libz3 only), and
# the second copy of libz3 (a zip has no links: libz3.so and libz3.so.4.15 are the same 40 MB twice;
# z3's Python module opens libz3.so, TileLang's libraries libz3.so.4.15).
rm -rf "$top"/site/*.data
lib=$top/site/z3/lib
if [[ -f $lib/libz3.so.4.15 ]] && cmp -s "$lib/libz3.so" "$lib/libz3.so.4.15"; then
  ln -sf libz3.so.4.15 "$lib/libz3.so"
fi
# Everything else stays: nvcc compiles each kernel against tilelang/src (TileLang's templates) and
# 3rdparty/cutlass/include, and TVM's Python package comes from 3rdparty/tvm/python.

cp "${needed[@]/#/$examples/}" "$top/examples/"
for f in LICENSE PROVENANCE.txt; do
  [[ -f "$examples/$f" ]] && cp "$examples/$f" "$top/examples/"
done
(cd "$work/wheels" && sha256sum ./*.whl) >"$top/WHEELS.sha256"

mkdir -p "$(dirname "$out")"
# -T2: this machine's two cores are shared; -6 is within a few percent of -9e here at a fraction of the time.
tar -C "$work" --sort=name --owner=0 --group=0 --numeric-owner -cf - tilelang_anchor \
  | xz -T2 -6 >"$out.partial"
mv "$out.partial" "$out"
size=$(stat -c %s "$out")
echo "$out: $((size / 1048576)) MiB ($size bytes), unpacked $(du -sm "$top" | cut -f1) MiB"
# The device tool carries 64 MiB in all: the bundle, the repository's tracked files (about 11 MiB)
# and whatever else the call carries.
if (( size > 48 * 1048576 )); then
  echo "warning: over 48 MiB; with the repository and .whl this may pass the 64 MiB carry limit" >&2
fi
