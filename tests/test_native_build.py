"""The native kernels' build, without a compiler run: what an interrupted or failed build leaves in
the cache. (The kernels themselves: tests/test_native_kernels.py.)"""

from __future__ import annotations

import subprocess

import pytest

from harness.target import native


@pytest.fixture
def fake_compiler(monkeypatch):
    """A compiler that is never run: its path and version are given, so the build's key is computed
    without one on this machine."""
    monkeypatch.setattr(native, "cpp_compiler", lambda: "/usr/bin/g++-fake")
    monkeypatch.setattr(native, "_compiler_version", lambda cxx: "g++-fake 1.0")


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupted_build_leaves_no_partial_file_and_the_interrupt_goes_on(
    tmp_path, monkeypatch, fake_compiler, interrupt
):
    seen = []

    def interrupted(cmd, **kwargs):
        seen.extend(tmp_path.glob("*.partial"))  # the file the compiler writes exists while it runs
        raise interrupt()

    monkeypatch.setattr(native.subprocess, "run", interrupted)
    with pytest.raises(interrupt):
        native.build(out_dir=tmp_path)
    assert len(seen) == 1
    assert list(tmp_path.iterdir()) == []


def test_a_failed_build_or_rename_leaves_no_partial_file(tmp_path, monkeypatch, fake_compiler):
    failed = subprocess.CompletedProcess(args=[], returncode=1, stdout="", stderr="x.cpp:1: error: no\n")
    monkeypatch.setattr(native.subprocess, "run", lambda cmd, **kwargs: failed)
    with pytest.raises(native.NativeBuildError, match="could not build cpu_decode.cpp: x.cpp:1: error: no"):
        native.build(out_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []

    built = subprocess.CompletedProcess(args=[], returncode=0, stdout="", stderr="")
    monkeypatch.setattr(native.subprocess, "run", lambda cmd, **kwargs: built)

    def refused(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(native.os, "replace", refused)
    with pytest.raises(native.NativeBuildError, match="cannot write the native kernels into .*Permission denied"):
        native.build(out_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
