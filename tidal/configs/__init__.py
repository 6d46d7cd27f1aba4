"""The experiment configs Tidal ships (YAML), found with `importlib.resources`, so an installed
package has them as well as a checkout (whose `configs/` is a link to this directory).

`config_path("configs/ooco.yaml")`, `config_path("ooco.yaml")` and `config_path("ooco")` all name
the shipped file when no such path exists where the command runs; a path that exists wins.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

SUFFIX = ".yaml"


def shipped() -> list[str]:
    """Names of the shipped configs (`embedded.yaml`, `ooco.yaml`, ...)."""
    return sorted(p.name for p in files(__name__).iterdir() if p.name.endswith(SUFFIX))


def config_path(path: str | Path) -> Path:
    """The file `path` names: itself when it exists, else the shipped config of that name
    (a `configs/` prefix and the `.yaml` suffix may be left out). ValueError names the shipped
    ones when neither exists."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if p.parent in (Path("."), Path("configs")):
        name = p.name if p.name.endswith(SUFFIX) else p.name + SUFFIX
        res = files(__name__) / name
        if res.is_file():
            return Path(str(res))
    raise ValueError(f"config {path} does not exist; shipped configs: {', '.join(shipped())}")
