"""Collection rules for the whole repository (pytest reads this before tests/conftest.py).

``--doctest-modules`` imports every module under ``opsched/``. The modules
below import an optional extra at their top, so without that extra they are
left out of collection (their tests skip the same way) instead of failing it.
Everything else in opsched imports its extras inside the functions that need
them and is collected everywhere. This file is not part of the wheel.
"""

import importlib.util

# tests/data holds the scripts that wrote the test exports (they import torch and transformers at
# their top and hold no tests): never collected, with or without the extras.
collect_ignore = ["tests/data"]
if importlib.util.find_spec("torch") is None:
    # model.py and the hf_* modules import torch at the top and launch.py imports model;
    # calibrate.py needs no torch, so its doctests run everywhere.
    collect_ignore += ["opsched/torchrun/model.py", "opsched/torchrun/launch.py", "opsched/torchrun/hf_clip.py",
                       "opsched/torchrun/hf_model.py", "opsched/torchrun/hf_parts.py"]
