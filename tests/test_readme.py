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


FUNCTIONAL = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "guide", "functional.md")


def test_the_functional_guide_opens_with_the_readmes_form_and_its_examples_run(tmp_path, monkeypatch):
    """The README's functional quickstart and the functional guide's first example are the same
    form (the pure ``tx.update`` then ``apply_updates``); the guide's first two blocks run, the
    second's donated step giving the pure form's bits."""
    readme = next(b for b in python_blocks() if "tx.update(" in b)
    first, second = python_blocks(FUNCTIONAL)[:2]
    for block in (readme, first):
        assert "tx.update(grads, state, params)" in block and "apply_updates(params, updates)" in block
        assert "donate=True" not in block
    assert "donate=True" in second
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for i, block in enumerate((first, second)):
        exec(compile(block, f"functional guide block {i}", "exec"), namespace)
