"""The streaming linear kernel: the product it computes, row and thread invariance, every code path
it ships (AVX-512, AVX2, portable vectors), and the refusals when it cannot be built."""

from __future__ import annotations

import platform
import threading

import pytest
import torch
import torch.nn.functional as F

from harness.target import native, options

pytestmark = pytest.mark.skipif(
    native.streaming_linear_problem() is not None,
    reason=f"no streaming kernel here: {native.streaming_linear_problem()}",
)

# (M rows, K features, N outputs): vector-width multiples and tails on every axis, one-row steps,
# the 64-row limit and past it (at::linear), a width smaller than one vector
SHAPES = [(1, 576, 1536), (2, 64, 100), (3, 37, 13), (4, 8, 5), (5, 1536, 576), (17, 48, 7), (64, 33, 9), (65, 40, 6)]


def _check_product(op) -> None:
    g = torch.Generator().manual_seed(0)
    for m, k, n in SHAPES:
        x, w, b = (torch.randn(*s, generator=g) for s in ((m, k), (n, k), (n,)))
        for bias in (b, None):
            got = op(x, w, bias)
            assert got.shape == (m, n) and got.dtype == torch.float32
            torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-4)
            if m <= 64:  # each row alone gives the bits it gets beside the others (not F.linear's rows)
                for r in {0, m // 2, m - 1}:
                    assert torch.equal(op(x[r : r + 1], w, bias)[0], got[r]), (m, k, n, r)
    x = torch.randn(2, 3, 64, generator=g)  # leading dimensions, as a verify forward's [B, R, d]
    w = torch.randn(10, 64, generator=g)
    torch.testing.assert_close(op(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert op(x, w, None).shape == (2, 3, 10)


def test_the_kernel_computes_the_linear_product_and_each_row_independently_of_the_others():
    native.load_streaming_linear()
    _check_product(torch.ops.harness.streaming_linear)


def test_the_result_does_not_depend_on_the_number_of_threads():
    native.load_streaming_linear()
    op = torch.ops.harness.streaming_linear
    x, w = torch.randn(7, 576), torch.randn(1000, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(x, w, None)
        torch.set_num_threads(max(threads, 2))
        assert torch.equal(op(x, w, None), one)
    finally:
        torch.set_num_threads(threads)


def test_other_dtypes_fall_back_to_torch_linear():
    native.load_streaming_linear()
    x, w = torch.randn(2, 16, dtype=torch.float64), torch.randn(3, 16, dtype=torch.float64)
    assert torch.equal(torch.ops.harness.streaming_linear(x, w, None), F.linear(x, w))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="instruction-set variants of x86")
def test_every_code_path_it_ships_computes_the_same_product(tmp_path):
    """The AVX2 path (CPUs without AVX-512) and the portable one (neither AVX2 nor AVX-512, e.g.
    ARM), built here under their own op namespaces and checked as the real build is."""
    variants = {"harness_avx2": ("-mno-avx512f",), "harness_portable": ("-mno-avx512f", "-mno-avx2", "-mno-fma")}
    built, errors = {}, []

    def one(namespace, flags):
        try:
            built[namespace] = native.build(namespace=namespace, extra_flags=flags, out_dir=tmp_path)
        except native.NativeBuildError as exc:
            errors.append(str(exc))

    workers = [threading.Thread(target=one, args=item) for item in variants.items()]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not errors
    for namespace, library in built.items():
        torch.ops.load_library(str(library))
        _check_product(getattr(torch.ops, namespace).streaming_linear)


def test_a_build_that_fails_is_one_line_and_a_missing_compiler_is_named(tmp_path, monkeypatch):
    with pytest.raises(native.NativeBuildError, match=r"could not build streaming_linear.cpp: .*error") as err:
        native.build(namespace="harness_broken", extra_flags=("-DHARNESS_NAMESPACE=", "-x", "c"), out_dir=tmp_path)
    assert "\n" not in str(err.value)
    assert not list(tmp_path.iterdir())  # nothing half-written left behind
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.raises(native.NativeBuildError, match="no C\\+\\+ compiler found"):
        native.build(out_dir=tmp_path)


def test_a_build_is_reused_until_its_inputs_change(tmp_path, monkeypatch):
    import subprocess

    first = native.build(out_dir=tmp_path)
    version = subprocess.CompletedProcess(args=[], returncode=0, stdout=native._compiler_version(native.cpp_compiler()))
    calls = []
    monkeypatch.setattr(native.subprocess, "run", lambda *a, **k: calls.append(a[0]) or version)
    assert native.build(out_dir=tmp_path) == first
    assert [c[-1] for c in calls] == ["--version"]  # the compiler was asked its version, never to build
    monkeypatch.setattr(native, "_cpu_fingerprint", lambda: "another CPU")  # what -march=native builds for
    assert native.build(out_dir=tmp_path) != first
    assert calls[-1][0] == native.cpp_compiler() and "-march=native" in calls[-1]  # a new key: a build


def test_the_streaming_kernel_is_refused_in_one_line_where_it_cannot_run(monkeypatch):
    assert "float32 only" in options.linear_kernel_problem("streaming", torch.bfloat16, "cpu")
    assert "CPU kernel" in options.linear_kernel_problem("streaming", torch.float32, "cuda")
    monkeypatch.setattr(options, "streaming_linear_problem", lambda: "no C++ compiler found (install g++ or set $CXX)")
    problem = options.linear_kernel_problem("streaming", torch.float32, "cpu")
    assert problem.startswith("model.linear_kernel=streaming cannot run here: no C++ compiler found")
    assert "model.linear_kernel=weight_major" in problem and "\n" not in problem


def test_a_linear_layer_that_needs_gradients_is_computed_by_autograd():
    native.load_streaming_linear()
    layer = torch.nn.Linear(16, 4)
    options.apply_linear_kernel(layer, "streaming")
    x = torch.randn(3, 16, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    with torch.inference_mode():
        torch.testing.assert_close(layer(x.detach()), F.linear(x.detach(), layer.weight, layer.bias))
