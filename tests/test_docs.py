"""What the docs say of the code: docs/cheap.md's table of fast forms names tests and modules that exist."""

import ast
import re

from conftest import ROOT


def test_each_fast_form_in_cheap_md_is_in_its_module_and_each_test_it_names_exists():
    table = (ROOT / "docs" / "cheap.md").read_text().split("## Each fast form", 1)[1]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) >= 12
    defined = {}  # test name -> file
    for path in (ROOT / "tests").glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                defined[node.name] = path.name
    for fast, module, _, tests in rows:
        name = re.match(r"\| `(\w+)", fast + " ").group(1)
        source = (ROOT / module.strip("`")).read_text()
        assert re.search(rf"^(def|class) {name}\b", source, re.MULTILINE), f"{name} is not defined in {module}"
        named = re.findall(r"`(test_\w+)`", tests)
        assert named and all(test in defined for test in named), [t for t in named if t not in defined]
