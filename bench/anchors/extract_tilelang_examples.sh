#!/usr/bin/env bash
# Copies TileLang's DeepSeek-V3.2 sparse MLA examples out of a TileLang git repository (a checkout or
# a bare git dir) into OUT_DIR, for build_tilelang_bundle.sh. They go into the git-ignored bundle only:
# the project learns from TileLang's code and never commits it.
#
#   bench/anchors/extract_tilelang_examples.sh GIT_REPO OUT_DIR [REV]   # REV defaults to HEAD
set -euo pipefail

if [[ $# -lt 2 ]]; then
  sed -n '2,6p' "$0" >&2
  exit 2
fi
src=$1 out=$2 rev=${3:-HEAD}
# A checkout has .git (a folder, or a file in a worktree); a bare repository is its own git dir.
if [[ -e "$src/.git" ]]; then git=(git -C "$src"); else git=(git --git-dir="$src"); fi
commit=$("${git[@]}" rev-parse --verify "$rev^{commit}")

# The three kernels the anchor times, and utils.py, which sparse_mla_fwd.py and sparse_mla_bwd.py
# import at module level.
files=(sparse_mla_fwd.py sparse_mla_fwd_pipelined.py sparse_mla_bwd.py utils.py)
mkdir -p "$out"
for f in "${files[@]}"; do
  "${git[@]}" show "$commit:examples/deepseek_v32/$f" >"$out/$f"
done
"${git[@]}" show "$commit:LICENSE" >"$out/LICENSE"
{
  echo "repository: https://github.com/tile-ai/tilelang"
  echo "commit: $commit"
  echo "commit_date: $("${git[@]}" show -s --format=%cI "$commit")"
  echo "version_file: $("${git[@]}" show "$commit:VERSION" 2>/dev/null || echo unknown)"
  echo "path: examples/deepseek_v32/"
  echo "files: ${files[*]}"
} >"$out/PROVENANCE.txt"
echo "TileLang examples at $commit -> $out"
