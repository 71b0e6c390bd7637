"""Target options and the weight-streaming floor: what a decode step must read, and how fast."""

from __future__ import annotations

import math

import torch

from harness.target.loading import build_tiny_model
from harness.target.timing import read_bandwidth_gbs, streamed_weight_bytes, weight_stream_floor_ms


def test_streamed_weight_bytes_leaves_out_an_untied_embedding_table():
    model = build_tiny_model()  # tie_word_embeddings=False
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    assert streamed_weight_bytes(model) == total - emb.numel() * emb.element_size()


def test_streamed_weight_bytes_counts_a_tied_matrix_once_as_the_lm_head():
    model = build_tiny_model()
    model.lm_head.weight = model.get_input_embeddings().weight  # tie: one matrix, read by the LM head
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() lists it once
    assert streamed_weight_bytes(model) == total
    bf16 = build_tiny_model(dtype=torch.bfloat16)
    assert streamed_weight_bytes(bf16) * 2 == streamed_weight_bytes(build_tiny_model())


def test_a_mixture_of_experts_streams_only_the_experts_a_row_is_routed_to():
    """Every expert of a Mixtral-style target was counted as read by one decode step (3.5x the bytes
    of a top-2 of 8 step here): its floors read high, its steps-vs-floor low. A routed expert counts
    by the share of experts a row uses; a shared expert (DeepSeek's) and the rest count whole."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from harness.target.timing import multiplied_weight_elements

    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    model = MixtralForCausalLM(cfg)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    rest = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    emb = model.get_input_embeddings().weight.numel()
    assert experts > rest
    assert streamed_weight_bytes(model) == (rest - emb + experts * 2 // 8) * 4
    matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and ".experts." not in n)
    assert multiplied_weight_elements(model) == matrices - emb + experts * 2 // 8


def test_floor_is_bytes_over_bandwidth():
    model = build_tiny_model()
    assert math.isclose(weight_stream_floor_ms(model, 2.0), streamed_weight_bytes(model) / 2e9 * 1e3)
    bw = read_bandwidth_gbs(nbytes=1 << 20, repeats=3)
    assert math.isfinite(bw) and bw > 0


def test_the_bandwidth_buffer_outgrows_the_last_level_cache(tmp_path, monkeypatch):
    """The default buffer is read from memory, not from a cache that holds it: twice the CPU's
    last-level cache where that exceeds 256 MB (a 300 MB L3 holds a 256 MB buffer in part)."""
    import harness.target.timing as timing
    from harness.measure.hardware import last_level_cache_bytes

    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "307200K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    (tmp_path / "index9").mkdir()  # no size file: skipped
    assert last_level_cache_bytes(str(tmp_path)) == 300 * 2**20
    assert last_level_cache_bytes(str(tmp_path / "none")) is None
    monkeypatch.setattr(timing, "last_level_cache_bytes", lambda: 300 * 2**20)
    assert timing.bandwidth_buffer_bytes() == 600 * 2**20
    assert timing.bandwidth_buffer_bytes("meta") == timing.BANDWIDTH_BUFFER_BYTES  # a GPU's L2: far smaller
    monkeypatch.setattr(timing, "last_level_cache_bytes", lambda: 32 * 2**20)
    assert timing.bandwidth_buffer_bytes() == timing.BANDWIDTH_BUFFER_BYTES
    monkeypatch.setattr(timing, "last_level_cache_bytes", lambda: None)
    assert timing.bandwidth_buffer_bytes() == timing.BANDWIDTH_BUFFER_BYTES
    read = []
    monkeypatch.setattr(timing, "bandwidth_buffer_bytes", lambda device: read.append(device) or 1 << 20)
    assert read_bandwidth_gbs(repeats=1) > 0 and read == [torch.device("cpu")]  # the default is that buffer


def test_a_bandwidth_sample_is_several_sums_off_the_cpu(monkeypatch):
    """A sample's time is divided by its sums (a GPU's single sum is as short as a launch and a
    synchronisation); a clock that moves 8 s between readings makes that visible."""
    import harness.target.timing as timing

    class Clock:
        def __init__(self, device):
            self.t = 0.0

        def now(self):
            self.t += 8.0
            return self.t

    monkeypatch.setattr(timing, "StageClock", Clock)
    one = read_bandwidth_gbs(nbytes=1 << 20, repeats=3)
    four = read_bandwidth_gbs(nbytes=1 << 20, repeats=3, sums_per_sample=4)
    assert one == pytest.approx((1 << 20) / 8.0 / 1e9) and four == pytest.approx(4 * one)
    off_cpu = read_bandwidth_gbs("meta", nbytes=1 << 20, repeats=3)  # any device but the CPU: 16 sums a sample
    assert off_cpu == pytest.approx(16 * one)


# ---------------------------------------------------------------------------------------- options

import pytest  # noqa: E402
from helpers import greedy_tokens  # noqa: E402

from harness.config import compose  # noqa: E402
from harness.contracts import Budget, ConfigError  # noqa: E402
from harness.proposers.base import NullProposer  # noqa: E402
from harness.runner import check_models  # noqa: E402
from harness.target import native, options  # noqa: E402
from harness.target.backend import CausalLMBackend  # noqa: E402

KERNELS = [k for k in options.LINEAR_KERNELS if k not in ("default", "auto")]


def _greedy(model, prompt, new=16):
    return greedy_tokens(
        CausalLMBackend(model), prompt, new, NullProposer(budget=Budget("sequence", 1, 1), manifest_hash="t")
    )


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_linear_kernel_keeps_greedy_output_and_runs_every_linear_layer(kernel):
    if options.linear_kernel_problem(kernel, torch.float32, "cpu"):
        pytest.skip(options.linear_kernel_problem(kernel, torch.float32, "cpu"))
    prompt = [3 + (5 * i) % 90 for i in range(24)]
    plain = build_tiny_model(seed=3)
    fast = build_tiny_model(seed=3)
    linears = [m for m in fast.modules() if isinstance(m, torch.nn.Linear)]
    assert options.apply_linear_kernel(fast, kernel) == len(linears) > 0
    assert options.linear_kernel_of(fast) == {kernel} and options.linear_kernel_of(plain) == {"default"}
    with torch.inference_mode():
        x = torch.randn(1, 5, plain.config.hidden_size)
        torch.testing.assert_close(fast.lm_head(x), plain.lm_head(x), rtol=1e-5, atol=1e-5)
    assert _greedy(fast, prompt) == _greedy(plain, prompt)
    assert {m._harness_kernel_fn[2].__name__ for m in linears} == {f"{kernel}_linear"}  # built when applied
    assert set(fast.state_dict()) == set(plain.state_dict())  # weights untouched, nothing added
    other = "weight_major" if kernel != "weight_major" else "mkl_packed"
    if not options.linear_kernel_problem(other, torch.float32, "cpu"):  # a second kernel replaces the first
        options.apply_linear_kernel(fast, other)
        assert {m._harness_kernel_fn[2].__name__ for m in linears} == {f"{other}_linear"}
        with torch.inference_mode():
            torch.testing.assert_close(fast.lm_head(x), plain.lm_head(x), rtol=1e-5, atol=1e-5)
    assert options.apply_linear_kernel(fast, "default") == 0  # and back to nn.Linear's own forward
    assert options.linear_kernel_of(fast) == {"default"} and all("forward" not in m.__dict__ for m in linears)


def test_a_linear_kernel_this_machine_cannot_run_is_refused_in_one_line():
    assert options.linear_kernel_problem("default", torch.bfloat16, "cuda") is None
    assert "float32 only" in options.linear_kernel_problem("mkl_packed", torch.bfloat16, "cpu")
    assert "CPU kernel" in options.linear_kernel_problem("onednn", torch.float32, "cuda")
    assert "one of" in options.linear_kernel_problem("blas", torch.float32, "cpu")
    cfg = compose(["model=tiny", "model.dtype=bfloat16", "model.linear_kernel=mkl_packed"])
    with pytest.raises(ConfigError, match=r"^model.linear_kernel=mkl_packed is float32 only") as err:
        check_models(cfg)
    assert err.value.suggestions == (("model.linear_kernel=default",),)


def test_bfloat16_pairs_without_amx_tiles_are_refused_naming_the_kernel_to_use(monkeypatch):
    monkeypatch.setattr(options, "pairs_on_amx", lambda: False)  # a CPU, compiler or OS without the tiles
    problem = options.linear_kernel_problem("streaming_panels", torch.bfloat16, "cpu")
    assert problem == (
        "model.linear_kernel=streaming_panels multiplies bfloat16 with AMX tiles, which this CPU, compiler or OS"
        " does not provide (use model.linear_kernel=streaming)"
    )
    assert "AMX" not in (options.linear_kernel_problem("streaming_panels", torch.float32, "cpu") or "")
    cfg = compose(["model=tiny", "model.dtype=bfloat16", "model.linear_kernel=streaming_panels"])
    with pytest.raises(ConfigError, match=r"^model.linear_kernel=streaming_panels multiplies bfloat16 with AMX"):
        check_models(cfg)
    monkeypatch.setattr(options, "cpp_compiler", lambda: "/usr/bin/g++")
    assert (
        options.resolve_linear_kernel("auto", torch.bfloat16, "cpu", vendor="GenuineIntel", avx512=True) == "streaming"
    )


def test_auto_runs_without_the_native_kernels_where_they_cannot_be_built_and_says_why_once(
    monkeypatch, tmp_path, capsys
):
    """``auto`` chose the streaming kernel wherever a compiler was found, so a compiler that could not
    build the kernels (or a cache it could not write) refused a run that set nothing."""
    resolve = options.resolve_linear_kernel
    monkeypatch.setattr(options, "cpp_compiler", lambda: "/usr/bin/g++")
    for module in (native, options):
        monkeypatch.setattr(module, "native_kernels_problem", lambda: "g++ could not build cpu_decode.cpp: error")
    native.auto_kernels_problem.cache_clear()
    try:
        assert resolve("auto", torch.float32, "cpu", vendor="AuthenticAMD", avx512=True) == "weight_major"
        assert resolve("auto", torch.bfloat16, "cpu", vendor="GenuineIntel", avx512=True, amx=True) == "default"
        assert options.linear_kernel_problem("auto", torch.float32, "cpu") is None
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            "harness: note: model.linear_kernel=auto runs without the native kernels: g++ could not build "
            "cpu_decode.cpp: error"
        ]
        # a kernel named explicitly is still refused where it cannot run
        assert options.linear_kernel_problem("streaming", torch.float32, "cpu").startswith(
            "model.linear_kernel=streaming cannot run here"
        )
    finally:
        native.auto_kernels_problem.cache_clear()
    # a cache the build cannot write: one line naming it, not a traceback
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(native.NativeBuildError, match=r"^cannot write the native kernels into .*\$HARNESS_CACHE"):
        native.build(namespace="harness_blocked", out_dir=blocked / "native")


def test_auto_streams_float32_and_bfloat16_on_an_x86_cpu_and_is_plain_linear_elsewhere(monkeypatch):
    resolve = options.resolve_linear_kernel
    monkeypatch.setattr(options, "cpp_compiler", lambda: "/usr/bin/g++")
    assert resolve("auto", torch.float32, "cpu", vendor="AuthenticAMD", avx512=True) == "streaming"
    assert resolve("auto", torch.float32, "cpu", vendor="AuthenticAMD", avx512=False) == "streaming_panels"
    assert resolve("auto", torch.bfloat16, "cpu", vendor="AuthenticAMD", avx512=False, amx=False) == "streaming"
    # a compiled forward: the panels' check on the weight would break the graph at every layer
    assert resolve("auto", torch.float32, "cpu", vendor="AuthenticAMD", avx512=False, compiled=True) == "streaming"
    assert native.cpu_has_avx512("vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse avx2 avx512f avx512bw\n")
    assert not native.cpu_has_avx512("flags\t\t: fpu sse avx2 fma\nbugs\t\t: avx512f_fake\n")
    bf16_panels = options.linear_kernel_problem("streaming_panels", torch.bfloat16, "cpu")
    if native.pairs_on_amx():
        assert bf16_panels is None
    else:
        assert "multiplies bfloat16 with AMX tiles, which this CPU, compiler or OS does not provide" in bf16_panels
    # an Intel CPU with AVX-512 streams both dtypes (its one-row MKL and oneDNN products trail the kernel 2x),
    # bfloat16 in pairs for AMX's tiles where it has them; without AVX-512 (not measured) it keeps F.linear
    # float32 in panels of 512-bit vectors: a one-row step as fast as the dot order, many rows cheaper
    assert resolve("auto", torch.float32, "cpu", vendor="GenuineIntel", avx512=True, amx=True) == "streaming_panels"
    assert resolve("auto", torch.float32, "cpu", vendor="GenuineIntel", avx512=True, amx=False) == "streaming_panels"
    assert resolve("auto", torch.float32, "cpu", vendor="GenuineIntel", avx512=True, compiled=True) == "streaming"
    assert resolve("auto", torch.bfloat16, "cpu", vendor="GenuineIntel", avx512=True, amx=False) == "streaming"
    assert resolve("auto", torch.bfloat16, "cpu", vendor="GenuineIntel", avx512=True, amx=True) == "streaming_panels"
    compiled = resolve("auto", torch.bfloat16, "cpu", vendor="GenuineIntel", avx512=True, amx=True, compiled=True)
    assert compiled == "streaming"
    assert resolve("auto", torch.float32, "cpu", vendor="GenuineIntel", avx512=False) == "default"
    assert resolve("auto", torch.float32, "cpu", vendor="") == "default"  # ARM, or a vendor nobody reported
    assert resolve("auto", torch.bfloat16, "cpu", vendor="AuthenticAMD", amx=False) == "streaming"
    monkeypatch.setattr(options, "cpp_compiler", lambda: None)  # no compiler: MKL's path on Intel, weight_major else
    assert resolve("auto", torch.float32, "cpu", vendor="GenuineIntel", avx512=True) == "default"
    assert resolve("auto", torch.float32, "cpu", vendor="AuthenticAMD", avx512=True) == "weight_major"
    assert resolve("auto", torch.bfloat16, "cpu", vendor="AuthenticAMD", avx512=True, amx=False) == "default"
    assert resolve("auto", torch.float16, "cpu", vendor="AuthenticAMD") == "default"
    assert resolve("auto", torch.float32, "cuda:0", vendor="AuthenticAMD") == "default"
    assert resolve("mkl_packed", torch.float32, "cpu", vendor="GenuineIntel") == "mkl_packed"  # a name is itself
    monkeypatch.setattr(options, "cpp_compiler", lambda: None)  # nothing to build the streaming kernel with
    assert resolve("auto", torch.float32, "cpu", vendor="AuthenticAMD") == "weight_major"
    assert (
        resolve("auto", torch.bfloat16, "cpu", vendor="AuthenticAMD", amx=False) == "default"
    )  # not measured in bfloat16
    assert options.linear_kernel_problem("auto", torch.bfloat16, "cuda") is None
    assert options.linear_kernel_problem("weight_major", torch.bfloat16, "cuda") is None
    monkeypatch.undo()
    streams = native.cpp_compiler() is not None
    fp32_streaming = "streaming" if native.cpu_has_avx512() else "streaming_panels"
    for vendor, kernel in (
        ("AuthenticAMD", fp32_streaming if streams else "weight_major"),
        ("GenuineIntel", ("streaming_panels" if native.cpu_has_avx512() else "default") if streams else "default"),
    ):
        monkeypatch.setattr(options, "cpu_vendor", lambda v=vendor: v)  # this machine's vendor, as auto reads it
        assert resolve("auto", torch.float32, "cpu") == kernel
        fp32, bf16 = build_tiny_model(seed=3), build_tiny_model(seed=3, dtype=torch.bfloat16)
        options.apply_linear_kernel(fp32, "auto")
        options.apply_linear_kernel(bf16, "auto")
        bf16_streaming = "streaming_panels" if native.pairs_on_amx() else "streaming"
        bf16_kernel = bf16_streaming if kernel in options.STREAMING_KERNELS else "default"
        assert options.linear_kernel_of(fp32) == {kernel} and options.linear_kernel_of(bf16) == {bf16_kernel}
    assert compose(["model=tiny"]).model.linear_kernel == "auto"  # the configured default


def test_cpu_vendor_is_read_from_the_machine():
    from harness.measure.hardware import cpu_vendor, hardware_card

    vendor = cpu_vendor()
    assert isinstance(vendor, str) and vendor == vendor.strip()
    card = hardware_card("cpu")
    assert card["cpu_vendor"] == vendor and card["cpu_capability"]
    assert card["last_level_cache_bytes"] is None or card["last_level_cache_bytes"] > 0


def test_weight_major_computes_the_linear_product_with_bias_and_leading_dims():
    layer = torch.nn.Linear(16, 40, bias=True)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(2, 3, 16)
    with torch.inference_mode():
        expected = layer(x)
        options.apply_linear_kernel(layer, "weight_major")
        got = layer(x)
    assert got.shape == (2, 3, 40)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_compile_without_a_cpp_compiler_is_refused(monkeypatch):
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    cfg = compose(["model=tiny", "model.compile=true"])
    with pytest.raises(ConfigError, match=r"model.compile=true needs a C\+\+ compiler"):
        check_models(cfg)
    assert options.compile_problem("cuda") is None


def test_the_manifest_records_the_target_options():
    from harness.manifest import job_manifest

    plain = job_manifest(compose(["model=tiny"]), versions={})
    fast = job_manifest(compose(["model=tiny", "model.linear_kernel=onednn", "model.compile=true"]), versions={})
    assert plain["target"]["linear_kernel"] == "auto" and plain["target"]["compile"] is False
    assert plain["backend"]["linear_kernel"] == options.resolve_linear_kernel("auto", torch.float32, "cpu")
    bf16 = job_manifest(compose(["model=tiny", "model.dtype=bfloat16"]), versions={})
    assert bf16["backend"]["linear_kernel"] == options.resolve_linear_kernel("auto", torch.bfloat16, "cpu")
    half = job_manifest(compose(["model=tiny", "model.dtype=float16"]), versions={})
    assert half["backend"]["linear_kernel"] == "default" and half["backend"]["fused_layers"] is False
    assert fast["target"]["linear_kernel"] == "onednn" and fast["target"]["compile"] is True
    assert fast["backend"]["linear_kernel"] == "onednn" and fast["backend"]["compile"] is True
    dynamic = job_manifest(compose(["model=tiny", "model.static_cache=false"]), versions={})
    assert plain["backend"]["static_cache"] is True and dynamic["backend"]["static_cache"] is False
    assert fast["backend"]["static_cache"] is False  # compiled: the concatenating cache unless asked
    both = job_manifest(compose(["model=tiny", "model.compile=true", "model.static_cache=true"]), versions={})
    assert both["backend"]["static_cache"] is True
    assert [options.resolve_static_cache(v, c) for v in (None, True, False) for c in (False, True)] == [
        True,
        False,
        True,
        True,
        False,
        False,
    ]


def test_both_arms_of_a_run_use_the_configured_linear_kernel(tmp_path, monkeypatch):
    """The runner applies the kernel to the one target both arms verify with, and records it."""
    if options.linear_kernel_problem("onednn", torch.float32, "cpu"):
        pytest.skip(options.linear_kernel_problem("onednn", torch.float32, "cpu"))
    import harness.runner as runner

    seen = []

    class Recording(runner.Arms):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(options.linear_kernel_of(kwargs["target"].model))

    monkeypatch.setattr(runner, "Arms", Recording)
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    cfg = compose(
        ["model=tiny", "model.linear_kernel=onednn", "proposer=prompt_lookup", "workload.limit=1"]
        + ["generation.max_new_tokens=12", "gates.oracle=false"]
    )
    record = runner.run_job(cfg, run_dir=tmp_path / "run")
    assert seen == [{"onednn"}]  # one Arms, one target: the speculative and the AR arm share it
    assert record["manifest"]["target"]["linear_kernel"] == "onednn"
    assert record["metrics"]["greedy_identical"] is True
    assert record["gates"]["equivalence"]["status"] == "passed"
    assert "compile" not in record["load_report"]  # nothing compiled: no compile figures


@pytest.mark.slow  # torch.compile builds C++ kernels: a minute or more on a 2-core machine
def test_a_compiled_run_records_what_torch_compile_did_and_stays_compiled(tmp_path, monkeypatch, capsys):
    """The default recompile limit (8) was reached in the warm-up, so most of the run's forwards ran
    eagerly while the manifest said compiled; the record now counts graphs, graph breaks and the
    functions that hit a limit."""
    import harness.runner as runner

    if options.compile_problem("cpu"):
        pytest.skip(options.compile_problem("cpu"))
    torch._dynamo.reset()
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    cfg = compose(
        ["model=tiny", "model.compile=true", "proposer=prompt_lookup", "workload.limit=2"]
        + ["generation.max_new_tokens=16", "gates.oracle=false"]
    )
    record = runner.run_job(cfg, run_dir=tmp_path / "run")
    report = record["load_report"]["compile"]
    assert report["graphs"] >= 1 and report["graph_breaks"] == 0 and report["recompile_limit_hits"] == []
    assert record["metrics"]["greedy_identical"] is True
    assert "recompile limit" not in capsys.readouterr().err


@pytest.mark.slow  # torch.compile builds C++ kernels: minutes on a 2-core machine
def test_a_compiled_target_keeps_greedy_output_tree_equivalence_and_its_graphs():
    from harness.gates.equivalence import equivalence_gate
    from harness.target.timing import timing_tree

    if options.compile_problem("cpu"):
        pytest.skip(options.compile_problem("cpu"))
    torch._dynamo.reset()
    prompt = [3 + (5 * i) % 90 for i in range(24)]
    plain = build_tiny_model(seed=4)
    compiled = options.compile_model(build_tiny_model(seed=4))
    assert _greedy(compiled, prompt) == _greedy(plain, prompt)  # causal path, one row per round
    assert equivalence_gate(CausalLMBackend(compiled), prompt)["status"] == "passed"  # the masked path
    # varying row counts and cache lengths reuse the graphs compiled so far (dynamic shapes)
    backend = CausalLMBackend(compiled)
    state = backend.prefill([prompt])
    for rows, shape in [(3, "chain"), (5, "heap"), (2, "heap"), (6, "chain")]:
        backend.verify_one(state, prompt[-1], timing_tree(rows, prefix_len=state.cache_len + 1, vocab=96, shape=shape))
        backend.commit_one(state, [0])
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for rows, shape in [(7, "chain"), (4, "heap"), (9, "heap"), (5, "chain"), (11, "heap")]:
        backend.verify_one(state, prompt[-1], timing_tree(rows, prefix_len=state.cache_len + 1, vocab=96, shape=shape))
        backend.commit_one(state, [0])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_the_kernel_comparison_script_times_each_kernel_on_one_model(tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "kernel_ab.py"
    spec = importlib.util.spec_from_file_location("kernel_ab", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = ["--model", "tiny", "--rounds", "2", "--repeats", "1", "--ns", "1", "3", "--prefix-len", "8"]
    args += ["--decode-tokens", "3"]
    variants = ["default", "weight_major", "default+dynamic"]
    assert script.main(args + ["--kernels", *variants, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "kernel_ab.json").read_text())
    assert result["kernels"] == {
        "default": ["default"],
        "weight_major": ["weight_major"],
        "default+dynamic": ["default"],
    }
    assert result["static_cache"] == {"default": True, "weight_major": True, "default+dynamic": False}
    for kernel in variants:
        for shape in ("chain", "heap"):
            samples = result["t_samples_ms"][kernel][shape]
            assert sorted(samples) == ["1", "3"] and all(len(v) == 2 and min(v) > 0 for v in samples.values())
    for kernel in variants:  # the round loop's decode too, once per round
        assert len(result["decode_ms_per_token_samples"][kernel]) == 2 and result["decode_ms_per_token"][kernel] > 0
    text = (tmp_path / "kernel_ab.md").read_text()
    assert "| weight_major | heap |" in text and "| default+dynamic | " in text and "ms / token" in text


def test_the_floor_script_splits_the_autoregressive_step_into_its_parts(tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "ar_floor.py"
    spec = importlib.util.spec_from_file_location("ar_floor", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = ["--model", "tiny", "--rounds", "2", "--repeats", "2", "--prefix-len", "8", "--out", str(tmp_path)]
    assert script.main(args) == 0
    result = json.loads((tmp_path / "ar_floor.json").read_text())
    assert len(result["samples"]["step"]) == 4 and len(result["samples"]["products"]) == 2
    assert result["ar_step_ms"] > 0 and result["products_ms"] > 0 and result["skeleton_step_ms"] > 0
    assert result["weight_stream_floor_ms"] == pytest.approx(
        result["streamed_weight_bytes"] / (result["read_bandwidth_gbs"] * 1e9) * 1e3
    )
    assert result["ar_step_vs_floor"] == pytest.approx(result["ar_step_ms"] / result["weight_stream_floor_ms"])
    assert result["rest_ms"] == pytest.approx(result["ar_step_ms"] - result["products_ms"] - result["skeleton_step_ms"])
    skeleton = script.skeleton_of(build_tiny_model())
    assert skeleton.config.num_hidden_layers == build_tiny_model().config.num_hidden_layers  # every layer kept
    assert skeleton.config.hidden_size == 64
    assert "| autoregressive step t(1) |" in (tmp_path / "ar_floor.md").read_text()


def test_weights_in_panels_trace_under_torch_compile_and_follow_the_weight():
    if options.linear_kernel_problem("streaming_panels", torch.float32, "cpu"):
        pytest.skip(options.linear_kernel_problem("streaming_panels", torch.float32, "cpu"))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # the op's shape for torch.compile's tracing: N = 16 x the panels' first dim
        assert torch.ops.harness.streaming_linear(torch.empty(2, 8), torch.empty(2, 8, 16), None).shape == (2, 32)
    layer = torch.nn.Linear(32, 48)
    options.apply_linear_kernel(layer, "streaming_panels")
    compiled = torch.compile(layer, backend="eager", dynamic=True)
    x = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(
            compiled(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5
        )
        layer.weight.mul_(2)  # the panels are made again for the changed weight
        torch.testing.assert_close(
            compiled(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5
        )
    options.apply_linear_kernel(layer, "default")  # another kernel drops the panels kept on the weight
    assert "_harness_panels" not in layer.weight.__dict__


def test_cudnn_attention_is_forbidden_on_cuda_unless_asked_and_refused_off_cuda():
    resolve = options.resolve_cudnn_attention
    assert resolve(None, "cpu") is None and resolve(False, "cpu") is None  # no such kernel off CUDA
    assert resolve(None, "cuda") is False and resolve(None, "cuda:1") is False and resolve(True, "cuda") is True
    assert options.cudnn_attention_problem(True, "cuda:0") is None
    assert (
        options.cudnn_attention_problem(False, "cpu") is None and options.cudnn_attention_problem(None, "cpu") is None
    )
    with pytest.raises(
        ConfigError, match=r"^model.cudnn_attention=true applies to a CUDA device only; model.device=cpu$"
    ) as err:
        check_models(compose(["model=tiny", "model.cudnn_attention=true"]))
    assert err.value.suggestions == (("model.cudnn_attention=null",),)
    # the target and its draft share PyTorch's one process-wide switch: different values are refused
    draft = ["proposer=draft_model", "proposer.model.name=tiny", "proposer.model.device=cuda"]
    apart = [
        "model=tiny",
        "model.device=cuda",
        "model.cudnn_attention=true",
        *draft,
        "proposer.model.cudnn_attention=false",
    ]
    with pytest.raises(ConfigError, match=r"^model.cudnn_attention=true and proposer.model.cudnn_attention=false: "):
        check_models(compose(apart))
    check_models(compose(["model=tiny", "model.device=cuda", *draft]))  # both unset: both forbid it
    check_models(compose(["model=tiny", "model.device=cuda", "model.cudnn_attention=true", *draft]))  # it follows
    check_models(compose(["model=tiny", "model.cudnn_attention=false", *draft[:2]]))  # both on CPU


def test_the_cudnn_switch_is_torchs_process_wide_flag_and_none_leaves_it():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        options.apply_cudnn_attention(False)
        assert torch.backends.cuda.cudnn_sdp_enabled() is False
        options.apply_cudnn_attention(None)
        assert torch.backends.cuda.cudnn_sdp_enabled() is False
        options.apply_cudnn_attention(True)
        assert torch.backends.cuda.cudnn_sdp_enabled() is True
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_the_manifest_records_whether_attention_may_use_cudnn():
    from harness.manifest import job_manifest

    assert job_manifest(compose(["model=tiny"]), versions={})["backend"]["cudnn_attention"] is None
    cuda = job_manifest(compose(["model=tiny", "model.device=cuda"]), versions={})
    assert cuda["backend"]["cudnn_attention"] is False and cuda["backend"]["dtype"] == "bfloat16"
    asked = job_manifest(compose(["model=tiny", "model.device=cuda", "model.cudnn_attention=true"]), versions={})
    assert asked["backend"]["cudnn_attention"] is True


def test_the_runner_forbids_cudnn_attention_when_it_applies_a_cuda_targets_options():
    from harness.runner import apply_model_options
    from harness.target.loading import LoadedModel

    before = torch.backends.cuda.cudnn_sdp_enabled()
    loaded = LoadedModel(model=build_tiny_model(), tokenizer=None, name="tiny", source="random-init", load_report={})
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        apply_model_options(loaded, compose(["model=tiny"]).model)  # on CPU the switch is left alone
        assert torch.backends.cuda.cudnn_sdp_enabled() is True
        apply_model_options(loaded, compose(["model=tiny", "model.device=cuda"]).model)
        assert torch.backends.cuda.cudnn_sdp_enabled() is False
        apply_model_options(loaded, compose(["model=tiny", "model.device=cuda", "model.cudnn_attention=true"]).model)
        assert torch.backends.cuda.cudnn_sdp_enabled() is True
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_fused_layers_are_claimed_only_where_they_run(monkeypatch):
    """Fused layers compute SDPA attention natively: with eager attention none runs fused, so auto
    resolves to off (the manifest said on) and an explicit true is refused before model work; a
    model whose layers cannot run natively refuses an explicit true at load (it was ignored)."""
    from harness import runner
    from harness.manifest import job_manifest
    from harness.target import fused_layers
    from harness.target.loading import CheckpointError, load_model

    eager = compose(["model=tiny", "model.attn_implementation=eager"])
    assert job_manifest(eager)["backend"]["fused_layers"] is False
    with pytest.raises(
        ConfigError, match=r"fused_layers=true computes SDPA attention natively .* model.attn_implementation=eager"
    ):
        check_models(compose(["model=tiny", "model.attn_implementation=eager", "model.fused_layers=true"]))
    if native.native_kernels_problem() is not None:
        pytest.skip("no native kernels here")
    m = compose(["model=tiny", "model.fused_layers=true"]).model
    monkeypatch.setattr(fused_layers, "fusable", lambda layer: "q/k normalisation")
    monkeypatch.setattr(runner, "fusable", lambda layer: "q/k normalisation")
    with pytest.raises(CheckpointError, match=r"fused_layers=true, but 0 of 2 decoder layers .*\(q/k normalisation\)"):
        runner.apply_model_options(load_model(name="tiny"), m)


def test_the_tiny_model_applies_its_attention_option_and_refuses_a_checkpoint_path():
    from harness.target.loading import CheckpointError, load_model

    assert load_model(name="tiny", attn_implementation="eager").model.config._attn_implementation == "eager"
    with pytest.raises(CheckpointError, match=r"attn_implementation='bogus': .*not supported"):
        load_model(name="tiny", attn_implementation="bogus")
    from harness.engine.checks import validate_config

    with pytest.raises(ConfigError, match=r"model.name_or_path=/some/ckpt does not apply to model.name=tiny"):
        validate_config(compose(["model=tiny", "model.name_or_path=/some/ckpt"]))


def test_a_draft_option_refusal_names_the_draft_s_options_and_train_refuses_as_run_does(capsys):
    """A refusal for the draft names every option at the draft's key (it named the target's dtype
    for the draft's); `harness train` refuses an option this machine cannot run before loading the
    target, as `harness run` does (it loaded the model, then failed or trained regardless)."""
    from harness import cli

    with pytest.raises(ConfigError) as err:
        check_models(
            compose(
                [
                    "model=tiny",
                    "proposer=draft_model",
                    "proposer.model.name=tiny",
                    "proposer.model.dtype=bfloat16",
                    "proposer.model.linear_kernel=mkl_packed",
                ]
            )
        )
    assert str(err.value).startswith(
        "proposer.model.linear_kernel=mkl_packed is float32 only; proposer.model.dtype is bfloat16"
    )
    assert cli.main(["train", "proposer=medusa", "model=tiny", "model.fused_layers=true", "model.dtype=float16"]) == 2
    err_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert err_line.startswith("harness train: refused: model.fused_layers=true computes float32 and bfloat16")


def test_the_compile_watch_names_a_function_that_reached_the_recompile_limit():
    """Past dynamo's recompile limit a function runs eagerly; the watch reports it by name, and a
    function that stays under the limit is not reported."""
    import torch._dynamo

    def scale(x):
        return x * 2

    compiled = torch.compile(scale, backend="eager")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2):
        watch = options.CompileWatch().start()
        compiled(torch.ones(3))  # one guard set
        under = watch.stop()
        watch = options.CompileWatch().start()
        for dtype in (torch.float64, torch.int32, torch.int64):  # a guard set each: the third is past 2
            compiled(torch.ones(3, dtype=dtype))
        over = watch.stop()
    assert under["recompile_limit_hits"] == [] and under["graphs"] == 1 and under["graph_breaks"] == 0
    assert len(over["recompile_limit_hits"]) == 1 and "'scale'" in over["recompile_limit_hits"][0]
    assert over["recompile_limit_hits"][0].endswith("recompile_limit=2")
    compiled(torch.ones(3, dtype=torch.float16))  # a stopped watch no longer listens
    assert len(watch.limit_hits) == 1


@pytest.mark.parametrize("kernel", ["streaming", "weight_major", "onednn"])
def test_a_linear_kernel_is_built_before_the_first_call_so_a_compiled_forward_has_no_graph_break(kernel):
    """Building a layer's kernel inside a traced forward (the native library's file checks) broke the
    graph at every layer, and each layer's call then became a frame of its own until dynamo's
    recompile limit sent the rest to eager."""
    import torch._dynamo

    if options.linear_kernel_problem(kernel, torch.float32, "cpu"):
        pytest.skip(options.linear_kernel_problem(kernel, torch.float32, "cpu"))
    model = build_tiny_model(seed=5)
    options.apply_linear_kernel(model, kernel, compiled=True)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.__dict__.get("_harness_kernel_fn") is not None for m in linears)
    torch._dynamo.reset()
    ids = torch.tensor([[3 + (5 * i) % 90 for i in range(12)]])
    expected = build_tiny_model(seed=5)(ids).logits
    watch = options.CompileWatch().start()
    with torch.inference_mode():
        got = torch.compile(model, backend="eager", dynamic=True)(ids).logits
    report = watch.stop()
    assert report["graph_breaks"] == 0 and report["recompile_limit_hits"] == [] and report["graphs"] >= 1
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("draft", ["derived", "tiny"])
def test_a_draft_model_runs_the_forward_options_of_the_target_unless_set_apart(draft):
    """A draft's linear kernel, cache layout, fused layers, compile and cuDNN switch follow the
    target's, so both arms' forwards run alike: ``model.linear_kernel=default model.static_cache=false``
    reaches the draft too (it kept the streaming kernel and preallocated caches before); a draft's
    own override changes the draft only, and remote code stays each checkpoint's own opt-in."""
    from harness.runner import load_models
    from harness.target.fused_layers import fused_layers_of
    from harness.target.options import linear_kernel_of, static_cache_of

    base = ["model=tiny", "proposer=draft_model", f"proposer.model.name={draft}"]
    if draft == "derived":
        base.append("proposer.model.num_layers=1")
    cfg = compose([*base, "model.linear_kernel=default", "model.static_cache=false", "model.trust_remote_code=true"])
    d = cfg.proposer.model
    assert (d.linear_kernel, d.static_cache, d.fused_layers, d.compile) == ("default", False, None, False)
    assert d.trust_remote_code is False
    target, loaded = load_models(cfg)
    for model in (target.model, loaded.model):
        assert linear_kernel_of(model) == {"default"} and static_cache_of(model) is False
        assert fused_layers_of(model) == 0
    own = compose([*base, "model.static_cache=false", "proposer.model.static_cache=true"])
    assert (own.model.static_cache, own.proposer.model.static_cache) == (False, True)
    merged = compose(["model=tiny", "proposer=merged", "proposer.sources=[draft_model,rest]", "model.compile=true"])
    assert merged.proposer.draft_model.model.compile is True
    # a draft on another kind of device keeps its own defaults: a CUDA target's switches say nothing of a CPU forward
    cuda = ["model.device=cuda", "model.cudnn_attention=true", "model.compile=true", "proposer.model.device=cpu"]
    apart = compose([*base, *cuda]).proposer.model
    assert (apart.cudnn_attention, apart.compile, apart.linear_kernel) == (None, False, "auto")
    check_models(compose([*base, *cuda]))  # it was refused: proposer.model.cudnn_attention=true off CUDA


