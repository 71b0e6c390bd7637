"""The hardware card's commit: the harness checkout's own, never an enclosing repository's."""

from __future__ import annotations

import subprocess

import harness.measure.hardware as hardware


def test_the_commit_is_the_harness_checkout_s_and_none_inside_another_repository(tmp_path, monkeypatch):
    """Installed into a project's site-packages (a non-editable install), the harness asked git from
    there and recorded the enclosing project's commit and dirty state as its own."""
    project = tmp_path / "otherproj"
    installed = project / ".venv" / "lib" / "site-packages"
    installed.mkdir(parents=True)
    for argv in (
        ["init", "-q"],
        ["-c", "user.name=x", "-c", "user.email=x@x", "commit", "-q", "--allow-empty", "-m", "x"],
    ):
        subprocess.run(["git", *argv], cwd=project, check=True, capture_output=True)
    monkeypatch.setattr(hardware, "REPO_ROOT", installed)
    assert hardware.git_commit() is None
    monkeypatch.setattr(hardware, "REPO_ROOT", project)  # the checkout itself: its commit
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=project, capture_output=True, text=True).stdout.strip()
    assert hardware.git_commit() == head
