"""Collection rules for the whole repository (pytest reads this before tests/conftest.py).

``--doctest-modules`` imports every module under ``opsched/``. A module that
imports an optional extra (torch, transformers, ...) at its top, directly or
through another opsched module, is left out of collection when that extra is
absent (its tests skip the same way) instead of failing it. The rule asks the
import itself rather than keeping a list of such modules, so a new module
cannot bring back a red test command on a machine without the extras.
This file is not part of the wheel.
"""

import importlib
from pathlib import Path

# The optional extras of pyproject.toml whose absence leaves a module out.
OPTIONAL_EXTRAS = frozenset({"torch", "transformers", "onnxscript", "megatron", "torchtitan", "tyro", "playwright",
                             "matplotlib", "highspy", "highsbox"})

# tests/data holds the scripts that wrote the test exports (they import torch and transformers at
# their top and hold no tests): never collected, with or without the extras.
collect_ignore = ["tests/data"]

_PACKAGE_ROOT = Path(__file__).parent / "opsched"


def pytest_ignore_collect(collection_path, config):
    """Leave out an ``opsched`` module whose import needs an absent optional extra."""
    path = Path(collection_path)
    # __main__.py runs the CLI when imported (and --doctest-modules never collects it)
    if path.suffix != ".py" or path.name == "__main__.py" or _PACKAGE_ROOT not in path.parents:
        return None
    module = ".".join(path.relative_to(_PACKAGE_ROOT.parent).with_suffix("").parts)
    if module.endswith(".__init__"):
        module = module[: -len(".__init__")]
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as missing:
        if (missing.name or "").split(".")[0] in OPTIONAL_EXTRAS:
            return True
        raise
    return None
