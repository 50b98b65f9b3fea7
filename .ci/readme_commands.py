"""Print the README's two set-up commands, one a line: the demo command, then the test command.

They are the first fenced ``bash`` block of README.md, which must open the README and hold exactly
these two lines. ``.ci/run`` runs what this prints, so CI runs the commands a newcomer copies, as
written; tests/test_ci.py checks the README's shape and that ``.ci/run`` takes them from here."""
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_commands(text: str) -> list[str]:
    """The two commands of the README's first ``bash`` block; ValueError when the block is missing,
    is not the first thing after the title, or holds other than two commands."""
    m = re.match(r"# [^\n]+\n+```bash\n(.*?)```", text, flags=re.S)
    if m is None:
        raise ValueError("README.md must start with its title and then a ```bash block of the two set-up commands")
    lines = [line for line in m.group(1).splitlines() if line.strip()]
    if len(lines) != 2:
        raise ValueError(f"README.md's first bash block must hold exactly two commands (demo, tests); it holds {len(lines)}")
    if "pytest" in lines[0] or "pytest" not in lines[1]:
        raise ValueError("README.md's first bash block: the demo command first, then the test command (the one running pytest)")
    return lines


if __name__ == "__main__":
    try:
        print("\n".join(readme_commands(README.read_text(encoding="utf-8"))))
    except ValueError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
