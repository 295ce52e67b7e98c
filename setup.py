"""Maps the repository's layer folders into the one `shoal` import namespace.

The metadata lives in pyproject.toml; this file only computes the package list, because
setuptools' declarative `packages.find` cannot rename: the folder `core/` installs as
`shoal.core`, `collectives/backends/tcp/` as `shoal.collectives.backends.tcp`, and so on.
No top-level name other than `shoal` is installed.
"""

from setuptools import find_packages, setup

LAYERS = ("core", "collectives", "rpc_agent", "elastic", "launcher", "examples", "torch_bridge")

packages = ["shoal"]
package_dir = {"shoal": "shoal"}
for layer in LAYERS:
    package_dir[f"shoal.{layer}"] = layer
    packages += [f"shoal.{name}" for name in find_packages(include=[layer, f"{layer}.*"])]

setup(packages=packages, package_dir=package_dir)
