"""Settings for every test: property tests are derandomized, so a run is repeatable (a failure found once is
found again). Shared helpers are in tests/helpers.py (``from helpers import ...``), not here."""

import hypothesis

hypothesis.settings.register_profile("opsched", derandomize=True)
hypothesis.settings.load_profile("opsched")