def test_a_draft_that_follows_the_target_s_cudnn_switch_is_not_noted_twice():
    from harness.runner import inert_options

    notes = inert_options(compose(["model=tiny", "proposer=draft_model", "model.cudnn_attention=false"]))
    assert notes == ["model.cudnn_attention=false: cuDNN attention is a CUDA kernel"]
    own = inert_options(compose(["model=tiny", "proposer=draft_model", "proposer.model.cudnn_attention=true"]))
    assert own == ["proposer.model.cudnn_attention=true: cuDNN attention is a CUDA kernel"]


def test_the_manifest_claims_fused_layers_only_for_an_architecture_that_fuses(tmp_path):
    """Unset, ``fused_layers`` resolved from dtype, device and kernel alone, so a Qwen2 checkpoint's
    manifest said ``fused_layers: true`` while no layer ran fused (its load report said 0): two records
    of one computation hashed apart. The architecture is read from the config now; a Llama checkpoint
    still fuses, and the load report agrees with the manifest."""
    from checkpoint_fixtures import byte_tokenizer, tiny_checkpoint
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from harness.manifest import job_manifest
    from harness.runner import load_models

    torch.manual_seed(0)
    qwen = tmp_path / "qwen2"
    small = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    Qwen2ForCausalLM(Qwen2Config(**small, num_key_value_heads=2)).save_pretrained(qwen)
    byte_tokenizer().save_pretrained(qwen)
    llama = tiny_checkpoint(tmp_path / "llama")
    for path, fuses in ((qwen, False), (llama, True)):
        # the streaming kernel named: `auto` resolves to it on this CPU's vendor only
        cfg = compose(["model=hf", f"model.name_or_path={path}", "model.linear_kernel=streaming"])
        claimed = job_manifest(cfg, versions={})["backend"]["fused_layers"]
        if native.native_kernels_problem() is not None:
            assert claimed is False
            continue
        assert claimed is fuses
        target, _ = load_models(cfg)
        assert (target.load_report["fused_layers"] > 0) is fuses


