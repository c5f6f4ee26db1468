"""The README's quick start and notation stay true (issue 15 items 4 and 12)."""

import os
import re
import subprocess
import sys

from helpers import REPO
from opsched.upper.layouts import NOTATION

README = (REPO / "README.md").read_text(encoding="utf-8")


def test_readme_shows_the_layout_notation_plan_help_shows():
    assert NOTATION.strip() in README, "README's notation block differs from opsched.upper.layouts.NOTATION"


def test_quick_start_makes_a_venv_runs_from_the_root_and_states_a_measured_time():
    quick = README[README.index("## Quick start"):README.index("## Reading a plan")]
    commands = re.search(r"```\n(.*?)```", quick, re.S).group(1).splitlines()
    assert commands[0].startswith("python -m venv .venv && . .venv/bin/activate")
    assert commands[1] == 'pip install -e ".[pictures]"'
    assert commands[2].startswith("opsched plan models/")
    model = commands[2].split()[2]
    assert (REPO / model).is_file(), model  # relative to the checkout's root
    assert "2-core" in quick and re.search(r"took\s+\d+ s", quick) and re.search(r"plan\s+took \d+ s", quick)


def test_python_m_opsched_runs_from_the_checkout():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "opsched", "--version"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("opsched ")
