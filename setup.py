"""operators/ is installed under the import name `flowrl_operators` so it can never clash with
another top-level module; setuptools needs the package list spelled out for such a mapping."""

from setuptools import find_packages, setup

operators = find_packages(include=["operators", "operators.*"])
packages = find_packages(include=["flowrl", "flowrl.*"]) + [
    "flowrl_operators" + name[len("operators"):] for name in operators
]
setup(packages=packages, package_dir={"flowrl_operators": "operators"})
