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


def test_the_bandwidth_buffer_outgrows_every_last_level_cache_slice_together(tmp_path, monkeypatch):
    """cpu0's L3 is one of a multi-chiplet EPYC's twelve slices (or one socket's of two): a buffer of
    twice cpu0's stayed within their sum, each thread's share resident in its own slice, and the
    "memory" bandwidth read the caches'. Slices are counted once each, by the CPUs they serve."""
    from harness.target import timing

    for cpu in range(4):
        for index, (level, size, shared) in enumerate(
            [(1, "32K", str(cpu)), (2, "1024K", str(cpu)), (3, "32768K", "0-1" if cpu < 2 else "2-3")]
        ):
            d = tmp_path / f"cpu{cpu}" / "cache" / f"index{index}"
            d.mkdir(parents=True)
            (d / "level").write_text(f"{level}\n")
            (d / "size").write_text(f"{size}\n")
            (d / "shared_cpu_list").write_text(f"{shared}\n")
    assert hardware.total_last_level_cache_bytes(str(tmp_path)) == 2 * 32 * 2**20
    monkeypatch.setattr(timing, "total_last_level_cache_bytes", lambda: 12 * 32 * 2**20)
    monkeypatch.setattr(timing, "last_level_cache_bytes", lambda: 32 * 2**20)
    assert timing.bandwidth_buffer_bytes("cpu") == 2 * 12 * 32 * 2**20


def test_an_arm_cpu_is_named_by_its_implementer_and_part(tmp_path):
    """aarch64's /proc/cpuinfo has no "model name": every ARM CPU read as "aarch64", and artifacts keyed
    by the host that timed them (a layer-skip vector, a Sequoia profile) were shared across parts."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nBogoMIPS\t: 2100.00\nCPU implementer\t: 0x4e\nCPU part\t: 0xd4f\n")
    name = hardware.cpu_name(str(info))
    assert name.endswith("(implementer 0x4e, part 0xd4f)")
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\n")
    assert hardware.cpu_name(str(info)) == "Intel(R) Xeon(R) Processor"


def test_a_cuda_card_names_the_runtime_cudnn_driver_capability_and_nvidia_wheels(tmp_path, monkeypatch):
    """A CUDA run's card named the device only: two machines with one torch release but other cuBLAS
    or cuDNN wheels, or another driver, read as one. The card on a (here faked) CUDA device says them."""
    import torch

    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        '#!/bin/sh\nfor a in "$@"; do [ "$a" = "--query-gpu=driver_version" ] && echo "570.86.15"; done\nexit 0\n'
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91002)
    monkeypatch.setattr(torch.version, "cuda", "12.8")

    class Dist:
        def __init__(self, name, version):
            self.metadata, self.version = {"Name": name}, version

    dists = [Dist("nvidia-cudnn-cu12", "9.10.2.21"), Dist("numpy", "2.3.0"), Dist("nvidia-cublas-cu12", "12.8.4.1")]
    monkeypatch.setattr(hardware.metadata, "distributions", lambda: iter(dists))
    card = hardware.hardware_card("cuda")
    assert card["device_name"] == "NVIDIA H200"
    assert card["cuda_runtime"] == "12.8" and card["cudnn"] == "91002" and card["compute_capability"] == "9.0"
    assert card["cuda_driver"] == "570.86.15"
    assert card["cuda_wheels"] == {"nvidia-cublas-cu12": "12.8.4.1", "nvidia-cudnn-cu12": "9.10.2.21"}
    assert "cuda_runtime" not in hardware.hardware_card("cpu")  # a CPU run has no CUDA libraries to name
    smi.write_text("#!/bin/sh\nexit 9\n")  # a failing nvidia-smi: no driver version, not an error
    assert hardware.cuda_driver_version() is None


def test_a_draft_on_another_device_than_the_target_s_is_named_in_the_card(monkeypatch):
    """A draft model on another GPU (``proposer.model.device=cuda:1``) left no trace in the card: a
    run whose draft ran on another GPU model read as one run on the target's GPU alone."""
    import torch

    names = {0: "NVIDIA H200", 1: "NVIDIA L4"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: names[torch.device(device).index or 0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: {0: (9, 0), 1: (8, 9)}[device])
    monkeypatch.setattr(hardware, "cuda_card", lambda dev: {})
    card = hardware.hardware_card("cuda:0", draft_device="cuda:1")
    assert (card["device_name"], card["draft_device"], card["draft_device_name"]) == (
        "NVIDIA H200",
        "cuda:1",
        "NVIDIA L4",
    )
    assert card["draft_compute_capability"] == "8.9"
    for same in ("cuda:0", "cuda"):  # the target's device ("cuda" is the current one's): nothing added
        assert not any(k.startswith("draft_") for k in hardware.hardware_card("cuda", draft_device=same))
    on_cpu = hardware.hardware_card("cuda:0", draft_device="cpu")
    assert on_cpu["draft_device"] == "cpu" and on_cpu["draft_device_name"] == hardware.cpu_name()
    assert "draft_compute_capability" not in on_cpu
    assert not any(k.startswith("draft_") for k in hardware.hardware_card("cpu", draft_device="cpu"))


def test_the_native_kernels_code_paths_name_the_compiler_that_built_them(tmp_path, monkeypatch):
    """The compiler's version keyed the native build but no record said it: two records whose kernels
    another compiler built (other instruction scheduling, other rounding of contractions it may form)
    read alike. The code paths a record keeps name it."""
    from harness.target import native

    cxx = tmp_path / "fake-c++"
    cxx.write_text('#!/bin/sh\necho "fake-c++ (Test) 99.1.0"\necho "second line"\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    assert native.compiler_version() == "fake-c++ (Test) 99.1.0"
    assert native.code_paths()["compiler"] == "fake-c++ (Test) 99.1.0"
    monkeypatch.setattr(native, "cpp_compiler", lambda: None)
    assert native.compiler_version() is None
