"""`tools/house_check.py`: the package's shape in numbers, found as they are on a small package made here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from conftest import REPO


def _house_check():
    spec = importlib.util.spec_from_file_location("house_check", REPO / "tools" / "house_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["house_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_it_finds_long_modules_long_signatures_private_imports_and_cycles(tmp_path: Path) -> None:
    house = _house_check()
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg import a\n")
    (pkg / "a.py").write_text("from pkg.b import _hidden\n\n\ndef wide(" + ", ".join(f"p{i}" for i in range(11))
                              + "):\n    pass\n\n\ndef _private_wide(" + ", ".join(f"p{i}" for i in range(12))
                              + "):\n    pass\n")
    (pkg / "b.py").write_text("def _hidden():\n    from pkg import a\n" + "\n" * house.MAX_LINES)
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from pkg import sub\n\n\nclass C:\n    def method(self, " +
                                      ", ".join(f"p{i}" for i in range(10)) + "):\n        pass\n")
    found = house.check(pkg)
    assert found.long_modules == [f"pkg/b.py: {house.MAX_LINES + 2} lines"]
    assert found.long_signatures == ["pkg/a.py:4 wide: 11 parameters"]  # private ones, and self, not counted
    assert found.private_imports == ["pkg/a.py:1 _hidden from pkg.b"]
    assert found.cycles == ["pkg.a <-> pkg.b"]  # `from pkg import a` is pkg.a, not the package's __init__
    assert found.count == 4


def test_it_runs_on_the_package_and_strict_fails_only_when_something_is_found(capsys) -> None:
    house = _house_check()
    found = house.check()
    assert house.main([]) == 0
    out = capsys.readouterr().out
    assert f"modules over {house.MAX_LINES} lines: {len(found.long_modules)}" in out
    assert house.main(["--strict"]) == (1 if found.count else 0)