@pytest.mark.parametrize("setting", [{"hidden_act": "gelu"}, {"pretraining_tp": 2}])
def test_the_manifest_claims_fused_layers_only_for_a_llama_config_the_native_layer_computes(tmp_path, setting):
    """A Llama checkpoint whose config the native layer does not compute (another activation,
    tensor-parallel slicing) fuses no layer: its manifest says so, as its load report does."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from harness.manifest import job_manifest
    from harness.target.fused_layers import apply_fused_layers

    small = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    config = LlamaConfig(**small, num_key_value_heads=2, **setting)
    config.save_pretrained(tmp_path)
    cfg = compose(["model=hf", f"model.name_or_path={tmp_path}", "model.linear_kernel=streaming"])
    assert job_manifest(cfg, versions={})["backend"]["fused_layers"] is False
    if native.native_kernels_problem() is None:  # the layers agree: none fuses
        assert apply_fused_layers(LlamaForCausalLM(config), True) == 0


def test_a_forward_multiplies_every_matrix_once_and_gathers_from_an_untied_embedding_table():
    from harness.target.timing import multiplied_weight_elements

    model = build_tiny_model()  # untied: the embedding table is gathered from, the LM head multiplied
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    emb = model.get_input_embeddings().weight
    assert multiplied_weight_elements(model) == matrices - emb.numel()
    model.lm_head.weight = emb  # tied: the one matrix is the LM head's, counted once
    assert multiplied_weight_elements(model) == sum(p.numel() for p in model.parameters() if p.dim() == 2)


def test_a_verify_forwards_least_arithmetic_is_its_products_and_attention_over_the_keys_each_row_reads():
    from harness.target.timing import multiplied_weight_elements, verify_flops

    model = build_tiny_model()
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    one = 2 * multiplied_weight_elements(model) + 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * 9
    assert verify_flops(model, 1, prefix_len=8) == one
    assert verify_flops(model, 5, prefix_len=8) == 5 * one
    assert verify_flops(model, 1, prefix_len=100) > one  # a longer prefix: more keys to read


def test_the_matrix_product_rate_is_measured_in_the_dtype_asked_for(monkeypatch):
    import pytest

    import harness.target.timing as timing

    seen = []
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: seen.append((a.dtype, a.shape)) or real(a, b))
    rate = timing.matmul_peak_gflops("cpu", torch.bfloat16, size=64, repeats=3)
    assert math.isfinite(rate) and rate > 0
    assert seen == [(torch.bfloat16, (64, 64))] * 4  # one untimed product, then the timed ones
    with pytest.raises(ValueError, match="size >= 1"):
        timing.matmul_peak_gflops("cpu", size=0)
    peak = timing.matmul_peak("cpu", torch.float32, size=48, repeats=1)  # the rate with the side that gave it
    assert peak["size"] == 48 and peak["gflops"] > 0


def test_the_roofline_floor_is_the_larger_of_reading_the_weights_and_the_arithmetic():
    import pytest

    from harness.target.timing import verify_flops, verify_roofline, weight_stream_floor_ms

    model = build_tiny_model()
    stream = weight_stream_floor_ms(model, 2.0)
    peak = verify_flops(model, 1, prefix_len=16) / (stream / 9.5 * 1e-3) / 1e9  # a row's arithmetic: stream / 9.5
    per_row = stream / 9.5
    crossing = 10
    rows = [1, crossing - 1, crossing, 2 * crossing]
    t = {n: 3.0 * n for n in rows}
    roof = verify_roofline(model, t, prefix_len=16, bandwidth_gbs=2.0, peak_gflops=peak)
    assert roof["rows"] == rows and roof["weight_stream_floor_ms"] == pytest.approx(stream)
    assert roof["compute_bound_from"] == crossing
    assert roof["floor_ms"][:2] == [pytest.approx(stream)] * 2  # reading the weights bounds few rows
    assert roof["floor_ms"][2] == pytest.approx(crossing * per_row) and crossing * per_row > stream  # the arithmetic
    assert roof["floor_ms"][3] == pytest.approx(2 * crossing * per_row)
    assert roof["t_vs_floor"] == [pytest.approx(t[n] / f) for n, f in zip(rows, roof["floor_ms"], strict=True)]
    with pytest.raises(ValueError, match="positive"):
        verify_roofline(model, t, prefix_len=16, bandwidth_gbs=0.0, peak_gflops=1.0)


def test_a_runs_profile_gets_each_points_floor_in_its_own_order_at_its_batch_size():
    import pytest

    from harness.target.timing import profile_roofline, verify_roofline

    model = build_tiny_model()
    profile = {"n": [4, 1, 2], "t": [3.0, 1.0, 2.0], "batch_size": 2, "prefix_len": 16}
    got = profile_roofline(model, profile, bandwidth_gbs=2.0, peak_gflops=0.5, peak_size=512)
    roof = verify_roofline(
        model, {1: 1.0, 2: 2.0, 4: 3.0}, prefix_len=16, bandwidth_gbs=2.0, peak_gflops=0.5, batch_size=2
    )
    assert got["n"] == [4, 1, 2] and got["t"] == [3.0, 1.0, 2.0]  # the profile as it was
    assert got["floor_ms"] == [roof["floor_ms"][2], roof["floor_ms"][0], roof["floor_ms"][1]]
    assert got["t_vs_floor"] == [pytest.approx(t / f) for t, f in zip(got["t"], got["floor_ms"], strict=True)]
    assert got["roofline"]["batch_size"] == 2 and got["roofline"]["prefix_len"] == 16
    assert got["roofline"]["matmul_peak_size"] == 512  # which product measured the rate
    one = verify_roofline(model, {4: 3.0}, prefix_len=16, bandwidth_gbs=2.0, peak_gflops=0.5)
    assert roof["compute_floor_ms"][2] == pytest.approx(2 * one["compute_floor_ms"][0])  # two requests' rows
    bare = profile_roofline(model, {"n": [1], "t": [1.0]}, bandwidth_gbs=2.0, peak_gflops=0.5)  # no batch, no prefix
    assert bare["roofline"]["batch_size"] == 1 and bare["roofline"]["prefix_len"] == 0
    assert bare["roofline"]["matmul_peak_size"] is None


def test_the_product_behind_the_arithmetic_floor_fits_a_quarter_of_a_gpus_free_memory():
    import pytest

    from harness.target.timing import PEAK_MATMUL_SIZE, peak_matmul_size

    assert peak_matmul_size("cpu", 4) == PEAK_MATMUL_SIZE["cpu"]
    assert peak_matmul_size("cuda", 2, 80 * 2**30) == PEAK_MATMUL_SIZE["cuda"]  # room to spare
    n = peak_matmul_size("cuda", 4, 64 * 2**20)  # 64 MiB free: three fp32 matrices in 16 MiB
    assert n % 256 == 0 and 3 * n * n * 4 <= 16 * 2**20 < 3 * (n + 256) ** 2 * 4
    with pytest.raises(ValueError, match="too little"):
        peak_matmul_size("cuda", 4, 2**20)


def test_a_cuda_forward_s_setup_says_whether_cudnn_attention_may_run(monkeypatch):
    """cuDNN's SDPA kernel (a process-wide switch) changes a CUDA decode step's time several times
    over, but a vector chosen by timing was keyed without it: one searched with it on was reused
    with it off. On CUDA the forward's setup names it; a CPU forward's setup is unchanged."""
    import types

    from harness.target.loading import build_tiny_model
    from harness.target.timing import forward_setup

    model = build_tiny_model(seed=1, num_layers=1)
    assert "cudnn_attention" not in forward_setup(model)
    fake = types.SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr(type(model), "parameters", lambda self, recurse=True: iter([fake]))
    for allowed in (True, False):
        monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda allowed=allowed: allowed)
        assert forward_setup(model)["cudnn_attention"] is allowed
