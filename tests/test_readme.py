"""The README's example runs as written."""

import pathlib
import re


def test_readme_python_blocks_run():
  readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
  blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), flags=re.S)
  assert blocks, "README has no python example"
  for block in blocks:
    exec(compile(block, "README.md", "exec"), {})
