"""Native CPU kernels of the target and of prompt lookup, built on first use with this machine's C++
compiler.

``kernels/cpu_decode.cpp`` defines five ops (see the source's header), and ``vector_exp``, the
layer's own exp, for its tests:

- ``torch.ops.harness.streaming_linear(x, weight, bias)``: ``x @ weight.T + bias`` in float32 or
  bfloat16, each weight row streamed from memory once for every 64 rows, with every output element
  reduced in an order that does not depend on the number of rows (``model.linear_kernel=streaming``),
  or with a float32 weight packed in panels ``[N / 16, K, 16]``, each element one chain of
  multiply-adds over k, or a bfloat16 one in pairs ``[N / 16, K / 2, 16, 2]``, multiplied with AMX
  tiles where the CPU has them (``model.linear_kernel=streaming_panels``; ``pairs_on_amx()`` says
  whether the tiles are used);
- ``torch.ops.harness.llama_layer(...)``: a whole Llama decoder layer in one call, float32 or
  bfloat16, appending to preallocated cache buffers (``model.fused_layers``,
  :mod:`harness.target.fused_layers`);
- ``torch.ops.harness.llama_stack(...)``: every decoder layer in one call, what the layers compute
  one call each, bit for bit (the same option, where a forward allows it);
- ``torch.ops.harness.lookup_matches(...)``: prompt lookup's match search, the same matches in the
  same order as its Python reference (:func:`harness.proposers.prompt_lookup.find_continuations_python`);
- ``torch.ops.harness.move_slots(buffers, src, dst)``: slots of every preallocated cache buffer
  copied to others, all sources read first (a commit's accepted rows, every layer in one call).

The source is compiled for this CPU (``-march=native``, ``-ffp-contract=off``) against the installed
torch's headers (float32 products in the vector width :func:`float32_width` picks for the CPU), once
per source, flags, torch version, compiler and CPU, into
``$HARNESS_CACHE/native/`` (a finished build is moved into place atomically, so concurrent jobs
never load a half-written library), then loaded with ``torch.ops.load_library``. The ops join
torch's own OpenMP pool (the library links ``libgomp.so.1``, which torch has already loaded).

Fake (meta) implementations are registered with the decode ops, so ``torch.compile`` traces through
them as opaque calls (the match search runs outside any compiled region).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from harness.target.loading import cache_root

SOURCE = Path(__file__).with_name("kernels") / "cpu_decode.cpp"
#: compiler flags every build uses (tests add others, e.g. ``-mno-avx512f`` for the AVX2 path)
BASE_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-w")


class NativeBuildError(RuntimeError):
    """A native kernel could not be built or loaded here (the message is one line)."""


def cpp_compiler() -> str | None:
    """The C++ compiler on this machine (``$CXX`` or the usual names), or None: what the streaming
    kernel's build and ``torch.compile``'s inductor on CPU both need."""
    for name in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_fingerprint() -> str:
    """The CPU's model and feature flags (what ``-march=native`` compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(dict.fromkeys(keep))


def float32_width(cpuinfo: str | None = None) -> int:
    """The float32 products' vector width (bits) the build chooses for this CPU (``cpuinfo``: the text
    of ``/proc/cpuinfo``, read when not given): 256 on AMD family 19h (Zen 4, whose AVX-512
    instructions run as two 256-bit halves; its one-row products stream faster in 256-bit loads),
    else 512 (which only AVX-512 builds use)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return 512
    fields: dict[str, str] = {}
    for ln in cpuinfo.splitlines():
        key, _, value = ln.partition(":")
        fields.setdefault(key.strip(), value.strip())
    amd_19h = fields.get("vendor_id") == "AuthenticAMD" and fields.get("cpu family") == "25"
    return 256 if amd_19h else 512


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags (``cpuinfo``: the text of ``/proc/cpuinfo``, read when not given; no
    flags where it cannot be read)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for ln in cpuinfo.splitlines():
        if ln.startswith("flags"):
            return set(ln.split(":", 1)[-1].split())
    return set()


def cpu_has_avx512(cpuinfo: str | None = None) -> bool:
    """Whether the CPU (``cpuinfo``: the text of ``/proc/cpuinfo``, read when not given) has AVX-512F."""
    return "avx512f" in cpu_flags(cpuinfo)


def cpu_has_amx(cpuinfo: str | None = None) -> bool:
    """Whether the CPU (``cpuinfo``: the text of ``/proc/cpuinfo``, read when not given) has AMX tiles
    with bfloat16 products (``amx_tile`` and ``amx_bf16``)."""
    return {"amx_tile", "amx_bf16"} <= cpu_flags(cpuinfo)


@functools.cache
def pairs_on_amx() -> bool:
    """Whether the native kernels multiply bfloat16 weights in pairs with AMX tiles here: the CPU has
    them, the compiler built them in, and the OS granted this process their state (builds and loads
    the kernels where the CPU has AMX)."""
    if not cpu_has_amx():
        return False
    try:
        load_native_kernels()
    except NativeBuildError:
        return False
    return bool(torch.ops.harness.pairs_on_amx())


def code_paths() -> dict:
    """Which of the native kernels' code paths this machine's build takes (``-march=native`` picks them;
    each sums in its own order, so two records with other paths may differ in their last bits): the
    float32 vector width, AVX-512, bfloat16 dot products in hardware (AVX512-BF16's pairwise sums,
    else widened to float32 with fused multiply-adds), AMX tiles (bfloat16 products and attention)
    and the compiler that built them (:func:`compiler_version`)."""
    flags = cpu_flags()
    avx512 = "avx512f" in flags
    avx2 = {"avx2", "fma"} <= flags
    return {
        "float32_width": float32_width() if avx512 else 256 if avx2 else None,  # None: scalar loops
        "avx512": avx512,
        "avx512_bf16": avx512 and "avx512_bf16" in flags,
        "amx_tiles": pairs_on_amx(),
        "compiler": compiler_version(),
    }


@functools.cache
def _compiler_version(cxx: str) -> str:
    """The first line of ``cxx --version`` (``g++ (Debian 12.2.0-14) 12.2.0``), or ``""`` where it
    says nothing."""
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return (out.stdout.splitlines() or [""])[0].strip()


def compiler_version() -> str | None:
    """The version line of the compiler that builds the native kernels here (:func:`cpp_compiler`),
    or None where there is none: part of the build's key, and of what a record says ran."""
    cxx = cpp_compiler()
    return (_compiler_version(cxx) or None) if cxx else None


