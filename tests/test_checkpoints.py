"""Whole checkpoints by path: a draft given by path loads every layer, the derived draft is a named
choice, missing weights are refused by key name and unexpected ones shown, tokenizers are compared
by content before any weights are read, padded vocabularies propose inside the shared range, the
draft follows its own dtype and attention settings, and a draft identical to the target accepts
every candidate at every depth (T = 0 greedy; T = 0.7 rejection and SpecInfer)."""

from __future__ import annotations

import logging

import pytest
import torch
from checkpoint_fixtures import BYTE_VOCAB, byte_tokenizer, prompts_file, tiny_checkpoint

from harness.config import compose
from harness.target.loading import CheckpointError, tokenizer_difference

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown",
]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {
        "target": tiny_checkpoint(root / "target", num_layers=4),
        "padded": tiny_checkpoint(root / "padded", num_layers=4, pad_to=2 * BYTE_VOCAB + 2),
        "other": tiny_checkpoint(root / "other", seed=3, num_layers=3),
        "renamed": tiny_checkpoint(root / "renamed", seed=3, tokenizer=byte_tokenizer(rename={100: "<odd>"})),
        "lower": tiny_checkpoint(root / "lower", seed=3, tokenizer=byte_tokenizer(lowercase=True)),
        "prompts": prompts_file(root / "prompts.jsonl", PROMPTS),
    }


def cfg_for(ckpts, draft: str | None = "target", *extra: str):
    return compose(cfg_for_overrides(ckpts, draft, *extra))


def cfg_for_overrides(ckpts, draft: str | None = "target", *extra: str) -> list[str]:
    overrides = [
        "model=hf",
        f"model.name_or_path={ckpts['target']}",
        "workload=jsonl",
        f"workload.path={ckpts['prompts']}",
        "workload.chat=false",
        "generation.max_new_tokens=20",
    ]
    if draft is not None:
        overrides += ["proposer=draft_model", "proposer.model.name=hf", f"proposer.model.name_or_path={ckpts[draft]}"]
    return overrides + list(extra)


# --------------------------------------------------------------------------- loading whole


def test_a_draft_given_by_path_loads_every_layer(ckpts):
    from harness.runner import load_models

    cfg = cfg_for(ckpts, "other")
    assert cfg.proposer.model.num_layers is None  # no truncation default for a checkpoint
    target, draft = load_models(cfg)
    assert target.model.config.num_hidden_layers == 4 and len(target.model.model.layers) == 4
    assert draft.model.config.num_hidden_layers == 3 and len(draft.model.model.layers) == 3
    from harness.target.native import code_paths
    from harness.target.options import linear_kernel_of, packed_linear_weights, resolved_fused_layers

    fused = 3 if resolved_fused_layers(cfg.proposer.model) else 0  # the target options the draft gets too
    packed = {}
    if linear_kernel_of(draft.model) == {"streaming_panels"}:  # its packed copies, made at load
        packed = {"packed_weight_bytes": sum(w.nbytes for w in packed_linear_weights(draft.model))}
        assert packed["packed_weight_bytes"] > 0
    native = fused or linear_kernel_of(draft.model) & {"streaming", "streaming_panels"}
    assert draft.load_report == {
        "layers": 3,
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
        "stored_dtype": "float32",  # what its safetensors file holds
        "weights_read": ["model.safetensors"],
        **packed,
        "fused_layers": fused,
        "fused_stack": fused > 0,  # and, with every layer fused, the decoder as one native call
        **({"native_code_paths": code_paths()} if native else {}),  # the build's code paths, where it runs
    }
    assert str(ckpts["other"]) in draft.source


def test_the_derived_draft_is_a_named_choice_copied_from_the_target(ckpts):
    from harness.runner import load_models

    cfg = compose(
        [
            "model=hf",
            f"model.name_or_path={ckpts['target']}",
            "proposer=draft_model",
            "proposer.model.num_layers=2",
        ]
    )
    assert cfg.proposer.model.name == "derived"
    target, draft = load_models(cfg)
    assert draft.name == "derived" and len(draft.model.model.layers) == 2 and draft.load_report["layers"] == 2
    assert draft.tokenizer is target.tokenizer
    t_state, d_state = target.model.state_dict(), draft.model.state_dict()
    assert set(d_state) < set(t_state) and "model.layers.2.mlp.up_proj.weight" not in d_state
    for name, tensor in d_state.items():
        assert torch.equal(tensor, t_state[name]), name
        assert tensor.data_ptr() != t_state[name].data_ptr()  # an independent copy


def test_default_draft_is_derived_with_six_layers():
    cfg = compose(["proposer=draft_model"])
    assert cfg.proposer.model.name == "derived" and cfg.proposer.model.num_layers == 6
    assert compose(["proposer=draft_model", "proposer.model.name=hf"]).proposer.model.num_layers is None


