"""README.md's Python section runs as written, top to bottom, in a fresh
process with a private config directory (its key made on first use, its
keyring step included)."""

import os
import re

from conftest import SRC, run_python


def test_readme_python_section_runs_as_written(tmp_path):
    text = open(os.path.join(SRC, "README.md"), encoding="utf-8").read()
    block = re.search(r"<!-- readme-python: begin -->\s*```python\n(.*?)```\s*"
                      r"<!-- readme-python: end -->", text, re.S)
    assert block, "README.md lost its marked Python block"
    code = block.group(1)
    env = {"KILN_CONFIG_DIR": str(tmp_path / "config")}
    res = run_python(code, timeout=600, env=env, cwd=str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "torch.Size([5, 1000])" in res.stdout, res.stdout
    assert (tmp_path / "model.kar").is_file() and (tmp_path / "model.pt").is_file()
    # the keyring the block made for "another host" holds your own key
    assert len(list((tmp_path / "keyring").glob("*.pub"))) == 1
