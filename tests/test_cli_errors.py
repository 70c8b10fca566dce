"""The `vapo` command as a new user meets it: plug-ins from the working directory, and
mistakes reported in one line naming the field or file, before any work."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VAPO = Path(sys.executable).parent / "vapo"  # the console script, as installed


def vapo(*args, cwd=ROOT, timeout=300):
    if not VAPO.exists():
        pytest.skip("the vapo console script is not installed")
    return subprocess.run(
        [str(VAPO), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def test_the_readme_plugin_imports_from_the_working_directory(tmp_path):
    readme = (ROOT / "README.md").read_text()
    (code,) = re.findall(r"```python\n(# my_rewards\.py.*?)```", readme, re.DOTALL)
    (tmp_path / "my_rewards.py").write_text(code)
    done = vapo("fit", "-c", str(ROOT / "configs/tiny_cpu.yaml"), "--print_config",
                "--trainer.callbacks+=my_rewards.ShortAnswerBonus",
                "--trainer.callbacks.weight=0.1", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "class_path: my_rewards.ShortAnswerBonus" in done.stdout