@pytest.mark.parametrize(
    "extra, match",
    [
        (["proposer.model.num_layers=2"], "applies only to proposer.model.name=derived"),
        (["proposer.model.name_or_path=null"], "needs proposer.model.name_or_path"),
        (["proposer.model.name_or_path=/no/such/dir"], "no such directory"),
        (["model.num_layers=2"], "the target loads whole"),
    ],
)
def test_draft_configuration_refused_before_model_work(ckpts, monkeypatch, extra, match):
    import transformers

    from harness.runner import plan_job

    def no_load(*a, **k):
        raise AssertionError("a model or tokenizer was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_load)
    with pytest.raises(CheckpointError, match=match):
        plan_job(cfg_for(ckpts, "other", *extra), None)


def test_derived_layer_count_checked_against_the_target(ckpts):
    from harness.contracts import ConfigError
    from harness.runner import plan_job

    cfg = compose(
        ["model=hf", f"model.name_or_path={ckpts['target']}", "proposer=draft_model", "proposer.model.num_layers=5"]
    )
    with pytest.raises(ConfigError, match=r"must be in \[1, 4\] for this 4-layer target; got 5"):
        plan_job(cfg, None)


def test_missing_weights_refused_with_their_names_and_unexpected_ones_shown(ckpts, tmp_path, caplog, capfd):
    import shutil

    from safetensors.torch import load_file, save_file

    from harness.runner import load_models

    broken = tmp_path / "broken"
    shutil.copytree(ckpts["other"], broken)
    state = load_file(str(broken / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(broken / "model.safetensors"), metadata={"format": "pt"})
    ckpts2 = {**ckpts, "broken": broken}
    capfd.readouterr()
    with pytest.raises(CheckpointError, match=r"missing weight\(s\): model\.layers\.1\.mlp\.up_proj\.weight"):
        load_models(cfg_for(ckpts2, "broken"))
    assert "LOAD REPORT" not in capfd.readouterr().err  # transformers' table held back: the refusal names the keys

    # a weight of the wrong shape: transformers stops after its load table; the refusal names the key
    wrong = tmp_path / "wrong"
    shutil.copytree(ckpts["other"], wrong)
    state = load_file(str(wrong / "model.safetensors"))
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 5)
    save_file(state, str(wrong / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        load_models(cfg_for({**ckpts, "wrong": wrong}, "wrong"))
    assert "model.layers.1.mlp.up_proj.weight" in str(info.value) and "\n" not in str(info.value)
    assert "LOAD REPORT" not in capfd.readouterr().err

    extra = tmp_path / "extra"
    shutil.copytree(ckpts["other"], extra)
    state = load_file(str(extra / "model.safetensors"))
    state["medusa_head.0.0.linear.weight"] = torch.zeros(2, 2)
    save_file(state, str(extra / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="harness.loading"):
        _, draft = load_models(cfg_for({**ckpts, "extra": extra}, "extra"))
    assert draft.load_report["unexpected_keys"] == ["medusa_head.0.0.linear.weight"]
    assert "medusa_head.0.0.linear.weight" in caplog.text


# --------------------------------------------------------------------------- tokenizers by content


def test_tokenizer_difference_names_the_first_differing_token():
    base = byte_tokenizer()
    assert tokenizer_difference(base, byte_tokenizer()) is None
    diff = tokenizer_difference(base, byte_tokenizer(rename={100: "<odd>", 120: "<odder>"}))
    assert diff.startswith("token id 100 is") and "'<odd>' in the draft's" in diff
    assert "normalizer differs" in tokenizer_difference(base, byte_tokenizer(lowercase=True))
    added = byte_tokenizer()
    added.add_tokens(["<extra>"])  # an id the target does not have (it said: "is None in the target's")
    assert tokenizer_difference(base, added) == (
        "token id 259 is absent from the target's tokenizer and '<extra>' in the draft's"
    )


def test_a_draft_that_reads_ids_differently_is_refused_before_any_weights_are_read(ckpts, monkeypatch):
    import transformers

    from harness.runner import load_models

    def no_weights(*a, **k):
        raise AssertionError("weights were read before the tokenizers were compared")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    with pytest.raises(CheckpointError, match="reads token ids differently from the target: token id 100 is '"):
        load_models(cfg_for(ckpts, "renamed"))


def test_a_draft_with_the_target_s_ids_but_another_tokenizer_pipeline_is_noted_not_refused(ckpts, capsys):
    """The draft only ever reads the target's ids: a tokenizer that normalises text otherwise (or a
    base model's EOS beside its instruct model's) turns text into ids differently, which the draft
    never does. Refusing it turned away pairs that share every id."""
    from harness.runner import check_same_tokenizer, load_models

    target, draft = load_models(cfg_for(ckpts, "lower"))
    note = draft.load_report["tokenizer_differs"]
    assert "shares the target's token ids but its tokenizer differs (the normalizer differs" in note
    assert "the run is exact" in note and f"harness: note: {note}" in capsys.readouterr().err
    other_eos = byte_tokenizer()
    other_eos.eos_token = "<pad>"
    note = check_same_tokenizer(byte_tokenizer(), other_eos, draft_ref="base")
    assert note.startswith(
        "the draft 'base' shares the target's token ids but its tokenizer differs (special token eos"
    )
    assert check_same_tokenizer(byte_tokenizer(), byte_tokenizer()) is None


def test_padded_vocabulary_is_admitted_and_q_stays_in_the_shared_range(ckpts, capsys):
    from harness.engine.build import BuildContext
    from harness.proposers.draft_model import DraftModelProposer
    from harness.random_source import TorchRandomSource
    from harness.runner import load_models
    from harness.target.backend import CausalLMBackend
    from harness.verifiers.sampling import SamplingPolicy

    cfg = cfg_for(ckpts, "padded", "topology=expansion", "topology.widths=[3,2]", "topology.max_nodes=9")
    target, draft = load_models(cfg)
    assert draft.model.config.vocab_size == 2 * BYTE_VOCAB + 2 and target.model.config.vocab_size == BYTE_VOCAB
    context = BuildContext(
        cfg=cfg,
        target_backend=CausalLMBackend(target.model),
        tokenizer=target.tokenizer,
        draft_backend=CausalLMBackend(draft.model),
    )
    from harness.contracts import Budget

    for policy in (SamplingPolicy(temperature=0.7), SamplingPolicy()):
        proposer = DraftModelProposer.from_config(
            options={"sampling": "iid"},
            budget=Budget(shape="expansion", max_nodes=9, max_depth=2, widths=(3, 2)),
            manifest_hash="h",
            policy=policy,
            context=context,
        )
        assert proposer.vocab_range == BYTE_VOCAB and proposer.target_vocab == BYTE_VOCAB
        assert (  # said, where nothing said the draft was padded
            f"harness: note: the draft's embedding holds {2 * BYTE_VOCAB + 2} ids and the target's {BYTE_VOCAB}: "
            f"the draft proposes from the {BYTE_VOCAB} ids their tokenizer shares"
        ) in capsys.readouterr().err
        ids = target.tokenizer(PROMPTS[0])["input_ids"]
        proposer.start(ids)
        result = proposer.propose(ids, TorchRandomSource(0))
        assert result.q_dists.shape[1] == BYTE_VOCAB  # the target's width, a proper law (checked by the contract)
        assert all(n.token_id < BYTE_VOCAB for n in result.nodes)
        # the padding rows would win every unrestricted argmax
        unrestricted = draft.model(torch.tensor([ids])).logits[0, -1]
        assert int(unrestricted.argmax()) >= BYTE_VOCAB


def test_a_draft_that_embeds_fewer_ids_than_the_tokenizer_is_refused_at_load_naming_both(ckpts, tmp_path, capsys):
    from harness.app import run_main
    from harness.runner import CheckpointError, load_models

    short = tiny_checkpoint(tmp_path / "short", seed=3, pad_to=200)  # the same tokenizer, 200 embedding rows
    with pytest.raises(CheckpointError, match=f"embeds 200 token ids but the tokenizer .* has {BYTE_VOCAB}"):
        load_models(compose([*cfg_for_overrides(ckpts, "target"), f"proposer.model.name_or_path={short}"]))
    out = tmp_path / "run"
    args = [*cfg_for_overrides(ckpts, "target"), f"proposer.model.name_or_path={short}", f"output_dir={out}"]
    capsys.readouterr()
    assert run_main(args) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("harness")]
    assert len(said) == 1 and said[0].startswith(f"harness run: refused: the draft '{short}' embeds 200 token ids")
    # a draft whose tokenizer differs (a note when it runs) and that is refused: the refusal alone is said
    lower_short = tiny_checkpoint(
        tmp_path / "lower_short", seed=3, pad_to=200, tokenizer=byte_tokenizer(lowercase=True)
    )
    args = [*cfg_for_overrides(ckpts, "target"), f"proposer.model.name_or_path={lower_short}", f"output_dir={out}"]
    assert run_main(args) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("harness")]
    assert len(said) == 1 and said[0].startswith(f"harness run: refused: the draft '{lower_short}' embeds 200")
    # a target that embeds fewer ids than its own tokenizer: refused at load too (it failed in its first forward)
    with pytest.raises(
        CheckpointError, match=f"^the target '{short}' embeds 200 token ids but the tokenizer has {BYTE_VOCAB}: "
    ):
        load_models(compose(["model=hf", f"model.name_or_path={short}"]))
    assert not out.exists()


def test_the_draft_follows_its_own_dtype_and_attention_settings(ckpts):
    from harness.runner import load_models

    cfg = cfg_for(ckpts, "other", "model.dtype=float64", "model.attn_implementation=eager")
    target, draft = load_models(cfg)
    assert next(draft.model.parameters()).dtype == torch.float64 == next(target.model.parameters()).dtype
    assert draft.model.config._attn_implementation == "eager" == target.model.config._attn_implementation
    cfg = cfg_for(ckpts, "other", "proposer.model.dtype=bfloat16")
    target, draft = load_models(cfg)
    assert next(draft.model.parameters()).dtype == torch.bfloat16
    assert next(target.model.parameters()).dtype == torch.float32
    derived = compose(
        ["model=hf", f"model.name_or_path={ckpts['target']}", "proposer=draft_model", "proposer.model.num_layers=1"]
        + ["model.dtype=float64", "model.attn_implementation=eager"]
    )
    _, draft = load_models(derived)
    assert next(draft.model.parameters()).dtype == torch.float64
    assert draft.model.config._attn_implementation == "eager"


# --------------------------------------------------------------------------- draft = target


def acceptance(record) -> list[float]:
    return [a for a in record["metrics"]["acceptance_by_depth"] if a is not None]


@pytest.mark.parametrize(
    "draft, extra",
    [
        ("target", ["verifier=greedy"]),
        ("target", ["verifier=rejection", "generation.temperature=0.7"]),
        (
            "target",
            ["verifier=specinfer", "generation.temperature=0.7", "topology=expansion", "topology.widths=[2,1,1]"],
        ),
        ("padded", ["verifier=greedy"]),
        ("padded", ["verifier=rejection", "generation.temperature=0.7"]),
        # 13 tokens = 5 + 5 + 3: each prompt's last round is cut by the token budget after 3 of its 4
        # accepted candidates; the cut depths are not counted as rejections
        ("target", ["verifier=greedy", "generation.max_new_tokens=13"]),
    ],
    ids=["T0-greedy", "T0.7-rejection", "T0.7-specinfer", "padded-T0-greedy", "padded-T0.7-rejection", "T0-cut"],
)
def test_a_draft_identical_to_the_target_accepts_every_candidate(ckpts, tmp_path, monkeypatch, draft, extra):
    """q = p accepts every candidate (rejection: min(1, p/q) = 1 up to float rounding; SpecInfer:
    the first draw is accepted). The padded draft equals the target on the shared range."""
    from harness.runner import run_job

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    topology = [] if any(e.startswith("topology=") for e in extra) else ["topology=sequence", "topology.max_nodes=4"]
    # the exactness gates (oracle, first-token chi-square) are the verifiers' own business and have
    # their own tests; equivalence and greedy equality run
    gates = ["gates.oracle=false", "gates.statistical=false"]
    cfg = cfg_for(ckpts, draft, "topology.max_depth=4", *gates, *topology, *extra)
    record = run_job(cfg, run_dir=tmp_path / "run")
    acc = acceptance(record)
    assert len(acc) >= 3 and min(acc) >= 0.99, record["metrics"]["acceptance_by_depth"]
    assert record["draft_source"] == str(ckpts[draft]) and record["load_report"]["draft"]["layers"] == 4


def test_a_smaller_draft_does_not_accept_everything(ckpts, tmp_path, monkeypatch):
    """The invariant's negative: a different draft (another seed) is not accepted wholesale, so the
    check above can fail."""
    from harness.runner import run_job

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    cfg = cfg_for(
        ckpts, "other", "topology=sequence", "topology.max_nodes=4", "topology.max_depth=4", "gates.oracle=false"
    )
    record = run_job(cfg, run_dir=tmp_path / "run")
    assert min(acceptance(record)) < 0.5


def test_cli_refuses_a_truncated_checkpoint_draft_in_one_line(ckpts, tmp_path, capsys):
    from harness.app import run_main

    run_dir = tmp_path / "run"
    code = run_main(
        [
            "model=hf",
            f"model.name_or_path={ckpts['target']}",
            "proposer=draft_model",
            "proposer.model.name=hf",
            f"proposer.model.name_or_path={ckpts['other']}",
            "proposer.model.num_layers=2",
            f"output_dir={run_dir}",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "applies only to proposer.model.name=derived" in err[0]
    assert not (run_dir / "record.json").exists() and not (run_dir / "outputs.jsonl").exists()


def test_a_checkpoints_weights_are_aligned_to_a_cache_line_and_tied_weights_stay_tied(tmp_path):
    from harness.target.loading import PARAMETER_ALIGNMENT, align_parameters, build_tiny_model, load_model

    loaded = load_model(name="hf", name_or_path=str(tiny_checkpoint(tmp_path / "ckpt", num_layers=2)))
    assert all(p.data_ptr() % PARAMETER_ALIGNMENT == 0 for p in loaded.model.parameters())
    model = build_tiny_model(seed=0)
    model.get_output_embeddings().weight = model.get_input_embeddings().weight  # tied, as SmolLM2's are
    misplaced = {}
    for name, p in model.named_parameters():  # each moved 4 bytes past the alignment, as a mapped file may put it
        storage = torch.empty(p.numel() + 16, dtype=p.dtype)
        offset = (-storage.data_ptr() // p.element_size()) % (PARAMETER_ALIGNMENT // p.element_size()) + 1
        p.data = storage[offset : offset + p.numel()].view_as(p).copy_(p.data)
        assert p.data_ptr() % PARAMETER_ALIGNMENT
        misplaced[name] = p.detach().clone()
    assert align_parameters(model) == len(misplaced)
    for name, p in model.named_parameters():
        assert p.data_ptr() % PARAMETER_ALIGNMENT == 0 and torch.equal(p, misplaced[name])
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert align_parameters(model) == 0  # nothing left to move


def test_the_model_axis_tells_checkpoints_and_dtypes_apart(ckpts):
    """Two checkpoints (or one in two dtypes) never share an arm in the store, compare or exports."""
    from harness.runner import model_label

    assert model_label(compose([]).model) == "smollm2"
    assert model_label(compose(["model=tiny"]).model) == "tiny"
    assert model_label(cfg_for(ckpts, None).model) == "target"  # a local folder by its name
    assert model_label(cfg_for(ckpts, None, "model.dtype=bfloat16").model) == "target@bfloat16"
    hub = compose(["model=hf", "model.name_or_path=meta-llama/Meta-Llama-3-8B-Instruct", "model.device=cuda"])
    assert model_label(hub.model) == "meta-llama/Meta-Llama-3-8B-Instruct@bfloat16"  # cuda's default dtype


def test_new_weights_at_the_same_path_make_another_manifest(tmp_path):
    """A target or draft loaded by path and an artifact directory (EAGLE's) are bound by their files:
    new weights at the same path change the manifest hash (a sweep then re-runs the job instead of
    keeping a record of the old weights); a hub id with no commit to be found, by its name."""
    from harness.manifest import checkpoint_fingerprint, job_manifest, job_manifest_hash

    target, draft = tiny_checkpoint(tmp_path / "target"), tiny_checkpoint(tmp_path / "draft", seed=1)
    eagle = tmp_path / "eagle"
    eagle.mkdir()
    (eagle / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle"]}')
    torch.save({"fc.weight": torch.zeros(2, 2)}, eagle / "pytorch_model.bin")
    runs = {
        "target": ["model=hf", f"model.name_or_path={target}"],
        "draft": [
            "model=tiny",
            "proposer=draft_model",
            "proposer.model.name=hf",
            f"proposer.model.name_or_path={draft}",
        ],
        "eagle": ["model=tiny", "proposer=eagle", f"proposer.artifact={eagle}", "topology=sequence"],
    }
    before = {k: job_manifest_hash(compose(v), versions={}) for k, v in runs.items()}
    assert job_manifest(compose(runs["draft"]), versions={})["draft_checkpoint"]["files"]["model.safetensors"]
    tiny_checkpoint(target, seed=7)  # other weights, same files
    tiny_checkpoint(draft, seed=8)
    torch.save({"fc.weight": torch.ones(2, 2)}, eagle / "pytorch_model.bin")
    after = {k: job_manifest_hash(compose(v), versions={}) for k, v in runs.items()}
    assert all(before[k] != after[k] for k in runs), (before, after)
    import harness.target.loading as loading

    loading.hub_unreachable.cache_clear()
    try:
        with pytest.MonkeyPatch.context() as patch:  # no commit to be found: the name alone
            from huggingface_hub import constants

            patch.setenv("HF_HUB_OFFLINE", "1")
            patch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
            assert checkpoint_fingerprint("someone/some-model") == {
                "ref": "someone/some-model",
                "files": None,
                "bound_by": "name",
            }
    finally:
        loading.hub_unreachable.cache_clear()
    assert "target_checkpoint" not in job_manifest(compose(["model=tiny"]), versions={})
    (target / "chat_template.jinja").write_text("{{ messages }}")  # transformers 5 keeps the template here
    templated = job_manifest_hash(compose(runs["target"]), versions={})
    (target / "chat_template.jinja").write_text("{{ messages }}!")
    assert job_manifest_hash(compose(runs["target"]), versions={}) not in (templated, after["target"])


def test_an_eagle_draft_by_hub_id_is_bound_by_the_files_of_the_snapshot_it_resolves_to(tmp_path, monkeypatch):
    """Medusa and Hydra by hub id were bound by their files, an EAGLE draft by hub id by nothing: a
    sweep kept records of the old weights after the id's snapshot moved on."""
    import harness.heads.eagle_formats as formats
    from harness.manifest import job_manifest, job_manifest_hash

    snapshots = {}
    for rev, fill in (("abc123", 0.0), ("def456", 1.0)):
        snap = tmp_path / rev
        snap.mkdir()
        (snap / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle"]}')
        torch.save({"fc.weight": torch.full((2, 2), fill)}, snap / "pytorch_model.bin")
        snapshots[rev] = snap
    current = {"rev": "abc123"}
    monkeypatch.setattr(formats, "hub_unreachable", lambda: "offline")

    def cached(repo_id, allow_patterns, local_files_only=False):
        assert repo_id == "fake/eagle" and local_files_only
        return str(snapshots[current["rev"]])

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", cached)
    cfg = compose(["model=tiny", "proposer=eagle", "proposer.artifact=fake/eagle", "topology=sequence"])
    first = job_manifest(cfg, versions={})["proposer_artifact"]
    assert first["ref"] == "fake/eagle" and first["revision"] == "abc123" and "directory" not in first
    assert set(first["files"]) == {"config.json", "pytorch_model.bin"}
    before = job_manifest_hash(cfg, versions={})
    current["rev"] = "def456"
    assert job_manifest_hash(cfg, versions={}) != before


def test_a_target_by_hub_id_is_bound_by_its_commit_and_loaded_at_it(tmp_path, monkeypatch):
    """A target or draft by hub id was bound by its name: a gate cached for its old weights, and a sweep's
    record of them, stood for the new weights once the repository moved on. The commit it resolves to
    when the run is planned is bound, and the weights are read at that commit even when the repository
    moves before they load (a local hub cache of two commits, read offline)."""
    import harness.target.loading as loading
    from harness.manifest import checkpoint_fingerprint
    from harness.runner import load_models

    old, new = "a" * 40, "b" * 40
    repo = tmp_path / "hub" / "models--someone--tiny-llama"
    for commit, seed in ((old, 0), (new, 1)):
        tiny_checkpoint(repo / "snapshots" / commit, seed=seed)
    (repo / "refs").mkdir()
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the harness's check, and the hub client's (read at its import)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    loading.hub_unreachable.cache_clear()
    try:
        (repo / "refs" / "main").write_text(old)
        bound = checkpoint_fingerprint("someone/tiny-llama")
        assert bound == {"ref": "someone/tiny-llama", "revision": old, "bound_by": "revision"}
        (repo / "refs" / "main").write_text(new)  # the repository moved on after the plan
        assert checkpoint_fingerprint("someone/tiny-llama")["revision"] == new  # another manifest now
        cfg = compose(["model=hf", "model.name_or_path=someone/tiny-llama"])
        pinned, _ = load_models(cfg, revisions={"target": old})
        latest, _ = load_models(cfg)
    finally:
        loading.hub_unreachable.cache_clear()
    assert pinned.load_report["revision"] == old and "revision" not in latest.load_report
    at = {c: load_model_weights(repo / "snapshots" / c) for c in (old, new)}
    weight = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(pinned.model.state_dict()[weight].float(), at[old][weight].float())
    assert torch.equal(latest.model.state_dict()[weight].float(), at[new][weight].float())
    assert not torch.equal(at[old][weight], at[new][weight])


def load_model_weights(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_a_checkpoint_with_a_non_finite_weight_is_refused_at_load_naming_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    from harness.target.loading import load_model

    path = tiny_checkpoint(tmp_path / "ckpt")
    state = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    state[name][0, 0] = float("nan")
    state[name][1, 1] = float("inf")
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"^checkpoint '{path}': {name} holds 2 non-finite value\(s\)"):
        load_model(name="hf", name_or_path=str(path))


def _checkpoint_saved_in(path, dtype):
    from harness.target.loading import build_tiny_model

    model = build_tiny_model(seed=0, vocab_size=BYTE_VOCAB)
    with torch.no_grad():  # below float16's range: bfloat16 holds it, float16 makes it 0
        model.model.layers[0].self_attn.q_proj.weight[0, 0] = 1e-10
    model = model.to(dtype)
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 1, 2, 0
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path, model


@pytest.mark.parametrize(
    "stored, loaded, rounds",
    [
        (torch.float16, "bfloat16", True),  # an fp16 checkpoint under CUDA's default dtype
        (torch.bfloat16, "float16", True),
        (torch.float32, "float16", True),
        (torch.float32, "bfloat16", True),
        (torch.float16, "float16", False),
        (torch.float16, "float32", False),
        (torch.bfloat16, "float32", False),
        (torch.float32, "float32", False),
    ],
)
def test_a_checkpoint_loaded_in_a_narrower_dtype_than_it_stores_is_noted_and_its_stored_dtype_recorded(
    tmp_path, capsys, stored, loaded, rounds
):
    from harness.target.loading import load_model

    saved = str(stored).removeprefix("torch.")
    path, model = _checkpoint_saved_in(tmp_path / "ckpt", stored)
    capsys.readouterr()
    lm = load_model(name="hf", name_or_path=str(path), dtype=loaded)
    assert lm.load_report["stored_dtype"] == saved
    w_saved = model.model.layers[0].self_attn.q_proj.weight.float()
    w_loaded = lm.model.model.layers[0].self_attn.q_proj.weight.float()
    assert (not torch.equal(w_loaded, w_saved)) is rounds  # the note says what happened to the weights
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("harness: note:")]
    if rounds:
        keep = saved if saved == "float32" else f"{saved} or float32"
        assert notes == [
            f"harness: note: checkpoint {str(path)!r} stores its weights in {saved}; loaded as {loaded}, they are "
            f"rounded (not every {saved} value is a {loaded} value): load it as {keep} to run them as stored"
        ]
    else:
        assert notes == []


def test_the_stored_dtype_is_read_from_the_weight_headers_else_the_config(tmp_path):
    import json

    from safetensors.torch import save_file

    from harness.target.loading import stored_dtype

    big = {"a": torch.zeros(64, 64, dtype=torch.float16), "b": torch.zeros(4, dtype=torch.float32)}
    one = tmp_path / "one"
    one.mkdir()
    save_file(big, str(one / "model.safetensors"))
    (one / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))  # the weights decide
    header = 8 + int.from_bytes((one / "model.safetensors").read_bytes()[:8], "little")
    with open(one / "model.safetensors", "r+b") as f:
        f.truncate(header)  # the tensors' bytes gone: only the header is read
    assert stored_dtype(one) == "float16"

    sharded = tmp_path / "sharded"  # the dtype holding the most elements over every shard
    sharded.mkdir()
    save_file({"x": torch.zeros(8, dtype=torch.bfloat16)}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({"y": torch.zeros(16, 16, dtype=torch.float32)}, str(sharded / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    (sharded / "config.json").write_text("{}")
    assert stored_dtype(sharded) == "float32"

    pickled = tmp_path / "bin"  # pytorch_model.bin only: what config.json says
    pickled.mkdir()
    torch.save({"a": torch.zeros(2, dtype=torch.float16)}, pickled / "pytorch_model.bin")
    (pickled / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    assert stored_dtype(pickled) == "bfloat16"
    (pickled / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert stored_dtype(pickled) == "float16"
    (pickled / "config.json").write_text(json.dumps({"torch_dtype": "auto"}))
    assert stored_dtype(pickled) is None  # nothing says


def test_the_stored_dtype_of_a_hub_id_is_read_from_the_cached_snapshot_of_its_revision(tmp_path, monkeypatch):
    from huggingface_hub import constants
    from safetensors.torch import save_file

    from harness.target.loading import stored_dtype

    old, new = "a" * 40, "b" * 40
    repo = tmp_path / "hub" / "models--someone--tiny-llama"
    for commit, dtype in ((old, torch.float16), (new, torch.bfloat16)):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
        save_file({"w": torch.zeros(4, dtype=dtype)}, str(repo / "snapshots" / commit / "model.safetensors"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(new)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert stored_dtype("someone/tiny-llama") == "bfloat16"
    assert stored_dtype("someone/tiny-llama", revision=old) == "float16"
    assert stored_dtype("someone/not-cached") is None


def _partial_hub_cache(tmp_path, monkeypatch, source):
    """A local hub cache whose snapshot of ``someone/partdraft`` holds ``config.json`` alone (what an
    interrupted online run leaves: the harness binds a hub id by fetching that file only), read offline."""
    import shutil

    from huggingface_hub import constants

    import harness.target.loading as loading

    commit = "c" * 40
    repo = tmp_path / "hub" / "models--someone--partdraft"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    shutil.copy(source / "config.json", snapshot / "config.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the harness's check, and the hub client's (read at its import)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    loading.hub_unreachable.cache_clear()
    return snapshot


NOT_CACHED = (
    "cannot load its Tokenizer: not in the local Hugging Face cache, and the hub cannot be reached "
    "(HF_HUB_OFFLINE is set); give a checkpoint folder, or fetch it where the hub is reachable"
)


def test_a_hub_id_whose_cached_snapshot_lacks_its_tokenizer_is_refused_offline_as_not_cached(
    ckpts, tmp_path, monkeypatch
):
    """A snapshot holding config.json alone was refused quoting transformers' advice to install
    sentencepiece or tiktoken, for the target and a draft alike; a cached tokenizer that is broken still
    says what is wrong with it."""
    import harness.target.loading as loading
    from harness.runner import load_models

    snapshot = _partial_hub_cache(tmp_path, monkeypatch, ckpts["target"])
    try:
        target = ["model=hf", "model.name_or_path=someone/partdraft"]
        with pytest.raises(CheckpointError) as info:
            load_models(compose(target))
        assert str(info.value) == f"model.name_or_path=someone/partdraft: {NOT_CACHED}"
        draft = [*cfg_for_overrides(ckpts, None), "proposer=draft_model", "proposer.model.name=hf"]
        with pytest.raises(CheckpointError) as info:
            load_models(compose([*draft, "proposer.model.name_or_path=someone/partdraft"]))
        assert str(info.value) == f"proposer.model.name_or_path=someone/partdraft: {NOT_CACHED}"
        (snapshot / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
        with pytest.raises(CheckpointError) as info:
            load_models(compose(target))
        assert "cannot load its Tokenizer (" in str(info.value) and "local Hugging Face cache" not in str(info.value)
    finally:
        loading.hub_unreachable.cache_clear()


def test_a_snapshot_lacks_the_files_a_load_reads_until_they_are_cached(ckpts, tmp_path, monkeypatch):
    """Tokenizer files, weight files, and every shard a cached shard index names; a file the hub cache
    records as absent from the repository is not missing from the snapshot."""
    import json
    import shutil

    import harness.target.loading as loading

    snapshot = _partial_hub_cache(tmp_path, monkeypatch, ckpts["target"])
    try:
        lacks = {w: loading._snapshot_lacks("someone/partdraft", w, {}) for w in ("Tokenizer", "ModelForCausalLM")}
        assert lacks == {"Tokenizer": True, "ModelForCausalLM": True}
        absent = snapshot.parent.parent / ".no_exist" / snapshot.name
        absent.mkdir(parents=True)
        for name in loading.TOKENIZER_FILES:  # the repository has none: nothing is missing from the cache
            (absent / name).touch()
        assert not loading._snapshot_lacks("someone/partdraft", "Tokenizer", {})
        shutil.copy(ckpts["target"] / "model.safetensors", snapshot / "model-00001-of-00002.safetensors")
        index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
        (snapshot / "model.safetensors.index.json").write_text(json.dumps(index))
        assert loading._snapshot_lacks("someone/partdraft", "ModelForCausalLM", {})  # one shard of two
        shutil.copy(ckpts["target"] / "model.safetensors", snapshot / "model-00002-of-00002.safetensors")
        assert not loading._snapshot_lacks("someone/partdraft", "ModelForCausalLM", {})
        assert loading._snapshot_lacks("someone/partdraft", "ModelForCausalLM", {"revision": "d" * 40})
    finally:
        loading.hub_unreachable.cache_clear()


def test_a_checkpoint_with_two_weight_files_notes_the_one_left_unread_and_records_the_one_read(ckpts, tmp_path, capsys):
    """A folder holding model.safetensors and pytorch_model.bin was bound by both, with no word of
    which one transformers read (model.safetensors); a sharded checkpoint names its index and shards."""
    import shutil

    from harness.runner import load_models
    from harness.target.loading import build_tiny_model, load_model

    both = tmp_path / "both"
    shutil.copytree(ckpts["other"], both)
    other = build_tiny_model(seed=11, vocab_size=BYTE_VOCAB, num_layers=3).state_dict()
    torch.save(other, both / "pytorch_model.bin")  # other weights: the ones read show
    capsys.readouterr()
    _, draft = load_models(cfg_for({**ckpts, "both": both}, "both"))
    assert draft.load_report["weights_read"] == ["model.safetensors"]
    notes = [line for line in capsys.readouterr().err.splitlines() if "left unread" in line]
    assert notes == [
        f"harness: note: checkpoint {str(both)!r}: pytorch_model.bin left unread: model.safetensors is read first"
    ]
    weight = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(draft.model.state_dict()[weight].float(), other[weight].float())
    assert torch.equal(draft.model.state_dict()[weight].float(), load_model_weights(both)[weight].float())

    sharded = tiny_checkpoint(tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted(p.name for p in sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    lm = load_model(name="hf", name_or_path=str(sharded))
    assert lm.load_report["weights_read"] == ["model.safetensors.index.json", *shards]
    assert "left unread" not in capsys.readouterr().err
    (sharded / "pytorch_model.bin").write_bytes((both / "pytorch_model.bin").read_bytes())
    lm = load_model(name="hf", name_or_path=str(sharded))
    assert lm.load_report["weights_read"] == ["model.safetensors.index.json", *shards]
    assert "pytorch_model.bin left unread: model.safetensors.index.json is read first" in capsys.readouterr().err


def test_a_config_declaring_fewer_layers_than_the_weights_hold_is_refused_at_load(tmp_path):
    """The extra layers' tensors went unused with a warning, and a truncated model ran as the target."""
    import json

    from harness.target.loading import build_tiny_model, check_loading_info, load_model

    path = tiny_checkpoint(tmp_path / "ckpt", num_layers=3)
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError,
        match=rf"^checkpoint '{path}': config.json declares 1 decoder layer\(s\) but the weights hold layer\(s\) "
        r"up to index 2: the model would run without them",
    ):
        load_model(name="hf", name_or_path=str(path))

    config["num_hidden_layers"] = 0
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"declares 0 decoder layers: there is no model"):
        load_model(name="hf", name_or_path=str(path))

    # tensors a model does not use inside its own layers (an old checkpoint's rotary buffers), another
    # module's layers (a vision tower's) and a multi-token-prediction layer the config declares past
    # its decoder layers stay a warning
    model = build_tiny_model(num_layers=2)
    model.config.num_nextn_predict_layers = 1
    info = {
        "unexpected_keys": [
            "model.layers.1.self_attn.rotary_emb.inv_freq",
            "vision_tower.encoder.layers.7.mlp.fc1.weight",
            "model.layers.2.mlp.up_proj.weight",
        ]
    }
    assert check_loading_info(info, source="ckpt", model=model)["unexpected_keys"] == sorted(info["unexpected_keys"])
    model.config.num_nextn_predict_layers = 0
    with pytest.raises(CheckpointError, match="declares 2 decoder layer.* up to index 2"):
        check_loading_info(info, source="ckpt", model=model)


def test_options_a_published_checkpoint_decides_are_inert_and_out_of_the_manifest(tmp_path):
    """A published head bank or EAGLE draft is never trained here, and an EAGLE draft's shape is
    read from its files: those options changed nothing but the manifest hash (two identical runs
    looked like two arms) and were not listed."""
    from harness.manifest import job_manifest, job_manifest_hash
    from harness.runner import inert_options

    eagle = tmp_path / "eagle"
    eagle.mkdir()
    (eagle / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle"]}')
    torch.save({"fc.weight": torch.zeros(2, 2)}, eagle / "pytorch_model.bin")
    base = ["model=tiny", "proposer=eagle", f"proposer.artifact={eagle}", "topology=sequence"]
    changed = [
        "proposer.num_layers=3",
        "proposer.fc_bias=false",
        "proposer.train.epochs=7",
        "proposer.auto_train=false",
    ]
    assert job_manifest_hash(compose([*base, *changed]), versions={}) == job_manifest_hash(compose(base), versions={})
    assert "train" not in job_manifest(compose(base), versions={})["proposer"]
    why = f"proposer.artifact={eagle} is a published checkpoint, read as its authors ship it"
    assert inert_options(compose([*base, *changed])) == [
        f"proposer.num_layers=3: {why} (its shape is read from its files)",
        f"proposer.fc_bias=false: {why} (its shape is read from its files)",
        f"proposer.auto_train=false: {why} (nothing is trained)",
        f"proposer.train.epochs=7: {why} (nothing is trained)",
    ]
    heads = tmp_path / "heads"  # a folder without the harness's manifest.json: a published layout
    heads.mkdir()
    medusa = ["model=tiny", "proposer=medusa", f"proposer.artifact={heads}", "proposer.data.token_budget=1000"]
    assert inert_options(compose(medusa)) == [
        f"proposer.data.token_budget=1000: proposer.artifact={heads} is a published checkpoint, read as its "
        "authors ship it (nothing is trained)"
    ]
    trained_here = ["model=tiny", "proposer=eagle", "proposer.num_layers=3", "proposer.train.epochs=7"]
    assert inert_options(compose(trained_here)) == []
    assert job_manifest(compose(trained_here), versions={})["proposer"]["num_layers"] == 3


@pytest.mark.parametrize("proposer", ["medusa", "hydra", "clover", "eagle", "early_exit", "layer_skip"])
def test_a_file_given_as_the_artifact_is_refused_naming_its_folder(tmp_path, proposer):
    """A published checkpoint's weight file given as ``proposer.artifact`` was refused as a folder
    that "does not exist"; its folder is suggested where it holds a checkpoint's config or an
    artifact's manifest."""
    from harness.engine.build import plan

    weights = tmp_path / "medusa_lm_head.pt"
    weights.write_bytes(b"not read")
    # a folder with nothing of a checkpoint is not suggested
    with pytest.raises(ValueError, match=rf"^proposer.artifact={weights} is a file; .* \({tmp_path}\) is no artifact"):
        plan(compose(["model=tiny", f"proposer={proposer}", f"proposer.artifact={weights}"]))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(
        ValueError, match=rf"^proposer.artifact={weights} is a file; .* \(proposer.artifact={tmp_path}\)$"
    ):
        plan(compose(["model=tiny", f"proposer={proposer}", f"proposer.artifact={weights}"]))


def test_a_derived_draft_deeper_than_the_target_offers_a_depth_that_fits(tmp_path):
    """A 2-layer target with the derived draft's default of 6 layers was refused with no fix."""
    from harness.config import checked_plan
    from harness.contracts import ConfigError

    target = tiny_checkpoint(tmp_path / "target")
    with pytest.raises(ConfigError) as err:
        checked_plan(["model=hf", f"model.name_or_path={target}", "proposer=draft_model", "workload.limit=1"])
    message = str(err.value)
    assert message.startswith("proposer.model.num_layers must be in [1, 2] for this 2-layer target; got 6")
    assert message.endswith("try proposer.model.num_layers=1")


def test_a_checkpoint_folder_given_as_a_home_path_loads(tmp_path, monkeypatch):
    """``model.name_or_path="~/ckpt"`` passed the path checks (they expand ``~``) and then went to
    transformers as written, which read it as a malformed hub id."""
    from checkpoint_fixtures import tiny_checkpoint

    from harness.target.loading import load_model

    monkeypatch.setenv("HOME", str(tmp_path))
    tiny_checkpoint(tmp_path / "ckpt")
    loaded = load_model(name="hf", name_or_path="~/ckpt")
    assert loaded.model.config.vocab_size > 0


def test_a_sliding_attention_window_bounds_the_context_like_a_position_limit(tmp_path):
    """A context past a Mistral-style window crashed the verify forward with a tensor-size error
    (the tree mask spans the whole context, the cache only the window): the window now bounds every
    turn as the positions do, refused or cut before any model work."""
    from transformers import MistralConfig, Qwen2Config

    from harness.runner import plan_context

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    MistralConfig(**small, num_key_value_heads=1, sliding_window=40, max_position_embeddings=512).save_pretrained(
        tmp_path / "mistral"
    )
    Qwen2Config(**small, num_key_value_heads=1, sliding_window=40, use_sliding_window=False).save_pretrained(
        tmp_path / "qwen2"
    )
    mistral = ["model=hf", f"model.name_or_path={tmp_path / 'mistral'}"]
    limit = plan_context(compose([*mistral, "generation.max_new_tokens=8"]), tree_rows=8)
    assert limit.positions == 39 and limit.limited_by == "the target's sliding attention window (model=hf)"
    with pytest.raises(ValueError, match=r"leave no room for a prompt in the 39 positions of the target's sliding"):
        plan_context(compose(mistral), tree_rows=8)  # 64 new tokens
    unwindowed = plan_context(compose(["model=hf", f"model.name_or_path={tmp_path / 'qwen2'}"]), tree_rows=8)
    assert unwindowed.limited_by == "the target (model=hf)"  # its window is switched off


def test_a_longrope_model_keeps_every_turn_below_its_switch_to_the_long_factors(tmp_path):
    """Phi-3's longrope rotates every position of a forward that reaches original_max_position_embeddings
    by its long factors, and generate rebuilds the cache there; the harness's cache kept the short
    factors' keys, so a decode across that position left generate's tokens (and a tree straddling it
    its own AR arm's). The switch bounds the context now, as a sliding window does."""
    from transformers import Phi3Config

    from harness.runner import plan_context
    from harness.target.loading import model_rope_switch

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8, long_factor=[2.0] * 8)
    Phi3Config(
        **small,
        num_key_value_heads=1,
        max_position_embeddings=512,
        original_max_position_embeddings=48,
        rope_parameters={**rope, "original_max_position_embeddings": 48},
    ).save_pretrained(tmp_path / "phi3")
    Phi3Config(**small, num_key_value_heads=1, max_position_embeddings=512).save_pretrained(tmp_path / "plain")
    phi3 = ["model=hf", f"model.name_or_path={tmp_path / 'phi3'}"]
    assert model_rope_switch(compose(phi3).model) == 48
    limit = plan_context(compose([*phi3, "generation.max_new_tokens=8"]), tree_rows=8)
    assert limit.positions == 48 and limit.limited_by.startswith("the target's longrope switch to its long factors")
    with pytest.raises(ValueError, match=r"leave no room for a prompt in the 48 positions of the target's longrope"):
        plan_context(compose(phi3), tree_rows=8)  # 64 new tokens
    plain = ["model=hf", f"model.name_or_path={tmp_path / 'plain'}"]
    assert model_rope_switch(compose(plain).model) is None
    assert plan_context(compose([*plain, "generation.max_new_tokens=8"]), tree_rows=8).positions == 512


def test_chunked_and_multimodal_windows_bound_the_context_from_the_decoder_config(tmp_path):
    """The window is read from the cache layers transformers builds for the decoder: Llama 4's
    attention chunks bound the context as a sliding window does, and a multimodal config's nested
    sliding layers are read too (such a checkpoint is then refused as multimodal)."""
    from transformers import Gemma3Config, Llama4TextConfig

    from harness.runner import plan_context
    from harness.target.loading import model_attention_window, model_position_limit

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)
    Llama4TextConfig(
        **small, num_hidden_layers=4, attention_chunk_size=48, max_position_embeddings=512
    ).save_pretrained(tmp_path / "llama4")
    gemma3 = Gemma3Config(text_config=dict(**small, num_hidden_layers=2, sliding_window=40, head_dim=8))
    gemma3.save_pretrained(tmp_path / "gemma3")
    llama4 = compose(["model=hf", f"model.name_or_path={tmp_path / 'llama4'}", "generation.max_new_tokens=8"])
    assert model_attention_window(llama4.model) == 47
    limit = plan_context(llama4, tree_rows=8)
    assert limit.positions == 47 and limit.limited_by == "the target's sliding attention window (model=hf)"
    multimodal = compose(["model=hf", f"model.name_or_path={tmp_path / 'gemma3'}"])
    assert model_attention_window(multimodal.model) == 39
    assert model_position_limit(multimodal.model) == gemma3.text_config.max_position_embeddings
    # a run of it is refused from its config, naming what it is (it read as "no num_hidden_layers")
    from harness.config import checked_plan
    from harness.target.loading import CheckpointError

    with pytest.raises(CheckpointError, match=r"gemma3: a multimodal Gemma3Config checkpoint; the harness benchmarks"):
        checked_plan(["model=hf", f"model.name_or_path={tmp_path / 'gemma3'}", "workload.limit=1"])


def test_a_checkpoint_with_recurrent_layers_is_refused_before_any_weights(tmp_path, monkeypatch, capsys):
    """A hybrid of attention and linear attention (Qwen3-Next) keeps a recurrent state that every
    verified row updates: cutting the keys back to the accepted path left that state holding the
    rejected rows. It is refused from its config, as a target and as a draft, in one line naming
    the layers, before any model work; the cache builder refuses it too."""
    from transformers import Qwen3NextConfig

    from harness.app import run_main
    from harness.target.kv_cache import new_cache

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)
    config = Qwen3NextConfig(**small, num_hidden_layers=4)
    config.save_pretrained(tmp_path / "hybrid")
    prompts = prompts_file(tmp_path / "p.jsonl", ["def add(a, b):"])
    common = ["workload=jsonl", f"workload.path={prompts}", "workload.chat=false", "generation.max_new_tokens=8"]
    for key, options in (
        ("model.name_or_path", ["model=hf", f"model.name_or_path={tmp_path / 'hybrid'}"]),
        (
            "proposer.model.name_or_path",
            [
                "model=tiny",
                "proposer=draft_model",
                "proposer.model.name=hf",
                f"proposer.model.name_or_path={tmp_path / 'hybrid'}",
            ],
        ),
    ):
        out = tmp_path / key
        code = run_main([*options, *common, f"output_dir={out}"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and not out.exists(), err
        assert err[-1].endswith(
            f"{key}={tmp_path / 'hybrid'}: its linear_attention layers keep a state that every verified row updates, "
            "and rejected draft rows cannot be taken back out of it; the harness verifies on attention layers whose "
            "cache it cuts to the accepted path (full, sliding-window or chunked attention)"
        ), err
    with pytest.raises(ValueError, match=r"a Qwen3NextConfig's cache has LinearAttentionLayer layers, whose state"):
        new_cache(config, preallocated=False)


def test_models_whose_attention_reads_positions_from_cache_slots_are_refused_before_any_model(
    tmp_path, capsys, monkeypatch
):
    """ALiBi (Bloom, MPT, Falcon with alibi) biases a key by its cache slot's distance, and Llama 4
    scales its NoPE layers by a temperature of the slot: a tree row in a slot past the prefix read
    another bias than the sequential decode. MPT's tree rows moved by 0.09 (the equivalence gate
    failed naming no cause); Falcon and Bloom crashed on the tree mask. Each is refused in one line."""
    from transformers import BloomConfig, FalconConfig, Llama4TextConfig, MptConfig

    from harness.app import run_main

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    small = dict(vocab_size=64, hidden_size=16)
    BloomConfig(**small, n_layer=1, n_head=2).save_pretrained(tmp_path / "bloom")
    MptConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2).save_pretrained(tmp_path / "mpt")
    FalconConfig(**small, num_hidden_layers=1, num_attention_heads=2, alibi=True).save_pretrained(tmp_path / "falcon")
    Llama4TextConfig(
        **small, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1
    ).save_pretrained(tmp_path / "llama4")
    prompts = prompts_file(tmp_path / "p.jsonl", ["def add(a, b):"])
    common = ["workload=jsonl", f"workload.path={prompts}", "workload.chat=false", "generation.max_new_tokens=8"]
    for name, said in (
        ("bloom", "a bloom whose ALiBi attention biases each key by its cache slot's distance"),
        ("mpt", "a mpt whose ALiBi attention biases each key by its cache slot's distance"),
        ("falcon", "a falcon whose ALiBi attention biases each key by its cache slot's distance"),
        ("llama4", "a llama4_text whose NoPE layers scale attention by a temperature read from the cache slot"),
    ):
        out = tmp_path / f"out-{name}"
        code = run_main(["model=hf", f"model.name_or_path={tmp_path / name}", *common, f"output_dir={out}"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and not out.exists(), err
        assert f"model.name_or_path={tmp_path / name}: {said}, not from the token's position" in err[-1], err
    FalconConfig(**small, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path / "falcon-rope")
    from harness.target.loading import position_bias_problem

    rope = compose(["model=hf", f"model.name_or_path={tmp_path / 'falcon-rope'}"]).model
    assert position_bias_problem(rope, "model.name_or_path") is None  # rotary Falcon: positions as given


def _sliding_checkpoint(path, family: str):
    """A tiny checkpoint whose attention slides over 64 positions (Gemma 2: every other layer; Mistral:
    every layer), weights drawn wide enough that its greedy tokens vary."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

    shape = dict(
        vocab_size=BYTE_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=64,
        max_position_embeddings=512,
        initializer_range=0.4,
        tie_word_embeddings=False,  # Gemma 2's tied, scaled embedding echoes the last token at random weights
    )
    torch.manual_seed(0)
    if family == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(**shape, head_dim=8, attn_implementation="eager"))
    else:
        model = MistralForCausalLM(MistralConfig(**shape))
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("family", ["gemma2", "mistral"])
def test_a_sliding_window_model_decodes_as_transformers_generate_inside_its_window(tmp_path, monkeypatch, family):
    """Gemma 2 with eager attention passed the gates, then its first measured round failed with a
    tensor-size error: transformers' sliding cache layer counts its length apart from its keys, and
    a round's rollback left that count stale. Inside the window sliding attention is full attention,
    so such layers are full layers here: both arms equal transformers' own greedy ``generate`` token
    for token, and a forward past the window is refused rather than attending outside it."""
    import json

    from transformers import AutoModelForCausalLM

    from harness.runner import run_job
    from harness.target.backend import CausalLMBackend

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    ckpt = _sliding_checkpoint(tmp_path / family, family)
    text = "def add(a, b):\n    return a + b\n# add"
    prompts = prompts_file(tmp_path / "p.jsonl", [text])
    attention = ["model.attn_implementation=eager"] if family == "gemma2" else []
    cfg = compose(
        [
            "model=hf",
            f"model.name_or_path={ckpt}",
            *attention,
            "workload=jsonl",
            f"workload.path={prompts}",
            "workload.chat=false",
            "generation.max_new_tokens=6",
            "generation.warmup_tokens=0",
            "proposer=prompt_lookup",
            "gates.oracle=false",
        ]
    )
    record = run_job(cfg, run_dir=tmp_path / "run")
    row = json.loads((tmp_path / "run" / "outputs.jsonl").read_text().splitlines()[0])
    model = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager" if attention else "sdpa")
    ids = torch.tensor([row["prompt_token_ids"]])
    assert ids.shape[1] + 6 < 64  # inside the window, as the run plans every turn
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = ref[0, ids.shape[1] :].tolist()
    assert row["ar_token_ids"] == row["spec_token_ids"] == expected and len(set(expected)) > 1
    assert record["gates"]["equivalence"]["status"] == "passed"
    backend = CausalLMBackend(model.eval())
    state = backend.prefill_one(list(range(3, 63)))  # 59 cached, the last token pending
    with pytest.raises(ValueError, match=r"reaching position 64 passes the model's sliding attention window of 64 "):
        backend.forward_rows(state, list(range(3, 9)), range(59, 65), None)
    # rows kept in the cache past the window's slots, at positions inside it (the statistical gate's rows by
    # path): full attention is still the window's
    out = backend.forward_rows(state, list(range(3, 11)), [59, 60, 60, 61, 61, 62, 62, 63], None)
    assert state.cache_len == 67 and out.logits.shape[-2] == 8  # 67 slots, positions up to 63


def test_an_architecture_without_sdpa_attention_is_refused_offering_eager(tmp_path, monkeypatch, capsys):
    """Gemma 2 has no SDPA attention in this transformers: the default ``sdpa`` failed with
    transformers' own error and no way forward; the one line now names the option and its value."""
    from harness.app import run_main

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    ckpt = _sliding_checkpoint(tmp_path / "gemma2", "gemma2")
    prompts = prompts_file(tmp_path / "p.jsonl", ["def add(a, b):"])
    code = run_main(
        [
            "model=hf",
            f"model.name_or_path={ckpt}",
            "workload=jsonl",
            f"workload.path={prompts}",
            "workload.chat=false",
            "generation.max_new_tokens=8",
            f"output_dir={tmp_path / 'run'}",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and not (tmp_path / "run" / "record.json").exists()
    assert "model.attn_implementation=sdpa: " in err and "Gemma2ForCausalLM has no such attention" in err
    assert err.endswith(
        "set model.attn_implementation=eager (its tree masks are checked by the equivalence gate as any other)"
    )


def test_a_prompt_over_the_context_is_refused_before_the_weights_are_read(tmp_path, monkeypatch, capsys):
    """The context refusal (and a conversation with workload.chat=false) came after the checkpoint's
    weights loaded: a large model was read only to refuse a prompt. The tokenizer is enough now."""
    from checkpoint_fixtures import tiny_checkpoint

    from harness import runner
    from harness.app import run_main

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    ckpt = tiny_checkpoint(tmp_path / "ckpt")

    def no_weights(*args, **kwargs):
        raise AssertionError("weights read before the prompts were checked")

    monkeypatch.setattr(runner, "_load", no_weights)
    prompts = prompts_file(tmp_path / "p.jsonl", ["x" * 3000])  # 3,000 byte tokens: past 512 positions
    argv = ["model=hf", f"model.name_or_path={ckpt}", "workload=jsonl", f"workload.path={prompts}"]
    argv += ["workload.chat=false", "generation.max_new_tokens=8", f"output_dir={tmp_path / 'run'}"]
    capsys.readouterr()  # the fixture's own progress bars
    assert run_main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("harness: compiling")]
    assert len(err) == 1 and "3,000 prompt tokens" in err[0] and "positions of the target" in err[0]


def test_weights_of_another_shape_than_the_config_s_are_named_in_the_harness_s_words(tmp_path):
    """A config.json whose intermediate_size disagreed with the weights was refused with transformers'
    load-report rows ("MISMATCH Reinit due to size mismatch - ckpt: torch.Size(...)"), which read as if
    the weights had been re-initialised."""
    import json

    from checkpoint_fixtures import tiny_checkpoint

    from harness.target.loading import CheckpointError, load_model

    path = tiny_checkpoint(tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = config["intermediate_size"] // 2
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as err:
        load_model(name="hf", name_or_path=str(path))
    message = str(err.value)
    assert "the checkpoint's shape [" in message and "] is not the config's [" in message, message
    assert message.endswith("; check config.json against the weights") and "Reinit" not in message


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_kv_bytes_per_token_follow_falcon_s_key_value_heads_and_latent_attention_is_refused(tmp_path):
    """Falcon's multi-query layers cache one key/value head, its new decoder architecture
    num_kv_heads: the formula took one per attention head (4x here, 71x on Falcon-7B) and a run
    failed after its gates on "verify appended 256 KV bytes, expected 1024". DeepSeek's latent
    attention caches other sizes: refused before any model."""
    import torch
    from transformers import DeepseekV3Config, FalconConfig, FalconForCausalLM

    from harness.target.backend import cache_bytes, kv_bytes_per_token
    from harness.target.kv_cache import kv_head_count, new_cache
    from harness.target.loading import cache_layer_problem

    small = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    for config, heads in (
        (FalconConfig(**small, multi_query=True, new_decoder_architecture=False), 1),
        (FalconConfig(**small, new_decoder_architecture=True, num_kv_heads=2), 4),
        (FalconConfig(**small, multi_query=False, new_decoder_architecture=False), 4),
    ):
        assert kv_head_count(config) == heads
        torch.manual_seed(0)
        model = FalconForCausalLM(config).eval()
        cache = new_cache(model.config, preallocated=False)
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3]]), past_key_values=cache, use_cache=True)
            before = cache_bytes(cache)
            model(input_ids=torch.tensor([[4]]), past_key_values=cache, use_cache=True)
        assert kv_bytes_per_token(model) == cache_bytes(cache) - before == 2 * 2 * heads * 16 * 4
    DeepseekV3Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        q_lora_rank=None,
    ).save_pretrained(tmp_path / "deepseek")
    problem = cache_layer_problem(compose(["model=hf", f"model.name_or_path={tmp_path / 'deepseek'}"]).model, "k")
    assert problem is not None and "multi-head latent attention (kv_lora_rank)" in problem


def test_generation_stops_at_the_end_of_turn_ids_the_generation_config_lists(tmp_path):
    """An instruct model's end-of-turn token is often in generation_config.json only (transformers'
    generate stops there); the harness read the config's and the tokenizer's EOS only, so a run went past
    the end of a turn to max_new_tokens and fed the continuation into the next turn."""
    from transformers import GenerationConfig

    from harness.target.loading import build_tiny_model, eos_ids

    model = build_tiny_model(seed=0)
    model.config.eos_token_id = 2
    model.generation_config = GenerationConfig(eos_token_id=[2, 4])
    assert eos_ids(model) == {2, 4}
    model.generation_config = GenerationConfig(eos_token_id=7)
    assert eos_ids(model) == {2, 7}


def custom_code_checkpoint(path):
    """A tiny checkpoint whose config.json names modelling code of its own (``auto_map``)."""
    import json

    tiny_checkpoint(path)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "mytiny"
    config["auto_map"] = {"AutoConfig": "conf_my.MyConfig", "AutoModelForCausalLM": "mod_my.MyModel"}
    (path / "config.json").write_text(json.dumps(config))
    (path / "conf_my.py").write_text(
        "from transformers import LlamaConfig\nclass MyConfig(LlamaConfig):\n    model_type='mytiny'\n"
    )
    (path / "mod_my.py").write_text(
        "from transformers import LlamaForCausalLM\nfrom .conf_my import MyConfig\n"
        "class MyModel(LlamaForCausalLM):\n    config_class=MyConfig\n"
    )
    return path


def test_a_checkpoint_with_its_own_code_is_refused_naming_the_override_that_runs_it(tmp_path):
    """transformers' refusal was cut at 300 characters, before its hint, and the line never named the
    harness option that allows the code to run."""
    from omegaconf import OmegaConf

    from harness.target.loading import load_model, model_geometry, remote_code_option

    path = custom_code_checkpoint(tmp_path / "custom")
    hint = "Please pass the argument `trust_remote_code=True` to allow custom code to be run."
    model_cfg = OmegaConf.create({"name": "hf", "name_or_path": str(path), "trust_remote_code": False, "tiny": None})
    with pytest.raises(CheckpointError) as planned:
        model_geometry(model_cfg)
    with pytest.raises(CheckpointError) as loaded:
        load_model(name="hf", name_or_path=str(path), trust_remote_code=False)
    for err, option in ((planned, "set model.trust_remote_code=true to run it"), (loaded, "model.trust_remote_code")):
        message = str(err.value)
        assert option in message and message.rstrip(")").endswith(hint) and "\n" not in message
    assert "proposer.model.trust_remote_code=true" in str(loaded.value)  # a draft's, where the option is not known
    assert remote_code_option("proposer.draft_model.model.name_or_path") == (
        "proposer.draft_model.model.trust_remote_code=true"
    )
