"""Every ```python block of the README runs (top to bottom, one namespace), then those of the
integration guide (docs/guide/integrations.md), whose snippets use the README's ``model`` and ``opt``."""
import os
import re

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")
GUIDE = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "guide", "integrations.md")


def python_blocks(path=README):
    text = open(path, encoding="utf-8").read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    blocks = python_blocks()
    assert len(blocks) >= 2
    guide = python_blocks(GUIDE)
    assert guide, "the integration guide's torch state-dict helpers snippet"
    blocks += guide
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for i, block in enumerate(blocks):
        code = block.replace("/tmp/", str(tmp_path) + "/")
        exec(compile(code, f"README block {i}", "exec"), namespace)
