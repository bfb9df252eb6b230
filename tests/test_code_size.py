"""Small functions and files: no function in ``automodel/`` is over 60 lines and no file is over
400 (the project's standard). A function's lines run from its ``def`` to its last line,
docstring and nested functions included; a file's are all its lines."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

PACKAGE = Path(__file__).resolve().parents[1] / "automodel"
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 400


def oversized(root: Path) -> list[str]:
    """Every function over ``MAX_FUNCTION_LINES`` and file over ``MAX_FILE_LINES`` under
    ``root``, one line each, with its path, name and length."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(root.parent)
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            found.append(f"{where}: {lines} lines (at most {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{where}:{node.lineno} {node.name}: {length} lines "
                                 f"(at most {MAX_FUNCTION_LINES})")
    return found


def test_no_function_or_file_is_too_long():
    found = oversized(PACKAGE)
    assert not found, "split these:\n" + "\n".join(found)


def test_the_check_sees_a_long_function_and_a_long_file(tmp_path):
    root = tmp_path / "pkg"
    root.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))  # def + 60 lines
    (root / "long.py").write_text("def fine():\n    pass\n\n\ndef long():\n" + body)
    (root / "big.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    (root / "edge.py").write_text("x = 1\n" * MAX_FILE_LINES)
    assert oversized(root) == [f"pkg/big.py: {MAX_FILE_LINES + 1} lines (at most 400)",
                               "pkg/long.py:5 long: 61 lines (at most 60)"]
