"""SIGTERM (how Slurm, Kubernetes and `kill` stop a job) ends a plan like Ctrl-C (issue 15 item 7).

A real `opsched plan` process gets SIGTERM while a forked solver child is
running: it exits with 143 and one line, the child is gone, and no output
directory is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import process_alive

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find the solver child")


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (name)": state, ppid, ...
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def test_sigterm_during_a_solve_exits_143_kills_the_child_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "opsched.cli", "plan", str(REPO / "models" / "clip_vit_l14.onnx"), "--devices", "4",
         "--microbatches", "4", "--time-limit", "4", "-o", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 120
        children: list[int] = []
        while not children and proc.poll() is None and time.monotonic() < deadline:
            children = _children(proc.pid)
            time.sleep(0.02)
        assert children, "no solver child appeared"
        proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert time.monotonic() - stopped < 10, "the command took long to stop"
    assert proc.returncode == 143, stderr
    assert stderr.strip().splitlines()[-1] == "opsched: terminated", stderr
    assert "Traceback" not in stderr and stdout == ""
    assert not out.exists(), "an output directory was left"
    time.sleep(0.5)
    assert not [c for c in children if process_alive(c)], "a solver child outlived the command"
