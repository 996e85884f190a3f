"""Every Python block of README.md runs as written (on the bundled data) and does what its text says."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.slow  # each block runs in its own interpreter (seconds each)
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index: int, tmp_path: pathlib.Path) -> None:
    script = tmp_path / f"block_{index}.py"
    script.write_text(BLOCKS[index])
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    if "test accuracy" in BLOCKS[index]:
        accuracy = float(re.search(r"test accuracy ([0-9.]+)", out).group(1))
        assert accuracy > 0.6, out  # the front-door example learns (chance is 0.1)
    if "train loss" in BLOCKS[index]:
        start, end = map(float, re.search(r"train loss ([0-9.]+) -> ([0-9.]+)", out).groups())
        assert end < start, out  # the DIFF2 example converges below its starting loss
