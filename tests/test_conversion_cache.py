"""The converted copy of the embedded SmolLM2 is bound to the GGUF file's bytes: a package release
with other weights of the same size gets a copy of its own, converted from its own file, and a copy
already made is found again without converting or re-reading the GGUF file."""

from __future__ import annotations

import json

import harness.files as files
import harness.target.loading as loading


def test_a_gguf_release_with_other_weights_of_the_same_size_is_converted_again(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    gguf = pkg / loading.SMOLLM2_GGUF
    monkeypatch.setattr(loading, "smollm2_package_dir", lambda: pkg)
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    converted: list[tuple[str, str]] = []

    def convert(source, out):
        out.mkdir(parents=True)
        sha = files.file_sha256(source)
        (out / "harness_conversion.json").write_text(json.dumps({"gguf_sha256": sha}))
        converted.append((out.name, sha))

    monkeypatch.setattr(loading, "_convert_smollm2", convert)
    gguf.write_bytes(b"GGUF" + b"A" * 996)  # one release
    first = loading.smollm2_converted_dir()
    sha_first = files.file_sha256(gguf)
    gguf.write_bytes(b"GGUF" + b"B" * 996)  # the next release: other weights, the same size
    second = loading.smollm2_converted_dir()
    sha_second = files.file_sha256(gguf)
    assert sha_second != sha_first and second != first
    assert converted == [(first.name, sha_first), (second.name, sha_second)]
    marker = json.loads((second / "harness_conversion.json").read_text())
    assert marker["gguf_sha256"] == sha_second  # the copy in use is the current file's
    assert (first / "harness_conversion.json").is_file()  # the earlier release's copy is left as it was

    hits = files._sha256.cache_info().hits
    assert loading.smollm2_converted_dir() == second and len(converted) == 2  # found again, not converted
    assert files._sha256.cache_info().hits > hits  # and the GGUF file was not read again