def build(*, namespace: str = "harness", extra_flags: tuple[str, ...] = (), out_dir: Path | None = None) -> Path:
    """The compiled library for ``namespace`` (its ops are ``torch.ops.<namespace>.*``), built
    unless a build with the same inputs exists. Raises :class:`NativeBuildError`."""
    cxx = cpp_compiler()
    if cxx is None:
        raise NativeBuildError("no C++ compiler found (install g++ or set $CXX)")
    torch_dir = Path(torch.__file__).parent
    width = (
        ()
        if any(f.startswith("-DHARNESS_F32_WIDTH=") for f in extra_flags)
        else (f"-DHARNESS_F32_WIDTH={float32_width()}",)
    )
    flags = [
        *BASE_FLAGS,
        *width,
        *extra_flags,
        f"-DHARNESS_NAMESPACE={namespace}",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
    ]
    key = hashlib.sha256(
        "\n".join([SOURCE.read_text(), *flags, torch.__version__, _compiler_version(cxx), _cpu_fingerprint()]).encode()
    ).hexdigest()[:16]
    out_dir = out_dir or cache_root() / "native"
    target = out_dir / f"cpu_decode-{namespace}-{key}.so"
    if target.exists():
        return target
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.partial")
    except OSError as exc:
        raise NativeBuildError(
            f"cannot write the native kernels into {out_dir} (the harness cache: $HARNESS_CACHE): {exc.strerror or exc}"
        ) from exc
    try:  # the partial file goes on every exit but the rename into place (a failed build, an interrupt)
        os.close(fd)
        print(f"harness: compiling the native decode kernels for this CPU ({Path(cxx).name}, once)", file=sys.stderr)
        cmd = [
            cxx,
            *flags,
            f"-I{torch_dir / 'include'}",
            str(SOURCE),
            f"-L{torch_dir / 'lib'}",
            "-lc10",
            "-ltorch_cpu",
            "-o",
            tmp,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            errors = [ln for ln in done.stderr.splitlines() if "error" in ln] or done.stderr.splitlines() or [""]
            raise NativeBuildError(f"{Path(cxx).name} could not build {SOURCE.name}: {errors[0].strip()[:200]}")
        try:
            os.replace(tmp, target)
        except OSError as exc:
            raise NativeBuildError(f"cannot write the native kernels into {out_dir}: {exc.strerror or exc}") from exc
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


@functools.cache
def load_native_kernels() -> None:
    """Build (once) and load the ``torch.ops.harness`` kernels. Raises :class:`NativeBuildError`."""
    library = build()
    try:
        torch.ops.load_library(str(library))
    except OSError as exc:
        raise NativeBuildError(f"cannot load {library.name}: {exc}") from exc
    register_fake("harness")


def register_fake(namespace: str) -> None:
    """The op's output shape and dtype without computing it (for ``torch.compile``'s tracing)."""

    @torch.library.register_fake(f"{namespace}::streaming_linear")
    def _(x, weight, bias):  # a weight in panels [N / 16, K, 16] or pairs [N / 16, K / 2, 16, 2] has N = 16 * dim 0
        return x.new_empty((*x.shape[:-1], weight.shape[0] * (16 if weight.dim() > 2 else 1)))

    @torch.library.register_fake(f"{namespace}::vector_exp")
    def _(x):
        return torch.empty_like(x)

    @torch.library.register_fake(f"{namespace}::llama_layer")
    def _(hidden, cos, sin, mask, key_buffer, value_buffer, start, weights, biases, input_eps, post_eps, scaling):
        return torch.empty_like(hidden)

    @torch.library.register_fake(f"{namespace}::llama_stack")
    def _(hidden, cos, sin, mask, keys, values, start, weights, biases, input_eps, post_eps, scaling):
        return torch.empty_like(hidden)


def native_kernels_loaded() -> bool:
    """Whether :func:`load_native_kernels` has loaded the ops in this process (it builds nothing)."""
    return load_native_kernels.cache_info().currsize > 0


def native_kernels_problem() -> str | None:
    """Why the native kernels cannot run here (one line), or None once they are loaded."""
    try:
        load_native_kernels()
    except NativeBuildError as exc:
        return str(exc)
    return None


@functools.cache
def auto_kernels_problem() -> str | None:
    """:func:`native_kernels_problem`, tried once per process for ``model.linear_kernel=auto``, which
    then runs without the native kernels where they cannot be built or loaded (a compiler that fails,
    an unwritable cache), saying why once on stderr rather than refusing a run that set nothing."""
    problem = native_kernels_problem()
    if problem is not None:
        print(f"harness: note: model.linear_kernel=auto runs without the native kernels: {problem}", file=sys.stderr)
    return problem
