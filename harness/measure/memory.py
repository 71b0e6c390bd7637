"""Memory peaks a record reports: the host's resident set over one job, and the device's per arm.

Host: ``getrusage`` gives the peak resident set of the whole process lifetime, which under an
in-process launcher (Hydra's basic launcher runs every job of a sweep in one process) is the
largest job so far, not this job's. :class:`JobHostMemory` measures one job: on Linux it resets the
kernel's high-water mark (``VmHWM``, by writing ``5`` to ``/proc/self/clear_refs``) when the job
starts and reads it when the job ends; where that is not possible it samples the resident set
(psutil) on a background thread, and says which method it used.

Device: :class:`DevicePeak` resets CUDA's peak counters before a stretch of work and reads the peak
allocated and reserved bytes after it (``torch.cuda.reset_peak_memory_stats``,
``max_memory_allocated``, ``max_memory_reserved``); on a CPU device it measures nothing.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int | None:
    """A ``VmXXX`` field of ``/proc/self/status`` in KiB; None off Linux."""
    try:
        text = _STATUS.read_text()
    except OSError:
        return None
    m = re.search(rf"^{field}:\s+(\d+)\s+kB", text, re.MULTILINE)
    return int(m.group(1)) if m else None


def rss_bytes() -> int:
    """The resident set of this process now."""
    return int(psutil.Process().memory_info().rss)


class JobHostMemory:
    """Peak resident set of this process between :meth:`start` and :meth:`stop`.

    ``method`` says how: ``vmhwm_reset`` (the kernel's high-water mark, reset at start: exact, no
    cost while the job runs), ``sampled`` (psutil every ``interval_s``: a peak shorter than the
    interval can be missed).
    """

    def __init__(self, *, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.method: str | None = None
        self.start_bytes: int | None = None
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._result: dict | None = None

    def start(self) -> JobHostMemory:
        self.start_bytes = rss_bytes()
        try:
            _CLEAR_REFS.write_text("5")
            hwm = _status_kib("VmHWM")
        except OSError:
            hwm = None
        if hwm is not None and hwm * 1024 <= self.start_bytes + (64 << 20):  # the reset took
            self.method = "vmhwm_reset"
            return self
        self.method = "sampled"
        self._peak = self.start_bytes
        self._thread = threading.Thread(target=self._sample, name="job-rss-sampler", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        proc = psutil.Process()
        while not self._stop.wait(self.interval_s):
            self._peak = max(self._peak, int(proc.memory_info().rss))

    def stop(self) -> dict:
        """``{"peak_rss_bytes", "rss_start_bytes", "peak_rss_method"}`` for the record (the same
        dict on a second call: the sampler, if any, has stopped)."""
        if self.method is None:
            raise RuntimeError("JobHostMemory.stop() before start()")
        if self._result is not None:
            return self._result
        if self.method == "vmhwm_reset":
            hwm = _status_kib("VmHWM")
            peak = max(hwm * 1024 if hwm is not None else 0, rss_bytes())
        else:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            peak = max(self._peak, rss_bytes())
        self._result = {
            "peak_rss_bytes": int(peak),
            "rss_start_bytes": self.start_bytes,
            "peak_rss_method": self.method,
        }
        return self._result


@dataclass
class DevicePeak:
    """Peak CUDA memory over stretches of work (a no-op where no device is CUDA).

    ``device`` is the target's; ``also`` the other devices the work runs on (a draft model on
    another GPU). ``measure()`` opens a stretch (resets the peak counters of every CUDA device among
    them); ``read()`` closes it and returns ``(peak allocated, peak reserved)`` in bytes, each the sum
    of the devices' own peaks (the memory the work needs across its GPUs), or ``(None, None)`` where
    none is CUDA.
    """

    device: torch.device
    also: tuple = ()

    @property
    def cuda_devices(self) -> list[torch.device]:
        """The CUDA devices among :attr:`device` and :attr:`also`, each once (``cuda`` read as the
        current device's index)."""
        out: list[torch.device] = []
        for d in (self.device, *self.also):
            d = torch.device(d)
            if d.type != "cuda":
                continue
            d = d if d.index is not None else torch.device("cuda", torch.cuda.current_device())
            if d not in out:
                out.append(d)
        return out

    @property
    def cuda(self) -> bool:
        return any(torch.device(d).type == "cuda" for d in (self.device, *self.also))

    def allocated_now(self) -> int | None:
        return sum(int(torch.cuda.memory_allocated(d)) for d in self.cuda_devices) if self.cuda else None

    def measure(self) -> None:
        for d in self.cuda_devices:
            torch.cuda.synchronize(d)
            torch.cuda.reset_peak_memory_stats(d)

    def read(self) -> tuple[int | None, int | None]:
        if not self.cuda:
            return None, None
        devices = self.cuda_devices
        for d in devices:
            torch.cuda.synchronize(d)
        allocated = sum(int(torch.cuda.max_memory_allocated(d)) for d in devices)
        return allocated, sum(int(torch.cuda.max_memory_reserved(d)) for d in devices)
