"""pyproject.toml packages the whole project: a non-editable install gets every package of the source tree.

setuptools installs only the packages `[tool.setuptools] packages` names, so a package left out of that list
imports in the checkout (and in an editable install) but is missing from a wheel."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Not part of the installed package: the benches are a development harness imported as the top-level `bench`
# (pytest's pythonpath), and the tests are not a package.
NOT_PACKAGED = {"bench", "tests"}


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _source_packages() -> set[str]:
    """``refbus.<dotted path>`` of every package of the source tree: each top-level directory holding an
    ``__init__.py``, and within a package each directory holding one (as imports see them: build outputs
    such as ``build/lib/`` hold no package at their top and are not walked)."""
    found = set()
    pending = [d for d in ROOT.iterdir() if d.name not in NOT_PACKAGED and (d / "__init__.py").is_file()]
    while pending:
        directory = pending.pop()
        found.add(".".join(("refbus", *directory.relative_to(ROOT).parts)))
        pending += [d for d in directory.iterdir() if (d / "__init__.py").is_file()]
    return found


def _directory(package: str, package_dir: dict[str, str]) -> Path:
    """Where setuptools looks for ``package``: under the longest ``package-dir`` entry that prefixes it."""
    parts = package.split(".")
    for cut in range(len(parts), 0, -1):
        mapped = package_dir.get(".".join(parts[:cut]))
        if mapped is not None:
            return ROOT / mapped / Path(*parts[cut:])
    raise AssertionError(f"{package}: no [tool.setuptools.package-dir] entry maps it or a parent")


def test_every_package_of_the_source_tree_is_in_pyprojects_package_list() -> None:
    listed = set(_setuptools()["packages"])
    missing = _source_packages() - listed
    assert not missing, f"pyproject.toml [tool.setuptools] packages leaves out {sorted(missing)}: a wheel lacks them"


def test_every_listed_package_is_a_package_directory() -> None:
    setuptools = _setuptools()
    for package in setuptools["packages"]:
        directory = _directory(package, setuptools["package-dir"])
        assert (directory / "__init__.py").is_file(), f"{package}: {directory} holds no __init__.py"
