"""Maps the top-level component folders to the `triptych.*` import names.

pyproject.toml holds the metadata; only the package list lives here, because it is
derived from the folders (find_packages under each mapped root)."""

from setuptools import find_packages, setup

ROOTS = {
    "triptych": "triptych",
    "triptych.worker": "worker",
    "triptych.router": "router",
    "triptych.operator": "operator",
}


def _packages() -> list[str]:
    found: list[str] = []
    for name, folder in ROOTS.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_packages(folder)]
    return found


setup(packages=_packages(), package_dir=ROOTS)
