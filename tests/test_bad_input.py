"""Bad input is refused in one line, before any model work, and leaves nothing behind.

* every numeric option has a declared range, checked with the key, the value and the range in
  the message;
* every command reports a refusal as one line and a non-zero exit, a traceback only when asked;
* a draft model's config is its own copy: an override of one side never changes the other;
* every suggestion a refusal offers is one the runner accepts (composed and planned here).

tests/README.md tables each refused input, its message and the test that covers it.
"""

import dataclasses
import errno
import json
import math
import re
import typing
from pathlib import Path

import pytest
import torch
from checkpoint_fixtures import byte_tokenizer, tiny_checkpoint
from hydra.core.config_store import ConfigStore
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf

import harness.runner as runner
import harness.target.loading as loading
from harness import cli
from harness.app import run_main
from harness.config import SCHEMAS, Config, ModelConfig, apply_overrides, checked_plan, compose, group_options, offer
from harness.contracts import ConfigError, Range
from harness.engine.build import plan
from harness.verifiers.base import NegotiationError

PROMPTS = [
    {"id": "p0", "category": "code", "prompt": "def add(a, b):\n    return a + b\n"},
    {"id": "p1", "category": "code", "prompt": "for i in range(3):\n    print(i)\n"},
]


@pytest.fixture
def workload(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    return path


@pytest.fixture
def no_models(monkeypatch):
    """Any model, tokenizer or checkpoint config load fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"model work before the refusal: {args} {kwargs}")

    monkeypatch.setattr(runner, "load_model", refuse)
    monkeypatch.setattr(loading, "from_pretrained", refuse)
    monkeypatch.setattr(loading, "build_tiny_model", refuse)


#: a sampled run the default proposer takes: the statistical gate (and its chi-square options) runs
SAMPLED = ("generation.temperature=0.7", "verifier=membership")


def argv_for(tmp_path: Path, workload: Path, *overrides: str) -> list[str]:
    return [
        "model=tiny",
        "workload=jsonl",
        f"workload.path={workload}",
        "workload.chat=false",
        "generation.max_new_tokens=4",
        "generation.warmup_tokens=1",
        "threads=1",
        f"hydra.run.dir={tmp_path / 'hydra'}",
        f"output_dir={tmp_path / 'run'}",
        *overrides,
    ]


def one_line(capsys, prefix: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert lines[0].startswith(prefix), lines[0]
    return lines[0]


def assert_refused_run(tmp_path, capsys, argv, *fragments) -> str:
    """`harness run argv` exits 2 with one line holding every fragment, and writes nothing."""
    assert run_main(argv) == 2
    line = one_line(capsys, "harness run: refused: ")
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    assert not (tmp_path / "hydra").exists(), "Hydra's run folder was created"
    assert not (tmp_path / "run").exists(), "the output folder was created"
    return line


def suggestions_in(line: str) -> list[list[str]]:
    """The override sets after "; try " in a refusal line."""
    if "; try " not in line:
        return []
    return [s.split() for s in line.split("; try ", 1)[1].split(" or ")]


def accepted(overrides: list[str]) -> None:
    """The runner accepts ``overrides``: they compose and plan (no model)."""
    plan(compose(overrides))


# --------------------------------------------------------------------------- values checked at compose time


def numeric(tp) -> bool:
    """int or float, optional or inside a list / dict."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, list, dict):
        return any(numeric(a) for a in typing.get_args(tp) if a is not type(None))
    return tp in (int, float)


def schema_fields():
    seen, out = set(), []
    todo = [Config] + [cls for group in SCHEMAS.values() for cls in group.values()]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                todo.append(tp)
            else:
                out.append((cls, f, tp))
    return out


@pytest.mark.parametrize("proposer", ["hydra", "eagle", "early_exit"])
def test_a_training_data_source_of_no_kind_is_refused_before_model_work(
    tmp_path, capsys, workload, no_models, proposer
):
    """A misspelt source loaded the target and said its heads were training before it was refused."""
    from harness.heads.recipes import DataRecipe

    line = assert_refused_run(
        tmp_path, capsys, argv_for(tmp_path, workload, f"proposer={proposer}", "proposer.data.source=bogus")
    )
    assert "proposer.data.source" in line and "bogus" in line and "sharegpt" in line, line
    with pytest.raises(ValueError, match=r"data.source must be one of \['sharegpt', 'inline'\]; got 'bogus'"):
        DataRecipe(source="bogus")


def test_every_numeric_option_declares_a_range():
    missing = [
        f"{cls.__name__}.{f.name}"
        for cls, f, tp in schema_fields()
        if numeric(tp) and not isinstance(f.metadata.get("range"), Range)
    ]
    assert not missing, f"numeric options without a declared range: {missing}"


def test_every_default_lies_in_its_range():
    interpolated = []
    for cls, f, _ in schema_fields():
        spec = f.metadata.get("range")
        if spec is None:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if isinstance(default, str) and default.startswith("${"):  # an interpolation: checked as composed
            interpolated.append(f"{cls.__name__}.{f.name}")
            continue
        spec.check(f"{cls.__name__}.{f.name}", default)  # raises when a default is out of its own range
    assert interpolated == ["ModelConfig.dtype"]
    for device in ("cpu", "cuda", "cuda:1", "mps"):  # the model's dtype default, for every device kind
        cfg = compose([f"model.device={device}"])
        ModelConfig.__dataclass_fields__["dtype"].metadata["range"].check("model.dtype", cfg.model.dtype)


@pytest.mark.parametrize(
    "overrides,fragments",
    [
        (["generation.max_new_tokens=0"], ["generation.max_new_tokens=0", ">= 1"]),
        (["generation.max_new_tokens=-5"], ["generation.max_new_tokens=-5", ">= 1"]),
        (["workload.limit=-1"], ["workload.limit=-1", ">= 1"]),
        (["workload.limit=0"], ["workload.limit=0", ">= 1"]),
        (["gates.chi2_alpha=5"], ["gates.chi2_alpha=5.0", "in (0, 1)"]),
        (["gates.chi2_samples=0"], ["gates.chi2_samples=0", ">= 1"]),
        (["gates.chi2_samples=20", *SAMPLED], ["gates.chi2_samples=20", "chi2_top_m=8", ">= 45"]),
        # a chi-square test binning more tokens than the target's vocabulary has
        (
            ["model=tiny", "gates.chi2_top_m=97", *SAMPLED],
            ["gates.chi2_top_m=97 exceeds the target's vocabulary (96 tokens, model.tiny.vocab_size)"],
        ),
        (
            ["gates.chi2_top_m=49153", "gates.chi2_samples=500000", *SAMPLED],
            ["gates.chi2_top_m=49153 exceeds the target's vocabulary (49152 tokens, model=smollm2)"],
        ),
        (["gates.chi2_top_m=500000000000000000000000"], ["gates.chi2_top_m=500000000000000000000000", "[1, 262144]"]),
        (["generation.temperature=-0.1"], ["generation.temperature=-0.1", ">= 0"]),
        (["generation.temperature=nan"], ["generation.temperature=nan is not a finite number", ">= 0"]),
        (["generation.temperature=inf"], ["generation.temperature=inf is not a finite number: it must be >= 0"]),
        (["generation.top_p=0"], ["generation.top_p=0.0", "in (0, 1]"]),
        (["generation.top_p=1.5"], ["generation.top_p=1.5", "in (0, 1]"]),
        (["generation.top_k=-1"], ["generation.top_k=-1", ">= 0"]),
        (["generation.batch_size=0"], ["generation.batch_size=0", ">= 1"]),
        (["generation.temp_kv_budget_bytes=0"], ["generation.temp_kv_budget_bytes=0", ">= 1"]),
        (["topology.max_nodes=0"], ["topology.max_nodes=0", ">= 1"]),
        (["topology=expansion", "topology.widths=[2,0]"], ["topology.widths=[2,0]", "topology.widths[1]=0"]),
        (["gates.near_tie_max_fraction=2"], ["gates.near_tie_max_fraction=2.0", "in [0, 1]"]),
        (["proposer=early_exit", "proposer.eta=1.0"], ["proposer.eta=1.0", "in [0, 1)"]),
        (["proposer.min_ngram=4"], ["proposer.min_ngram=4", "proposer.max_ngram=3"]),
        (["model.dtype=float8"], ["model.dtype=float8", "one of"]),
        (["model=tiny", "model.tiny.vocab_size=3"], ["model.tiny.vocab_size=3", ">= 4"]),
        (["model=tiny", "model.tiny.num_heads=3"], ["model.tiny.hidden_size=32", "num_heads=3"]),
        (["model=tiny", "model.tiny.rms_norm_eps=0"], ["model.tiny.rms_norm_eps=0.0", "> 0"]),
        (["model=tiny", "model.tiny.rope_theta=-1"], ["model.tiny.rope_theta=-1.0", "> 0"]),
        (["threads=0"], ["threads=0", "in [1, 4096]"]),
        # a whole number beyond int64 passed every range and failed mid-run in a native op
        (
            ["proposer.max_ngram=9223372036854775808"],
            ["proposer.max_ngram=9223372036854775808 is out of range: it must be in [1, 9223372036854775807]"],
        ),
        (
            ["topology=expansion", "topology.widths=[2,9223372036854775808]"],
            ["topology.widths[1]=9223372036854775808 is out of range; each must be in [1, 9223372036854775807]"],
        ),
        (["threads=100000"], ["threads=100000 is out of range: it must be in [1, 4096]"]),
        (["seed=-1"], ["seed=-1", "in [0, 4294967295]"]),
        (["seed=9223372036854775807"], ["seed=9223372036854775807", "in [0, 4294967295]"]),
        (["+foo=1"], ["foo is no option"]),
    ],
)
def test_out_of_range_values_are_refused_with_key_value_and_range(overrides, fragments):
    with pytest.raises(ConfigError) as info:
        plan(compose(overrides))
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


@pytest.mark.parametrize(
    "overrides",
    [
        ["generation.max_new_tokens=1"],
        ["workload.limit=1"],
        ["gates.chi2_alpha=0.5", "gates.chi2_samples=45"],
        ["generation.top_p=1.0", "generation.top_k=0", "generation.temperature=0"],
        ["gates.near_tie_max_fraction=0"],
        ["proposer.max_ngram=9223372036854775807"],
        ["threads=4096"],
        ["gates.chi2_top_m=262144", "gates.chi2_samples=1310725"],
        ["model=tiny", "gates.chi2_top_m=96", "gates.chi2_samples=485", *SAMPLED],
        # at temperature 0, or with no gate, no statistical gate runs: its options are inert, not refused
        ["gates.chi2_samples=20"],
        ["model=tiny", "gates.chi2_top_m=200"],
        ["gates.chi2_samples=20", "gates.enabled=false", *SAMPLED],
    ],
)
def test_range_boundaries_are_accepted(overrides):
    accepted(overrides)


def int_typed(tp) -> bool:
    """int, optional or inside a list / dict (no float beside it)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, list, dict):
        return any(int_typed(a) for a in typing.get_args(tp) if a is not type(None))
    return tp is int


def test_every_whole_number_option_ends_at_int64_or_below():
    """An integer option without an upper bound took any whole number, 2**63 included, which failed
    mid-run in a native op (a prompt-lookup n-gram length, after 26 s of model work)."""
    checked = 0
    for cls, f, tp in schema_fields():
        spec = f.metadata.get("range")
        if not int_typed(tp) or spec is None:
            continue
        as_dict = typing.get_origin(tp) is dict  # an item of a list or a dict: the bound applies to each
        wrap = (lambda v: {"k": v}) if as_dict else (lambda v: [v]) if spec.each else (lambda v: v)
        name = f"{cls.__name__}.{f.name}"
        with pytest.raises(ConfigError, match=r"out of range") as info:
            spec.check(name, wrap(2**63))
        bound = re.search(r"(\d+)[\])]$", str(info.value))
        assert bound and int(bound.group(1)) <= 2**63 - 1, (name, str(info.value))
        if spec.le is None and spec.lt is None:
            assert "9223372036854775807" in str(info.value), (name, str(info.value))
            spec.check(name, wrap(2**63 - 1))
        checked += 1
    assert checked > 50


def test_a_float_option_takes_a_value_beyond_int64():
    """The whole-number bound is no bound on a float option."""
    accepted(["model=tiny", "model.tiny.rope_theta=1e20"])


def test_threads_beyond_the_bound_are_refused_before_any_thread_starts(tmp_path, workload, capsys, no_models):
    """threads=100000 passed its range and failed with a MemoryError when torch started the threads."""
    assert_refused_run(
        tmp_path,
        capsys,
        argv_for(tmp_path, workload, "threads=100000"),
        "threads=100000 is out of range: it must be in [1, 4096]",
    )


def test_chi2_top_m_far_beyond_any_vocabulary_is_refused_without_an_absurd_fix(tmp_path, workload, capsys, no_models):
    """A huge gates.chi2_top_m was offered gates.chi2_samples=500000000000000000000000 as its fix."""
    line = assert_refused_run(
        tmp_path,
        capsys,
        argv_for(tmp_path, workload, "gates.chi2_top_m=100000000000000000000000", *SAMPLED),
        "gates.chi2_top_m=100000000000000000000000 is out of range: it must be in [1, 262144]",
    )
    assert "chi2_samples" not in line and "; try" not in line, line
    line = assert_refused_run(
        tmp_path, capsys, argv_for(tmp_path, workload, "gates.chi2_top_m=1000", *SAMPLED), "exceeds the target's"
    )
    assert line.endswith("; try gates.chi2_top_m=96"), line


# --------------------------------------------------------------------------- one line, never a traceback

#: the quoting offered for a value with a single quote: double quotes, Hydra's inner ones escaped
SHELL_QUOTED_HINT = "quote a value holding characters such as # = ' [ ] or spaces: " + '"tracking.project=\\"it\'s\\""'


@pytest.mark.parametrize(
    "overrides,fragments",
    [
        (["generation.max_new_tokens=0"], ["generation.max_new_tokens=0", ">= 1"]),
        (["workload.limit=-1"], ["workload.limit=-1", ">= 1"]),
        (["workload.limit=0"], ["workload.limit=0", ">= 1"]),
        (["gates.chi2_alpha=5"], ["gates.chi2_alpha=5.0", "(0, 1)"]),
        (["gates.chi2_samples=0"], ["gates.chi2_samples=0"]),
        (["generation.max_new_tokenz=3"], ["no option 'max_new_tokenz'", "try generation.max_new_tokens=3"]),
        (["proposer=base_prompt_lookup"], ["proposer=base_prompt_lookup is no option", "prompt_lookup"]),
        (["+proposer.model.tiny.vocab_size=128", "proposer=draft_model"], ["without the leading '+'"]),
        # a config group the defaults list already selects, added with '+': the key path's refusal
        (["+experiment=default"], ["experiment is already in the config: set it without the leading '+' (experiment="]),
        (["+verifier=membership"], ["verifier is already in the config: set it without the leading '+' (verifier="]),
        (["+experiment=default", "experiment=default"], ["experiment is given more than once", "give it once"]),
        (["generation.exact=2"], ["generation.exact=2: expected true or false"]),  # OmegaConf reads 2 as true
        # a value of the wrong type: the option and what it takes, not OmegaConf's merge error
        (["workload.categories=qa"], ["workload.categories=qa: workload.categories takes a list", "try "]),
        (["workload.per_category=abc"], ["workload.per_category=abc: expected a whole number"]),
        (["workload.per_category=1.5"], ["workload.per_category=1.5: expected a whole number"]),
        (["generation.temperature=hot"], ["generation.temperature=hot: expected a number"]),
        (["gates.enabled=maybe"], ["gates.enabled=maybe: expected true or false"]),
        (["workload.categories=[null]"], ["workload.categories=[null]: each element must be a str; got NoneType"]),
        (
            ["generation.batch_size=null"],
            ["generation.batch_size=null: generation.batch_size cannot be null; expected a whole number"],
        ),
        (
            ["generation.temperature=null"],
            ["generation.temperature=null: generation.temperature cannot be null; expected a number"],
        ),
        # an override Hydra's grammar cannot read: the override, the character, and the quoting that passes it
        (
            ["tracking.project=a#b"],
            ["tracking.project=a#b: Hydra's override grammar cannot read it at '#'", """'tracking.project="a#b"'"""],
        ),
        (["output_dir=a=b"], ["output_dir=a=b: Hydra's override grammar cannot read it (mismatched input '='"]),
        # no key before '=': Hydra said "Config group override must be a string or a list. Got int"
        (["=5"], ["=5: no key before '='; an override is key=value (e.g. seed=5)"]),
        (["smoke"], ["smoke: no '='; an override is key=value (e.g. seed=5)"]),
        # a schema option removed composed, then failed where it was read (KeyError, exit 1)
        (["~seed"], ["~seed: options cannot be removed; leave seed out for its default"]),
        (["~generation"], ["~generation: options cannot be removed"]),
        # a config group given a list: Hydra merged the options into one config, the last winning, and
        # one verifier was measured and recorded (its refusal of a,b offered exactly that list form)
        (
            ["verifier=[greedy,membership]"],
            [
                "verifier=[greedy,membership]: a run takes one verifier; to run one job for each, sweep them: "
                "harness run -m verifier=greedy,membership"
            ],
        ),
        (["model=[tiny]"], ["model=[tiny]: a run takes one model"]),
        (["proposer=[draft_model,prompt_lookup]"], ["a run takes one proposer"]),
        (["verifier=greedy,membership"], ["verifier=greedy,membership: a run takes one verifier; to run one job"]),
        (["seed=1,2"], ["seed=1,2: a run takes one value of seed; to run one job for each, sweep them"]),
        (
            ["topology=expansion", "topology.widths=2,2"],
            ["topology.widths=2,2: a list is written topology.widths=[2,2]; or, to run one job for each"],
        ),
        (
            ["tracking.project=it's"],
            [SHELL_QUOTED_HINT],
        ),
        (
            ["workload.limit=[1,2"],
            ["workload.limit=[1,2: Hydra's override grammar cannot read it (no viable alternative"],
        ),
        # a Sequoia profile's prefix and rows must fit the target's positions (it ran for minutes past them)
        (
            [
                "topology=sequoia",
                "proposer=draft_model",
                "proposer.sampling=without_replacement",
                "verifier=sequoia",
                "generation.temperature=0.7",
                "model.tiny.max_position_embeddings=256",
                "topology.profile.prefix_len=512",
            ],
            [
                "topology.profile.prefix_len=512 + 9 rows (topology.max_nodes and the root) exceed the 256 positions",
                "try topology.profile.prefix_len=247",
            ],
        ),
        # an artifact trained or searched for the run runs the target over its documents or search prompts:
        # they fit the positions as the run's prompts do (a short-context target was run past them)
        (
            ["proposer=eagle", "model.tiny.max_position_embeddings=100"],
            [
                "proposer.data.max_len=256 tokens per training document exceed the 100 positions of the target",
                "try proposer.data.max_len=100",
            ],
        ),
        (
            ["proposer=layer_skip", "model.tiny.max_position_embeddings=100"],
            [
                "proposer.search.max_prompt_tokens=96 + max_new_tokens=32 + depth=4 + 1 = 133 exceed the 100 positions",
                "try proposer.search.max_prompt_tokens=63",
            ],
        ),
        # a REST option above the datastore it builds (it was refused after building the datastore)
        (
            ["proposer=rest", "proposer.datastore.context_len=8"],
            [
                "proposer.max_suffix=16 exceeds proposer.datastore.context_len=8: a datastore built so serves",
                "try proposer.max_suffix=8 or proposer.datastore.context_len=16",
            ],
        ),
        # what a proposer trains or searches on is never the split the run evaluates
        (
            ["proposer=medusa", "topology=cartesian", "workload=sharegpt", "workload.split=train"],
            ["proposer.data.split=train is the split this run evaluates (workload=sharegpt workload.split=train)"],
        ),
        (
            ["proposer=eagle", "workload=sharegpt", "proposer.data.split=eval"],
            ["proposer.data.split=eval is the split this run evaluates", "train on the prompts it is measured on"],
        ),
        (
            ["proposer=medusa", "topology=cartesian", "proposer.data.held_out_split=train"],
            ["proposer.data.held_out_split=train is the training split (proposer.data.split)"],
        ),
        # a held-out budget (or window) below one training row's 3 tokens: an artifact with no held-out
        # evaluation (all None) was written with nothing said
        (
            ["proposer=medusa", "topology=cartesian", "proposer.data.held_out_tokens=2"],
            ["proposer.data.held_out_tokens=2 is out of range: it must be >= 3"],
        ),
        (["proposer=eagle", "proposer.data.max_len=2"], ["proposer.data.max_len=2 is out of range: it must be >= 3"]),
        # a training budget below one document's 3 tokens: the whole split was read for no training row
        (
            ["proposer=medusa", "topology=cartesian", "proposer.data.token_budget=2"],
            ["proposer.data.token_budget=2 is out of range: it must be >= 3"],
        ),
        (
            ["proposer=layer_skip", "workload=sharegpt", "proposer.search.split=eval"],
            ["proposer.search.split=eval is the split this run evaluates", "choose its layers on the prompts"],
        ),
    ],
)
def test_harness_run_refuses_bad_values_in_one_line_and_writes_nothing(
    tmp_path, workload, capsys, no_models, overrides, fragments
):
    assert_refused_run(tmp_path, capsys, argv_for(tmp_path, workload, *overrides), *fragments)


def test_a_chat_template_file_that_is_missing_is_refused_alone_not_after_a_note_calling_it_inert(
    tmp_path, workload, capsys, no_models
):
    """model=tiny has no tokenizer, so a chat template changes nothing there and is noted as such;
    a template file that does not exist is refused all the same, and that refusal is the one line."""
    missing = tmp_path / "nonexistent.jinja"
    line = assert_refused_run(
        tmp_path,
        capsys,
        argv_for(tmp_path, workload, f"workload.chat_template={missing}"),
        f"workload.chat_template={missing}: no such file; give vicuna or a Jinja file",
    )
    assert "no effect" not in line


@pytest.mark.parametrize("given", ["proposer.datastore.path", "+proposer.datastore.path"])
def test_a_key_below_the_lookup_s_null_datastore_is_refused_naming_it_and_the_documented_form(
    tmp_path, workload, capsys, no_models, given
):
    store = tmp_path / "store"
    override = f"{given}={store}"
    argv = argv_for(tmp_path, workload, "proposer=prompt_lookup", override)
    line = assert_refused_run(
        tmp_path,
        capsys,
        argv,
        f"{override}: proposer.datastore is null in this config, so proposer.datastore.path cannot be set",
        f"+datastore@proposer.datastore=stdlib proposer.datastore.path={store}",
    )
    assert "AssertionError" not in line
    fixes = suggestions_in(line)
    assert fixes and all("+datastore@proposer.datastore=stdlib" in fix for fix in fixes)
    for fix in fixes:
        assert "proposer.datastore=null" not in fix  # no fix that composes the datastore and drops it again
        accepted(apply_overrides(argv, tuple(fix)))


def test_any_key_set_below_a_null_node_is_refused_naming_the_override(tmp_path, workload, capsys, no_models):
    argv = argv_for(tmp_path, workload, "proposer=prompt_lookup", "proposer.verify_cost.first=1.0")
    assert_refused_run(
        tmp_path,
        capsys,
        argv,
        "proposer.verify_cost.first=1.0: proposer.verify_cost is null in this config, so "
        "proposer.verify_cost.first cannot be set; give proposer.verify_cost a value first",
    )


def test_an_artifact_trained_here_given_by_path_is_checked_for_the_split_it_trained_on(
    tmp_path, workload, capsys, no_models
):
    """The split check was skipped for any proposer.artifact, taken for a published checkpoint; one
    trained here (a folder with its manifest) matches the configured recipe, so it trained on
    proposer.data.split: heads trained on the eval split were measured on it with nothing said."""
    trained = tmp_path / "medusa-artifact"
    trained.mkdir()
    (trained / "manifest.json").write_text("{}")
    argv = argv_for(
        tmp_path,
        workload,
        "proposer=medusa",
        "topology=cartesian",
        "workload=sharegpt",
        "proposer.data.split=eval",
        f"proposer.artifact={trained}",
    )
    assert_refused_run(tmp_path, capsys, argv, "proposer.data.split=eval is the split this run evaluates")


def test_missing_checkpoint_path(tmp_path, workload, capsys, no_models):
    missing = tmp_path / "no-such-checkpoint"
    argv = argv_for(tmp_path, workload, "model=hf", f"model.name_or_path={missing}")
    assert_refused_run(tmp_path, capsys, argv, f"model.name_or_path={missing}", "no such checkpoint folder")


def test_broken_config_json(tmp_path, workload, capsys, no_models):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "llama",')
    argv = argv_for(tmp_path, workload, "model=hf", f"model.name_or_path={ckpt}")
    assert_refused_run(tmp_path, capsys, argv, f"model.name_or_path={ckpt}", "config.json is not valid JSON")


def test_hf_without_a_path_is_refused_without_asking_the_hub(tmp_path, workload, capsys, no_models):
    assert_refused_run(tmp_path, capsys, argv_for(tmp_path, workload, "model=hf"), "model=hf needs model.name_or_path")


def test_a_draft_with_hf_and_no_path_is_refused_naming_the_draft(tmp_path, workload, capsys, no_models):
    argv = argv_for(tmp_path, workload, "proposer=draft_model", "proposer.model.name=hf")
    assert_refused_run(tmp_path, capsys, argv, "proposer.model.name=hf needs proposer.model.name_or_path")


def test_cuda_without_cuda_is_refused_and_cpu_suggested(tmp_path, workload, capsys, no_models, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = assert_refused_run(
        tmp_path, capsys, argv_for(tmp_path, workload, "model.device=cuda"), "model.device=cuda", "no CUDA device"
    )
    assert suggestions_in(line) == [["model.device=cpu"]]


@pytest.mark.parametrize("attention", ["flex_attention", "flash_attention_2"])
def test_an_attention_implementation_no_tree_mask_reaches_is_refused(tmp_path, workload, capsys, no_models, attention):
    """flex_attention ran the verify forward into heap corruption (the process aborted)."""
    line = assert_refused_run(
        tmp_path,
        capsys,
        argv_for(tmp_path, workload, f"model.attn_implementation={attention}"),
        f"model.attn_implementation={attention}: a verify forward gives each candidate row its own attention mask, "
        "which only sdpa, harness_sdpa, eager take",
    )
    assert suggestions_in(line) == [["model.attn_implementation=sdpa"]]


def test_a_misspelt_attention_implementation_is_named_as_such(tmp_path, workload, capsys, no_models):
    """A typo was refused as a real kernel that takes no tree masks."""
    line = assert_refused_run(
        tmp_path,
        capsys,
        argv_for(tmp_path, workload, "model.attn_implementation=spda"),
        "model.attn_implementation=spda is no attention implementation transformers knows; a run takes sdpa, "
        "harness_sdpa, eager",
    )
    assert suggestions_in(line) == [["model.attn_implementation=sdpa"]]


def test_a_model_without_attention_heads_is_refused_by_its_config(tmp_path):
    from transformers import MambaConfig

    from harness.config import compose
    from harness.target.loading import CheckpointError, model_geometry

    MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2).save_pretrained(tmp_path / "mamba")
    cfg = compose(["model=hf", f"model.name_or_path={tmp_path / 'mamba'}"])
    with pytest.raises(CheckpointError, match=r"a MambaConfig has no num_attention_heads: the harness verifies"):
        model_geometry(cfg.model)


def test_a_model_whose_layers_differ_in_shape_is_refused_by_its_config(tmp_path, workload, capsys):
    """A Gemma 4 config gives some layers a head width of their own: reading its one head_dim raised
    transformers' AmbiguousGlobalPerLayerAttributeError (an error line naming no option), and the KV
    sizing assumes one geometry. Such a config is refused by name when its config is read."""
    pytest.importorskip("transformers.models.gemma4")
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    from harness.config import compose
    from harness.target.loading import CheckpointError, model_geometry

    Gemma4TextConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=64,
        max_position_embeddings=512,
    ).save_pretrained(tmp_path / "gemma4")
    cfg = compose(["model=hf", f"model.name_or_path={tmp_path / 'gemma4'}"])
    with pytest.raises(CheckpointError, match=r"a Gemma4TextConfig whose layers differ in head_dim \(a per-layer"):
        model_geometry(cfg.model)
    line = assert_refused_run(
        tmp_path,
        capsys,
        argv_for(tmp_path, workload, "model=hf", f"model.name_or_path={tmp_path / 'gemma4'}"),
        "gemma4",
    )
    assert "whose layers differ in head_dim" in line


def test_a_device_torch_does_not_know_is_refused(tmp_path, workload, capsys, no_models):
    assert_refused_run(tmp_path, capsys, argv_for(tmp_path, workload, "model.device=gpu0"), "model.device='gpu0'")


@pytest.mark.parametrize(
    "line,fragment",
    [
        ({"id": "a", "prompt": None}, '"prompt" must be a string; got null'),
        ({"id": "a", "prompt": 42}, '"prompt" must be a string; got 42'),
        ({"id": "a", "messages": [{"role": "user", "content": 7}]}, '"messages" must be a non-empty list'),
        ({"id": None, "prompt": "x"}, '"id" must be a non-empty string or an integer'),
        ({"id": "", "prompt": "x"}, '"id" must be a non-empty string or an integer; got ""'),
        # a blank id ran the whole job and was refused only when its record was written
        ({"id": "  ", "prompt": "x"}, '"id" must be a non-empty string or an integer; got "  "'),
        ({"id": "a", "prompt": ""}, "\"prompt\" of id 'a' is empty: there is nothing to continue"),
        ({"id": "a", "prompt": "  \n"}, "\"prompt\" of id 'a' is empty"),
    ],
)
def test_jsonl_prompts_of_the_wrong_type(tmp_path, capsys, no_models, line, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(PROMPTS[0]) + "\n" + json.dumps(line) + "\n")
    assert_refused_run(tmp_path, capsys, argv_for(tmp_path, path), f"{path}:2:", fragment)


@pytest.mark.parametrize(
    "line,fragment",
    [
        ('{"id": "b", "prompt": "x", "reference": NaN}', "NaN is not JSON (a number must be finite)"),
        ('{"id": "b", "prompt": "x", "id": "c"}', "key 'id' is given twice in one object"),
    ],
)
def test_prompt_lines_json_does_not_allow_are_refused(tmp_path, capsys, no_models, line, fragment):
    """Python's JSON reader takes NaN and a key given twice (the last one won, silently)."""
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(PROMPTS[0]) + "\n" + line + "\n")
    assert_refused_run(tmp_path, capsys, argv_for(tmp_path, path), f"{path}:2: {fragment}")


def test_a_null_split_puts_a_line_in_every_split(tmp_path):
    """A line's split, when given, names its split; null was compared with the asked split and dropped the
    line from every one."""
    from harness.workloads.prompts import load_jsonl

    path = tmp_path / "q.jsonl"
    path.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y", "split": null}\n')
    for split in ("eval", "calibration", "train"):
        assert [p.prompt_id for p in load_jsonl(str(path), split)] == ["a", "b"]


def test_a_prompt_file_that_is_not_utf8_names_its_line_and_column(tmp_path, capsys, no_models):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(PROMPTS[0]).encode() + b"\n" + '{"id": "b", "prompt": "caf\u00e9"}'.encode("latin-1"))
    line = assert_refused_run(tmp_path, capsys, argv_for(tmp_path, path), f"{path}:2: not UTF-8 text")
    assert "(byte 0xe9 at column 27)" in line and line.endswith("save the file as UTF-8")


@pytest.mark.parametrize(
    "line",
    ['{"id": "b", "prompt": "x \\ud800 y"}', '{"question_id": 1, "category": "qa", "turns": ["\\ud800"]}'],
)
def test_half_a_surrogate_pair_in_a_prompt_file_is_refused_naming_its_line(tmp_path, capsys, no_models, line):
    """Valid JSON, but no character: the tokenizer failed on it after the model loaded."""
    path = tmp_path / "q.jsonl"
    first = json.dumps(PROMPTS[0]) if '"id"' in line else '{"question_id": 0, "category": "qa", "turns": ["hi"]}'
    path.write_text(first + "\n" + line + "\n")
    argv = [a if '"id"' in line or a != "workload=jsonl" else "workload=spec_bench" for a in argv_for(tmp_path, path)]
    assert_refused_run(
        tmp_path,
        capsys,
        argv,
        f"{path}:2: holds \\ud800, half of a UTF-16 surrogate pair with no other half (no character); "
        "fix or remove that escape",
    )


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("", "holds no prompts (workload=spec_bench workload.path=<path>): it is empty or every line is blank"),
        ("\n  \n", "holds no prompts"),
        (
            '{"question_id": 1, "category": "qa", "turns": "hello"}\n',
            ':1: question 1: "turns" must be a list of user messages; got a str (write "turns": ["hello"])',
        ),
        (  # the leakage gate checked the object's Python spelling as the reference answer
            '{"question_id": 1, "category": "qa", "turns": ["hi"], "reference": {"a": 1}}\n',
            ':1: question 1: "reference" must be a string, a number or a list of them; got {"a": 1}',
        ),
        (
            '{"question_id": 2, "category": "qa", "turns": ["hi"], "reference": ["4", true]}\n',
            ':1: question 2: "reference" must be a string, a number or a list of them; got true',
        ),
        (
            '{"question_id": " ", "category": "qa", "turns": ["hi"]}\n',
            '"question_id" must be an integer or a non-empty',
        ),
    ],
)
def test_a_spec_bench_file_without_questions_or_with_a_bare_turn(tmp_path, capsys, no_models, text, fragment):
    path = tmp_path / "question.jsonl"
    path.write_text(text)
    argv = [*argv_for(tmp_path, path), "workload=spec_bench"]
    assert_refused_run(tmp_path, capsys, argv, str(path), fragment.replace("<path>", str(path)))


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (
            ["proposer=medusa", "topology=choices", "topology.choices=[[0],[200]]"],
            "topology.choices asks for 201 children of one node (rank 200) but the target's vocabulary has 96 tokens "
            "(model=tiny)",
        ),
        (
            ["proposer=medusa", "topology=expansion", "topology.widths=[100]", "topology.max_nodes=100"],
            "topology.widths asks for 100 children of one node (its widest level)",
        ),
    ],
)
def test_a_tree_wider_than_the_vocabulary_is_refused_before_any_training(
    tmp_path, workload, capsys, no_models, overrides, fragment
):
    assert_refused_run(tmp_path, capsys, argv_for(tmp_path, workload, *overrides), fragment)


def test_a_sequoia_search_too_large_for_memory_is_refused_before_calibration(tmp_path, workload, capsys, no_models):
    argv = argv_for(
        tmp_path,
        workload,
        "proposer=draft_model",
        "topology=sequoia",
        "topology.max_nodes=20000",
        "topology.max_depth=100",
    )
    assert_refused_run(
        tmp_path,
        capsys,
        argv,
        "topology.max_nodes=20000 topology.max_depth=100: the Sequoia DP over 8 ranks would hold",
    )


def test_a_sequoia_shape_search_too_large_for_memory_is_refused_before_calibration(
    tmp_path, workload, capsys, no_models
):
    """Bounds whose DP fits but whose search over tree shapes under the measured profile's draft
    costs does not passed negotiation, calibrated and profiled, and were refused at the tree stage
    (naming the DP's root-inclusive max_nodes=513)."""
    from harness.topology.sequoia import DP_TABLE_LIMIT_BYTES, dp_table_bytes, shape_search_bytes

    assert dp_table_bytes(513, 512, 8) <= DP_TABLE_LIMIT_BYTES < shape_search_bytes(513, 512)
    argv = argv_for(
        tmp_path,
        workload,
        "proposer=draft_model",
        "topology=sequoia",
        "topology.max_nodes=512",
        "topology.max_depth=512",
        "topology.profile.prefix_len=514",
    )
    assert_refused_run(
        tmp_path,
        capsys,
        argv,
        "topology.max_nodes=512 topology.max_depth=512: the search over tree shapes under the profile's draft "
        "costs would hold 2.0 GiB",
    )


def test_a_sequoia_min_nodes_above_its_max_is_refused_before_calibration(tmp_path, workload, capsys, no_models):
    argv = argv_for(tmp_path, workload, "proposer=draft_model", "topology=sequoia", "topology.min_nodes=20")
    line = assert_refused_run(
        tmp_path,
        capsys,
        argv,
        "topology.min_nodes=20 exceeds topology.max_nodes + 1 = 9 (min_nodes counts the root, max_nodes the "
        "candidate rows): the search would have no size to try",
    )
    assert suggestions_in(line) == [["topology.min_nodes=9"], ["topology.max_nodes=19"]]
    for suggestion in suggestions_in(line):
        accepted(["proposer=draft_model", "topology=sequoia", "topology.min_nodes=20", *suggestion])


def test_a_sequoia_min_nodes_no_tree_of_the_depth_can_hold_is_refused_before_calibration(
    tmp_path, workload, capsys, no_models
):
    """Three ranks below each node and depth 1: at most 4 nodes, so min_nodes=6 leaves the search nothing
    to try; refused before the calibration and the profile are measured (it was refused after)."""
    over = ("proposer=draft_model", "topology=sequoia", "topology.max_depth=1", "topology.calibration.branches=3")
    line = assert_refused_run(
        tmp_path,
        capsys,
        argv_for(tmp_path, workload, *over, "topology.min_nodes=6"),
        "topology.min_nodes=6: a tree of depth <= topology.max_depth=1 with at most "
        "topology.calibration.branches=3 children per node holds at most 4 nodes",
    )
    assert suggestions_in(line) == [["topology.min_nodes=4"], ["topology.max_depth=2"]]
    for suggestion in suggestions_in(line):
        accepted(["model=tiny", *over, "topology.min_nodes=6", *suggestion])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["topology.profile.prefix_len=1"], "topology.profile.prefix_len"),
        (["topology.max_depth=6", "topology.profile.prefix_len=5"], "topology.profile.prefix_len=5: the profile"),
    ],
)
def test_a_sequoia_profile_prefix_too_short_for_its_timings_is_refused_before_calibration(
    tmp_path, workload, capsys, no_models, overrides, message
):
    assert_refused_run(
        tmp_path,
        capsys,
        argv_for(tmp_path, workload, "proposer=draft_model", "topology=sequoia", *overrides),
        message,
    )


def test_a_batch_larger_than_the_workload_is_refused_and_the_fitting_size_offered(
    tmp_path, workload, capsys, no_models
):
    line = assert_refused_run(
        tmp_path,
        capsys,
        argv_for(tmp_path, workload, "generation.batch_size=4"),
        "generation.batch_size=4 exceeds the workload's 2 prompt(s): no batch would be full",
    )
    assert suggestions_in(line) == [["generation.batch_size=2"]]
    accepted(["model=tiny", "workload=jsonl", f"workload.path={workload}", "generation.batch_size=2"])


def test_a_cache_variable_pointing_at_a_file_is_refused_naming_it(tmp_path, workload, capsys, monkeypatch):
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "afile" / "cache"))
    assert run_main(argv_for(tmp_path, workload)) == 2
    line = one_line(capsys, "harness run: refused: ")
    assert line.endswith(
        f"HARNESS_CACHE={tmp_path / 'afile' / 'cache'}: {tmp_path / 'afile'} is a file; the cache needs a folder "
        "there (set HARNESS_CACHE=<a folder>)"
    )
    assert not (tmp_path / "run" / "record.json").exists()


def test_a_sweep_s_folder_as_output_dir_is_refused(tmp_path, workload, capsys, no_models):
    """A single run into a sweep's root wrote a record the sweep's compare and report then counted
    beside its jobs."""
    sweep = tmp_path / "multirun" / "smoke"
    sweep.mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    argv = argv_for(tmp_path, workload, f"output_dir={sweep}")
    assert_refused_run(tmp_path, capsys, argv, f"output_dir={sweep} is a sweep's folder (it holds multirun.yaml)")
    assert sorted(p.name for p in sweep.iterdir()) == ["multirun.yaml"]
    # a datastore's (or a trained artifact's) folder: the run's files landed among its index files
    store = tmp_path / "datastore"
    store.mkdir()
    (store / "manifest.json").write_text("{}\n")
    argv = argv_for(tmp_path, workload, f"output_dir={store}")
    assert_refused_run(tmp_path, capsys, argv, f"output_dir={store} holds manifest.json, a datastore's or a trained")
    assert sorted(p.name for p in store.iterdir()) == ["manifest.json"]


def test_an_output_dir_inside_a_run_a_sweep_or_a_datastore_folder_is_refused(tmp_path, workload, capsys, no_models):
    """Only the folder itself was checked: a run below a run's folder was pooled with it by compare,
    one below a sweep's folder counted with its jobs, one below a datastore's sat among its files."""
    run = tmp_path / "run1"
    run.mkdir()
    (run / "record.json").write_text("{}\n")
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    store = tmp_path / "ds"
    store.mkdir()
    for name in ("manifest.json", "tokens.npy", "sa.npy"):
        (store / name).write_text("{}\n")
    for folder, message in (
        (run / "sub", f"is inside the run folder {run} (it holds record.json): harness compare and the store"),
        (sweep / "extra" / "deeper", f"is inside the sweep folder {sweep} (it holds multirun.yaml)"),
        (store / "inner", f"is inside the datastore {store} (it holds manifest.json and its index)"),
    ):
        line = assert_refused_run(tmp_path, capsys, argv_for(tmp_path, workload, f"output_dir={folder}"), message)
        assert (
            line.startswith(f"harness run: refused: output_dir={folder} ")
            and "give the run a folder of its own" in line
        )
        assert not folder.exists()
    assert sorted(p.name for p in run.iterdir()) == ["record.json"]
    assert sorted(p.name for p in sweep.iterdir()) == ["multirun.yaml"]
    assert sorted(p.name for p in store.iterdir()) == ["manifest.json", "sa.npy", "tokens.npy"]


def test_hydra_run_dir_is_checked_as_output_dir_is(tmp_path, workload, capsys, no_models):
    """A plain run's folder named by ``hydra.run.dir`` (no ``output_dir``) was not checked: a run
    below another run's folder was pooled with it, one into a folder of user files added to them.
    Refused before Hydra writes its files there; the run's own folder given again still runs."""
    run = tmp_path / "run1"
    run.mkdir()
    (run / "record.json").write_text("{}\n")
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    corpus = tmp_path / "corp"
    corpus.mkdir()
    (corpus / "f1.py").write_text("x = 1\n")
    base = [a for a in argv_for(tmp_path, workload) if not a.startswith(("hydra.run.dir=", "output_dir="))]
    for folder, message in (
        (run / "sub", f"is inside the run folder {run} (it holds record.json): harness compare and the store"),
        (sweep / "extra", f"is inside the sweep folder {sweep} (it holds multirun.yaml)"),
        (corpus, "holds files that are no run's (f1.py): give an empty or new folder"),
    ):
        line = assert_refused_run(tmp_path, capsys, [*base, f"hydra.run.dir={folder}"], message)
        assert line.startswith(f"harness run: refused: hydra.run.dir={folder} "), line
    assert sorted(p.name for p in run.iterdir()) == ["record.json"]
    assert sorted(p.name for p in sweep.iterdir()) == ["multirun.yaml"]
    assert sorted(p.name for p in corpus.iterdir()) == ["f1.py"]


def test_an_output_dir_above_other_runs_or_holding_other_files_is_refused(tmp_path, workload, capsys, no_models):
    """A record written above other runs' (a records root) was pooled with them; a folder of the user's
    own files (a datastore's corpus) had the run's files added to it."""
    root = tmp_path / "recs"
    (root / "a" / "run1").mkdir(parents=True)
    (root / "a" / "run1" / "record.json").write_text("{}\n")
    corpus = tmp_path / "corp"
    corpus.mkdir()
    (corpus / "f1.py").write_text("x = 1\n")
    for folder, message in (
        (root, "holds other runs' records below it (a/run1/record.json): harness compare and the store would count"),
        (corpus, "holds files that are no run's (f1.py): give an empty or new folder"),
    ):
        assert_refused_run(tmp_path, capsys, argv_for(tmp_path, workload, f"output_dir={folder}"), message)
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == ["a", "a/run1", "a/run1/record.json"]
    assert sorted(p.name for p in corpus.iterdir()) == ["f1.py"]


def test_an_output_dir_holding_a_run_s_own_files_is_run_again(tmp_path):
    """The folder of an earlier run (its record, outputs, Hydra files, log, lock, earlier files moved
    aside, W&B folder) is given again to run there again; a manifest.json above that is no
    datastore's (no index beside it) is someone else's file, not a refusal."""
    from functools import partial

    from harness.engine import checks
    from harness.runner import user_output_dir_problem

    check_output_dir = partial(checks.check_output_dir, user_folder_problem=user_output_dir_problem)
    (tmp_path / "manifest.json").write_text("{}\n")  # e.g. a project's own manifest
    run = tmp_path / "runs" / "r1"
    for sub in (".hydra/2026-01-01_00-00-00", ".previous/20260101T000000-abcdef", "wandb/offline-run-1"):
        (run / sub).mkdir(parents=True)
    for name in ("record.json", "outputs.jsonl", "rounds.jsonl", "app.log", ".harness.lock"):
        (run / name).write_text("{}\n")
    (run / ".previous" / "20260101T000000-abcdef" / "record.json").write_text("{}\n")
    (run / "report").mkdir()  # `harness report RUN` writes its report there by default
    (run / "report" / "report.md").write_text("# report\n")
    check_output_dir("output_dir", run)
    check_output_dir("output_dir", tmp_path / "runs" / "r2")  # a new folder beside it
    (tmp_path / "empty").mkdir()
    check_output_dir("output_dir", tmp_path / "empty")
    # a sweep's job folder is the sweep's to name: checked as the run folder, below its multirun.yaml
    (tmp_path / "sweep" / "seed=1").mkdir(parents=True)
    (tmp_path / "sweep" / "multirun.yaml").write_text("hydra: {}\n")
    check_output_dir("the run folder", tmp_path / "sweep" / "seed=1")
    (run / "report" / "report.md").unlink()  # a report/ folder that holds no report is someone else's
    with pytest.raises(ConfigError, match=r"holds files that are no run's \(report\)"):
        check_output_dir("output_dir", run)
    with pytest.raises(ConfigError, match="holds files that are no run's"):
        (run / "notes.txt").write_text("mine\n")
        check_output_dir("output_dir", run)


def test_an_output_folder_that_cannot_be_created(tmp_path, workload, capsys, no_models):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = argv_for(tmp_path, workload, f"output_dir={blocker / 'run'}")
    assert_refused_run(tmp_path, capsys, argv, f"output_dir={blocker / 'run'}", "is a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "prompts.jsonl"]


def test_a_checkpoint_without_weights_fails_at_load_in_one_line(tmp_path, workload, capsys):
    ckpt = tmp_path / "ckpt"
    loading.tiny_llama_config().save_pretrained(ckpt)  # config.json and a tokenizer: no weights
    byte_tokenizer().save_pretrained(ckpt)
    argv = argv_for(tmp_path, workload, "model=hf", f"model.name_or_path={ckpt}")
    assert run_main(argv) == 2
    line = one_line(capsys, "harness run: refused: ")
    assert f"model.name_or_path={ckpt}: cannot load its ModelForCausalLM" in line  # the option that named it
    assert not (tmp_path / "run" / "record.json").exists()
    # the same folder as a draft is named by the draft's option, not as "checkpoint '...'" (which model?)
    target = tiny_checkpoint(tmp_path / "target")
    draft = argv_for(tmp_path, workload, "proposer=draft_model", "proposer.model.name=hf")
    draft = [*draft, "model=hf", f"model.name_or_path={target}", f"proposer.model.name_or_path={ckpt}"]
    capsys.readouterr()  # the fixture's own save
    assert run_main(draft) == 2
    err = capsys.readouterr().err  # the target's weights load first, with transformers' bar
    assert "Traceback" not in err
    refusals = [line for line in err.splitlines() if line.startswith("harness run: refused: ")]
    assert len(refusals) == 1
    assert f"proposer.model.name_or_path={ckpt}: cannot load its ModelForCausalLM" in refusals[0]


def test_a_checkpoint_without_a_tokenizer_fails_before_its_weights_in_one_line(tmp_path, workload, capsys):
    ckpt = tmp_path / "ckpt"
    loading.tiny_llama_config().save_pretrained(ckpt)  # config.json only
    argv = argv_for(tmp_path, workload, "model=hf", f"model.name_or_path={ckpt}")
    assert run_main(argv) == 2
    line = one_line(capsys, "harness run: refused: ")
    assert line.endswith(
        f"model.name_or_path={ckpt}: no tokenizer in it (none of tokenizer.json, tokenizer.model, vocab.json, "
        "tokenizer_config.json, vocab.txt): a checkpoint carries the tokenizer it was trained with (save it with "
        "tokenizer.save_pretrained)"
    )
    assert not (tmp_path / "run" / "record.json").exists()


def test_an_unexpected_error_is_one_line_and_its_traceback_only_when_asked(tmp_path, workload, capsys, monkeypatch):
    import harness.app as app

    def boom(cfg, *, run_dir):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(app, "run_job", boom)
    argv = argv_for(tmp_path, workload)
    assert run_main(argv) == 1
    line = one_line(capsys, "harness run: error: RuntimeError: boom second line")
    assert "HARNESS_TRACEBACK=1" in line

    monkeypatch.setenv("HARNESS_TRACEBACK", "1")
    assert run_main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.rstrip().endswith("boom second line")


def _fails_at_its_second_call(monkeypatch, module: str, name: str, failure: BaseException) -> list:
    """Patch ``module.name`` to run as before once, then raise ``failure``; returns the list its calls
    are counted in."""
    import importlib

    where = importlib.import_module(module)
    real, calls = getattr(where, name), []

    def fails_at_the_second_call(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise failure
        return real(*args, **kwargs)

    monkeypatch.setattr(where, name, fails_at_the_second_call)
    return calls


@pytest.mark.parametrize(
    "proposer, module, loss",
    [("hydra", "harness.prepare.heads_training", "head_loss"), ("eagle", "harness.prepare.eagle", "eagle_loss")],
)
@pytest.mark.parametrize(
    "failure, said",
    [(KeyboardInterrupt, "harness train: interrupted"), (RuntimeError("boom"), "harness train: error: RuntimeError")],
    ids=["interrupted", "error"],
)
def test_training_stopped_midway_clears_its_progress_bar_before_the_one_line(
    tmp_path, capsys, monkeypatch, proposer, module, loss, failure, said
):
    """A training run stopped after its first step wipes its progress bar's line before saying why:
    the one line stands alone on the terminal, no bar text before it on its line nor after it."""
    import gc

    calls = _fails_at_its_second_call(monkeypatch, module, loss, failure)
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HARNESS_TRACEBACK", "0")
    argv = ["train", f"proposer={proposer}", "model=tiny", "model.linear_kernel=default", "threads=1"]
    argv += ["proposer.data.token_budget=300", "proposer.data.held_out_tokens=100", "proposer.data.max_len=50"]
    assert cli.main(argv) in (1, 130)
    gc.collect()  # a bar left open would draw itself again when collected
    assert len(calls) == 2
    err = capsys.readouterr().err
    assert f"train {proposer}" in err, err  # the bar was drawn
    before, _, after = err.rpartition(said)
    shown = before.rpartition("\n")[2].rpartition("\r")[2]  # what the terminal shows before it on its line
    assert before and shown == "", err
    assert after.endswith("\n") and "\r" not in after and "\n" not in after[:-1], err


def test_the_traceback_flag_shows_a_refusals_traceback(tmp_path, workload, capsys, monkeypatch):
    monkeypatch.setenv("HARNESS_TRACEBACK", "0")  # restored after the test; the flag sets it to 1
    assert cli.main(["--traceback", "run", *argv_for(tmp_path, workload, "workload.limit=0")]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "harness run: refused: workload.limit=0" in err


@pytest.mark.parametrize(
    "argv, line",
    [
        (["compare", "/nonexistent"], "harness compare: refused: /nonexistent: expected a records folder"),
        (["report", "/nonexistent"], "harness report: refused: /nonexistent: expected a records folder"),
        (["tree", "max_nodes=0"], "harness tree: refused: give exactly one of acceptance="),
        (["datastore", "info", "/nonexistent"], "harness datastore: refused: '/nonexistent' is not a datastore"),
        (["export", "spec-bench", "/nonexistent", "x.jsonl"], "harness export: refused: /nonexistent: no such"),
        (["oracles", "--verifier", "nope"], "harness oracles: refused: unknown verifier 'nope'"),
        (["dashboard", "nope"], "harness dashboard: refused: "),
    ],
    ids=["compare", "report", "tree", "datastore", "export", "oracles", "dashboard"],
)
def test_every_command_shows_a_refusals_traceback_when_asked(argv, line, capsys, monkeypatch):
    """``harness --traceback`` (and HARNESS_TRACEBACK=1) printed a refusal's traceback for run, sweep,
    calibrate and train only: the other commands' refusals were one line whatever was asked."""
    monkeypatch.setenv("HARNESS_TRACEBACK", "0")  # restored after the test; the flag sets it to 1
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(line), err
    assert cli.main(["--traceback", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "Traceback (most recent call last):" and err[-1].startswith(line), err


def test_a_multirun_composition_error_is_one_line(tmp_path, workload, capsys):
    argv = ["-m", *argv_for(tmp_path, workload, "generation.max_new_tokenz=1,2", f"hydra.sweep.dir={tmp_path / 's'}")]
    assert run_main(argv) == 2
    line = one_line(capsys, "harness run: refused: ")
    assert "no option 'max_new_tokenz'" in line and "+generation" not in line


#: the launchers a command line may pick: Hydra's own, its installed plugins' and conf/hydra/launcher's
LAUNCHER_OPTIONS = "basic, joblib, slurm, submitit_local, submitit_slurm"


@pytest.mark.parametrize("multirun", [["-m"], ["hydra.mode=MULTIRUN"], []], ids=["-m", "hydra.mode", "run"])
def test_a_mistyped_launcher_lists_the_launchers_and_offers_the_closest(tmp_path, capsys, no_models, multirun):
    """``-m hydra/launcher=joblibb`` was refused as "hydra=launcher/joblibb is no option of hydra; the
    options: launcher/slurm": the group mangled, and Hydra's and its plugins' launchers left out."""
    sweep_dir = tmp_path / "sweep"
    seeds = ["seed=0,1"] if multirun else []
    argv = [*multirun, "model=tiny", "hydra/launcher=joblibb", *seeds, f"hydra.sweep.dir={sweep_dir}"]
    argv.append(f"hydra.run.dir={tmp_path / 'run'}")
    assert run_main(argv) == 2
    line = one_line(capsys, "harness run: refused: ")
    assert line == (
        "harness run: refused: hydra/launcher=joblibb is no option of hydra/launcher; the options: "
        f"{LAUNCHER_OPTIONS}; try hydra/launcher=joblib"
    ), line
    assert not sweep_dir.exists() and not (tmp_path / "run").exists()


def test_a_hydra_group_given_no_option_lists_its_options():
    with pytest.raises(ConfigError) as info:
        checked_plan(["hydra/launcher="])
    assert str(info.value) == f"hydra/launcher= is empty; give one of {LAUNCHER_OPTIONS}"


@pytest.mark.parametrize(
    "argv,prefix,fragment",
    [
        (["compare", "/nonexistent-records"], "harness compare: refused: ", "/nonexistent-records"),
        (["report", "/nonexistent-records"], "harness report: refused: ", "/nonexistent-records"),
        (["tree", "foo"], "harness tree: refused: ", "key=value"),
        (["tree", "acceptance=${x}", "max_nodes=4", "max_depth=2"], "harness tree: refused: ", "key 'x' not found"),
        (["oracles", "--foo"], "harness oracles: refused: ", "unrecognized arguments: --foo"),
        (["oracles", "--random", "-1"], "harness oracles: refused: ", "must be >= 0"),
        (
            ["oracles", "--json", f"{__file__}/o.json"],
            "harness oracles: refused: ",
            f"{__file__}: a file is in the way",
        ),
        (
            ["report", str(Path(__file__).parent / "fixtures" / "records"), f"out={__file__}"],
            "harness report: refused: ",
            f"out={__file__}: a file is in the way; an output folder is needed there",
        ),
        (["dashboard", "smoke", f"out={__file__}/d.json"], "harness dashboard: refused: ", "a file is in the way"),
        (["datastore", "info", "/nonexistent-store"], "harness datastore: refused: ", "/nonexistent-store"),
        (["datastore", "info"], "harness datastore: refused: ", "needs a datastore directory"),
        (["sweep", "nope"], "harness sweep: refused: ", "unknown sweep 'nope'"),
        (["sweep", "smoke", "concurrent_jobs=0"], "harness sweep: refused: ", "concurrent_jobs=0 is out of range"),
        (["sweep", "smoke", "concurrent_jobs=-1"], "harness sweep: refused: ", "it must be >= 1"),
        (["sweep", "smoke", "concurrent_jobs=two"], "harness sweep: refused: ", "concurrent_jobs=two is not one"),
        (["run", "-m", "seed=1,2", "concurrent_jobs=0"], "harness run: refused: ", "concurrent_jobs=0 is out of"),
        # a fix that meets another refusal is offered without the override the second fix made unneeded
        (
            ["run", "model=tiny", "topology=cartesian", "topology.max_nodes=5"],
            "harness run: refused: ",
            "got topology.max_nodes=5 (leave it to the default interpolation); try topology=sequence or "
            "topology=sequences",
        ),
        (["train", "proposer=prompt_lookup", "model=tiny"], "harness train: refused: ", "no trained artifact"),
        # the run's checks that apply to training, before the target loads (it loaded, then refused; or trained)
        (
            ["train", "proposer=early_exit", "model=tiny"],
            "harness train: refused: ",
            "proposer.exit_layer must be in [1, 1] for this 2-layer target; got 2; try proposer.exit_layer=1",
        ),
        (
            [
                "train",
                "proposer=early_exit",
                "model=tiny",
                "proposer.exit_layer=1",
                "model.tiny.max_position_embeddings=64",
            ],
            "harness train: refused: ",
            "proposer.data.max_len=256 tokens per training document exceed the 64 positions of the target "
            "(model=tiny): training the artifact would run the target past them; try proposer.data.max_len=64",
        ),
        (
            ["train", "proposer=medusa", "model=tiny", "proposer.name=eagle"],
            "harness train: refused: ",
            "proposer.name=eagle names another proposer than the options composed",
        ),
        (["train", "proposer=hydra", "model=tiny", "proposer.num_heads=0"], "harness train: refused: ", ">= 1"),
        (
            ["train", "proposer=eagle", "model=tiny", "proposer.data.token_budget=2"],
            "harness train: refused: ",
            "proposer.data.token_budget=2 is out of range: it must be >= 3",
        ),
        (["train", "proposer=hydra", "force=maybe"], "harness train: refused: ", "force=maybe"),
        (["train", "proposer=hydra", "--force"], "harness train: refused: ", "not flags; got ['--force'] (force=true"),
        (
            ["train", "model=tiny", "proposer=layer_skip", "proposer.skip=[5]"],
            "harness train: refused: ",
            "nothing to search",
        ),
        (
            ["train", "model=tiny", "proposer=medusa", "proposer.artifact=/nonexistent/heads"],
            "harness train: refused: ",
            "does not exist: harness train writes its artifact to the cache",
        ),
        (["calibrate", "model=tiny"], "harness calibrate: refused: ", "; try proposer=draft_model"),
        (["calibrate", "model=tiny", "topology=sequence"], "harness calibrate: refused: ", "needs topology=sequoia"),
        (
            [
                "calibrate",
                "model=tiny",
                "proposer=draft_model",
                "proposer.sampling=without_replacement",
                "verifier=sequoia",
                "generation.temperature=0.7",
                "topology=sequence",
            ],
            "harness calibrate: refused: ",
            "try topology=sequoia",
        ),
        (["calibrate", "model=tiny", "topology.max_nodes=0"], "harness calibrate: refused: ", "max_nodes=0"),
        (
            ["calibrate", "model=tiny", "concurrent_jobs=2"],
            "harness calibrate: refused: ",
            "concurrent_jobs=2 is a sweep option (how many of a multirun's jobs run at once); harness calibrate is "
            "one job, timed alone: drop it",
        ),
        (
            ["train", "model=tiny", "proposer=layer_skip", "concurrent_jobs=2"],
            "harness train: refused: ",
            "concurrent_jobs=2 is a sweep option (how many of a multirun's jobs run at once); harness train is one "
            "job, timed alone: drop it",
        ),
    ],
)
def test_every_command_refuses_in_one_line(capsys, no_models, argv, prefix, fragment):
    assert cli.main(argv) == 2
    assert fragment in one_line(capsys, prefix)


def test_harness_train_notes_the_run_options_it_does_not_read():
    from harness.app import TRAIN_UNREAD, unread_options

    given = [
        "model=tiny",
        "proposer=medusa",
        "generation.max_new_tokens=8",
        "verifier=membership",
        "topology=sequences",
        "workload.limit=3",
        "workload.per_category=2",
        "workload.chat_template=vicuna",  # the tokenizer's template formats the training documents
        "proposer.data.token_budget=300",
        "threads=1",
    ]
    noted = [n.split(":", 1)[0] for n in unread_options(given, TRAIN_UNREAD)]
    assert noted == [
        "generation.max_new_tokens=8",
        "verifier=membership",
        "topology=sequences",
        "workload.limit=3",
        "workload.per_category=2",
    ]


@pytest.mark.parametrize(
    "given,fragment",
    [
        (["proposer.name=rest"], "proposer.name=rest names another proposer than the options composed"),
        (["concurrent_jobs=4"], "concurrent_jobs=4 is a sweep option"),
    ],
)
def test_a_plain_run_refuses_a_proposer_name_apart_from_its_options_and_a_sweep_s_concurrency(
    tmp_path, workload, capsys, no_models, given, fragment
):
    """``proposer.name=rest`` over prompt lookup's options failed inside the plan with an OmegaConf
    error; ``concurrent_jobs=4`` on one run was recorded as metrics.concurrent_jobs=4 (compare then
    said the arm ran four at once)."""
    assert_refused_run(tmp_path, capsys, argv_for(tmp_path, workload, *given), fragment)


def test_a_sweep_job_still_takes_concurrent_jobs():
    """Every job of a multirun passes the plain run's checks; concurrent_jobs is refused only on one run."""
    from harness.app import check_one_job

    cfg, _ = checked_plan(["model=tiny", "concurrent_jobs=2"])
    assert cfg.concurrent_jobs == 2
    check_one_job(compose(["model=tiny", "concurrent_jobs=1"]))
    with pytest.raises(ConfigError, match="concurrent_jobs=2 is a sweep option"):
        check_one_job(cfg)


@pytest.mark.parametrize("proposer", ["medusa", "hydra", "clover", "eagle", "early_exit", "layer_skip"])
def test_harness_train_into_a_folder_that_is_no_artifact_of_its_kind_is_refused_and_leaves_it_as_it_is(
    tmp_path, capsys, no_models, proposer
):
    """`harness train proposer.artifact=DIR force=true` trained into DIR and deleted what it held (a
    user's folder, an artifact of another kind); a file path trained fully, then failed; without
    force a lock file was left beside the folder. Each is refused now before any model work, and
    nothing is written beside it (no lock file) or in it."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (tmp_path / "notes.txt").write_text("mine")
    other = tmp_path / "other"
    other.mkdir()
    other_kind = "medusa" if proposer == "eagle" else "eagle"
    (other / "manifest.json").write_text(json.dumps({"kind": other_kind}))
    cases = [  # a folder without manifest.json, config.json and weights is no published checkpoint either
        (mine, "holds no manifest.json (not an artifact); leave proposer.artifact"),
        (tmp_path / "notes.txt", "is a file, not an artifact folder; leave proposer.artifact unset to use the cache"),
        (other, f"holds an artifact of kind {other_kind!r}, not {proposer!r}; name one of kind {proposer!r}, or leave"),
    ]
    for path, fragment in cases:
        for force in ([], ["force=true"]):
            argv = ["train", "model=tiny", f"proposer={proposer}", f"proposer.artifact={path}", *force]
            assert cli.main(argv) == 2
            line = one_line(capsys, f"harness train: refused: proposer.artifact={str(path)!r} ")
            assert fragment in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "notes.txt", "other"]
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "mine"
    assert [p.name for p in other.iterdir()] == ["manifest.json"]


@pytest.mark.parametrize("command", ["compare", "report"])
def test_compare_and_report_on_a_folder_without_records_say_so(tmp_path, capsys, command):
    (tmp_path / "empty").mkdir()
    assert cli.main([command, str(tmp_path / "empty")]) == 2
    line = one_line(capsys, f"harness {command}: refused: ")
    assert f"no run records under {tmp_path / 'empty'}" in line
    assert cli.main([command]) == 2  # no arguments: the usage, on stderr only
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("usage: harness ")


def test_an_error_escaping_a_command_is_one_line(capsys, monkeypatch):
    import harness.tracking.compare as compare

    def broken(source):
        raise RuntimeError("unexpected")

    monkeypatch.setattr(compare, "read_results", broken)
    assert cli.main(["compare", "somewhere"]) == 1
    assert "RuntimeError: unexpected" in one_line(capsys, "harness compare: error: ")


def test_schemas_are_no_selectable_options():
    cs = ConfigStore.instance()
    for group in SCHEMAS:
        with pytest.raises(OSError):  # the ConfigStore holds nothing in a selectable group
            cs.list(group)
    with pytest.raises(MissingConfigException) as info:
        compose(["proposer=nope"])
    listed = str(info.value).split("Available options in 'proposer':", 1)[1].split("Config search path")[0].split()
    assert listed == group_options("proposer") and not [o for o in listed if "base" in o or "schema" in o]


def test_a_mistyped_experiment_is_refused_not_ignored():
    with pytest.raises(ConfigError, match="experiment=sources/rest_T is no option") as info:
        checked_plan(["experiment=sources/rest_T"])
    assert info.value.suggestions == (("experiment=sources/rest_T0",),)


# --------------------------------------------------------------------------- overrides do not leak between models


DRAFT_FIELDS = {
    "name": "hf",
    "name_or_path": "/elsewhere",
    "dtype": "float64",
    "device": "meta",
    "seed": 7,
    "num_layers": 1,
    "tiny.vocab_size": 128,
    "tiny.hidden_size": 64,
    "tiny.num_layers": 3,
    "tiny.num_heads": 8,
    "tiny.num_kv_heads": 4,
    "tiny.intermediate_size": 32,
    "tiny.max_position_embeddings": 64,
}


@pytest.mark.parametrize("draft", ["proposer.model", "proposer.draft_model.model"])
def test_a_draft_override_never_changes_the_target(draft):
    proposer = "proposer=draft_model" if draft == "proposer.model" else "proposer=merged"
    base = compose([proposer, "model=tiny"])
    target = OmegaConf.to_container(base.model, resolve=True)
    for key, value in DRAFT_FIELDS.items():
        cfg = compose([proposer, "model=tiny", f"{draft}.{key}={value}"])
        assert OmegaConf.select(cfg, f"{draft}.{key}") == value, key
        assert OmegaConf.to_container(cfg.model, resolve=True) == target, f"{draft}.{key} leaked into the target"


def test_a_target_override_reaches_the_derived_draft_but_not_a_field_the_draft_sets():
    cfg = compose(["proposer=draft_model", "model=tiny", "model.tiny.vocab_size=16", "model.dtype=float64"])
    assert cfg.proposer.model.tiny.vocab_size == 16 and cfg.proposer.model.dtype == "float64"
    cfg = compose(["proposer=draft_model", "model=tiny", "model.dtype=float64", "proposer.model.dtype=float32"])
    assert cfg.model.dtype == "float64" and cfg.proposer.model.dtype == "float32"
    # a derived draft of a tiny target keeps all its layers (fewer than the default cut)
    assert cfg.proposer.model.num_layers == cfg.model.tiny.num_layers == 2 and cfg.model.num_layers is None
    cfg = compose(["proposer=draft_model", "model.dtype=float64"])
    assert cfg.proposer.model.name == "derived" and cfg.proposer.model.num_layers == 6


def test_the_issue_override_is_refused_and_a_draft_vocabulary_of_its_own_is_refused_before_loading(no_models):
    with pytest.raises(ConfigError, match="without the leading"):
        checked_plan(["proposer=draft_model", "model=tiny", "+proposer.model.tiny.vocab_size=128"])
    with pytest.raises(ConfigError, match="differs from model.tiny.vocab_size=96") as info:
        checked_plan(
            ["proposer=draft_model", "model=tiny", "proposer.model.name=tiny", "proposer.model.tiny.vocab_size=128"]
        )
    assert info.value.suggestions == (("proposer.model.tiny.vocab_size=96",),)


@pytest.mark.parametrize("target", ["model=tiny", "model=smollm2"])
@pytest.mark.parametrize("field", ["vocab_size=128", "num_layers=1", "hidden_size=64"])
def test_a_tiny_field_set_for_a_derived_draft_is_refused_not_ignored(no_models, tmp_path, target, field):
    """A derived draft is cut from the target, so ``proposer.model.tiny.*`` cannot shape it: setting
    one is refused before any model work, naming the field and the separate-draft alternative."""
    with pytest.raises(
        loading.CheckpointError, match=rf"proposer.model.tiny.{field.split('=')[0]}=.* does not apply .*name=tiny"
    ):
        runner.run_job(
            compose(["proposer=draft_model", target, f"proposer.model.tiny.{field}"]), run_dir=tmp_path / "r"
        )
    assert not (tmp_path / "r").exists()


# --------------------------------------------------------------------------- refusals that suggest something valid


REFUSED = [
    ["proposer=rest", "verifier=specinfer", "generation.temperature=0.7"],
    ["proposer=prompt_lookup", "verifier=rejection", "generation.temperature=0.7"],
    ["verifier=greedy", "generation.temperature=0.7"],
    ["proposer=draft_model", "verifier=specinfer"],
    ["verifier=typical"],
    ["proposer=clover", "topology=merged", "verifier=greedy", "generation.temperature=0.7"],
    ["proposer=prompt_lookup", "topology=expansion"],
    ["proposer=rest", "topology=expansion"],
    ["proposer=rest", "topology=sequoia"],
    ["proposer=medusa", "generation.batch_size=2"],
    ["topology=cartesian", "topology.max_nodes=20"],
    ["proposer=draft_model", "topology=expansion", "topology.max_depth=2"],
    ["proposer.min_ngram=5"],
    ["gates.chi2_samples=20", *SAMPLED],
    ["model=tiny", "gates.chi2_top_m=200", *SAMPLED],
    ["model=tiny", "proposer=draft_model", "proposer.model.name=tiny", "proposer.model.tiny.vocab_size=128"],
    ["proposer=promt_lookup", "verifier=rejection"],
    ["generation.max_new_tokenz=3"],
    ["proposr=rest"],
    ["model.name=smolm2"],
]


@pytest.mark.parametrize("overrides", REFUSED, ids=lambda o: " ".join(o))
def test_every_offered_suggestion_is_accepted(overrides, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as info:
        checked_plan(overrides)
    exc = info.value
    assert exc.offered and exc.suggestions, f"no suggestion offered: {exc}"
    assert suggestions_in(str(exc)) == [list(s) for s in exc.suggestions]
    base = [o for o in overrides if o != exc.replaces]  # a mistyped key's fix replaces it
    for fix in exc.suggestions:
        accepted(apply_overrides(base, fix))


@pytest.mark.parametrize(
    "overrides,corrected",
    [
        # the corrected temperature needs a sampling verifier: the fix is both, not the verifier alone
        (["model=tiny", "generation.tempreature=0.5"], "generation.temperature=0.5"),
        # the chosen verifier cannot take prompt lookup's scores: it is replaced, the temperature kept
        (["model=tiny", "generation.temperatre=0.7", "verifier=rejection"], "generation.temperature=0.7"),
    ],
)
def test_the_fix_of_a_mistyped_key_keeps_the_value_given_under_it(overrides, corrected):
    with pytest.raises(ConfigError) as info:
        checked_plan(overrides)
    exc = info.value
    offered = suggestions_in(str(exc))
    assert offered and offered == [list(s) for s in exc.suggestions], str(exc)
    base = [o for o in overrides if o != exc.replaces]
    for fix in offered:
        assert corrected in fix, str(exc)
        accepted(apply_overrides(base, tuple(fix)))
        cfg = compose(apply_overrides(base, tuple(fix)))
        assert cfg.generation.temperature == float(corrected.split("=")[1])
    assert offered[0] == [corrected, "verifier=membership"]


def test_a_proposer_that_cannot_draft_sibling_sets_is_neither_offered_nor_planned_a_sequoia_tree():
    """Sequoia's calibration drafts a set of siblings below each parent: REST and merged trees
    cannot, so topology=sequoia is refused at plan (it failed after loading the model) and no
    refusal offers it."""
    for proposer in (["proposer=rest"], ["proposer=merged", "proposer.sources=[prompt_lookup]"]):
        with pytest.raises(
            ConfigError, match=r"cannot be calibrated for topology=sequoia: the calibration drafts a set"
        ):
            plan(compose([*proposer, "topology=sequoia"]))
    with pytest.raises(ConfigError) as info:
        checked_plan(["proposer=rest", "topology=expansion"])
    assert info.value.suggestions == (("topology=sequence",), ("topology=sequences",))


def test_rest_with_specinfer_at_a_temperature_is_offered_membership_not_greedy():
    with pytest.raises(NegotiationError) as info:
        checked_plan(["proposer=rest", "verifier=specinfer", "generation.temperature=0.7"])
    assert info.value.suggestions == (("verifier=membership",),)
    assert "greedy" not in str(info.value)


def test_a_candidate_that_meets_another_refusal_is_extended_or_dropped():
    exc = ConfigError("refused", suggestions=[("topology=sequence",), ("generation.temperature=-1",)])
    offered = offer(exc, ["proposer=clover", "topology=merged", "verifier=greedy", "generation.temperature=0.7"])
    assert offered.suggestions == (("topology=sequence", "verifier=membership"),)


def test_plan_alone_offers_no_unchecked_suggestion():
    with pytest.raises(ConfigError) as info:
        plan(compose(["proposer=clover", "topology=merged", "verifier=greedy", "generation.temperature=0.7"]))
    assert info.value.suggestions and "try" not in str(info.value)  # candidates, not yet offered


def test_workload_limit_zero_names_the_range_not_an_empty_split():
    with pytest.raises(ConfigError) as info:
        checked_plan(["workload.limit=0"])
    assert "workload.limit=0" in str(info.value) and "no prompts" not in str(info.value)


def test_an_empty_split_suggests_the_splits_the_file_has(tmp_path):
    path = tmp_path / "dev.jsonl"
    path.write_text(json.dumps({**PROMPTS[0], "split": "dev"}) + "\n")
    overrides = ["model=tiny", "workload=jsonl", f"workload.path={path}"]
    with pytest.raises(ConfigError, match="no prompts in split 'eval'") as info:
        checked_plan(overrides)
    assert info.value.suggestions == (("workload.split=dev",),)
    cfg, planned = checked_plan(apply_overrides(overrides, info.value.suggestions[0]))
    assert [p.prompt_id for p in planned.prompts] == ["p0"]


def test_range_describes_its_bounds():
    assert Range(ge=1).describe() == ">= 1"
    assert Range(gt=0.0, lt=1.0).describe() == "in (0, 1)"
    assert Range(gt=0.0, le=1.0).describe() == "in (0, 1]"
    assert not Range(ge=0.0).admits(math.inf) and not Range(ge=0).admits(True)


def test_a_hub_id_while_the_hub_is_unreachable_reads_the_cache_only_and_says_why(monkeypatch):
    """No retries against a hub that cannot be reached: the cache is asked at once, and a miss is
    one line naming the reason."""
    seen = {}

    class AutoConfig:
        @staticmethod
        def from_pretrained(source, **kwargs):
            seen.update(kwargs)
            raise OSError("not in the cache")

    monkeypatch.setattr(loading, "hub_unreachable", lambda: "huggingface.co:443: Name or service not known")
    with pytest.raises(loading.CheckpointError) as info:
        loading.from_pretrained(AutoConfig, "someone/model", key="model.name_or_path")
    assert seen == {"local_files_only": True}
    assert str(info.value) == (
        "model.name_or_path=someone/model: cannot load its Config: not in the local Hugging Face cache, and the hub "
        "cannot be reached (huggingface.co:443: Name or service not known); give a checkpoint folder, or fetch it "
        "where the hub is reachable"
    )
    seen.clear()
    monkeypatch.setattr(loading, "hub_unreachable", lambda: None)  # reachable: the hub client decides
    with pytest.raises(loading.CheckpointError, match=r"cannot load its Config \(OSError: not in the cache\)"):
        loading.from_pretrained(AutoConfig, "someone/model")
    assert seen == {}


def test_the_hub_probe_trusts_a_proxy_and_hf_hub_offline(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    loading.hub_unreachable.cache_clear()
    try:
        assert loading.hub_unreachable() is None  # a direct connection says nothing behind a proxy
        for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        loading.hub_unreachable.cache_clear()
        assert loading.hub_unreachable() == "HF_HUB_OFFLINE is set"
    finally:
        loading.hub_unreachable.cache_clear()


def test_an_exit_layer_outside_the_target_is_refused_before_any_model_work(no_models):
    """proposer=early_exit's default exit layer (2) cannot cut the two-layer tiny target: refused at
    plan from the target's config alone, offering a layer that fits; a given artifact carries its own."""
    with pytest.raises(
        ConfigError, match=r"proposer.exit_layer must be in \[1, 1\] for this 2-layer target; got 2"
    ) as info:
        checked_plan(["model=tiny", "proposer=early_exit"])
    assert info.value.suggestions == (("proposer.exit_layer=1",),)
    checked_plan(["model=tiny", "proposer=early_exit", "proposer.exit_layer=1"])
    with pytest.raises(ConfigError, match=r"must be in \[1, 29\] for this 30-layer target; got 30"):
        checked_plan(["proposer=early_exit", "proposer.exit_layer=30"])


@pytest.mark.parametrize("topology, shape", [("sequences", "sequences"), ("sequoia", "tree")])
def test_a_shape_eagle_cannot_build_is_refused_as_such(no_models, topology, shape):
    """The fixes offered for a topology the proposer cannot build are computed over every shape it
    builds, the dynamic tree included (whose budget needs its own topk): the refusal names the
    shape, not a budget the user never asked for."""
    with pytest.raises(ConfigError) as info:
        checked_plan(["model=tiny", "proposer=eagle", f"topology={topology}"])
    message = str(info.value)
    assert message.startswith(f"proposer=eagle cannot build topology={topology} (shape '{shape}')"), message
    assert "try topology=sequence" in message and "topk" not in message


def test_a_reader_that_leaves_the_pipe_is_no_refusal():
    """``harness compare RECORDS | head -1`` printed ``refused: [Errno 32] Broken pipe`` and exited 2;
    it now ends quietly with the status a SIGPIPE gives (141), nothing on stderr."""
    import subprocess
    import sys

    from helpers import FIXTURE_ROOT

    script = (
        "import sys; from harness import cli; sys.stdout.write('x' * 10); sys.stdout.flush(); "
        "import harness.tracking.compare as c; sys.exit(cli.main(['compare', sys.argv[1]]))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(FIXTURE_ROOT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.read(1)
    proc.stdout.close()  # the reader leaves before the table is printed
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == cli.BROKEN_PIPE
    assert "refused" not in err and "Broken pipe" not in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "argv, ending",
    [
        (
            ["run", "model=tiny", "topology=cartesian", "topology.max_nodes=5"],
            "; try topology=sequence or topology=sequences",
        ),
        (["calibrate", "model=tiny"], "it builds ['sequence', 'sequences']; try proposer=draft_model"),
    ],
)
def test_offered_fixes_carry_no_override_they_are_accepted_without(capsys, no_models, argv, ending):
    """A fix that meets another refusal was offered with both steps (topology.max_nodes=21
    topology=sequence, where topology=sequence alone is accepted)."""
    assert cli.main(argv) == 2
    assert one_line(capsys, f"harness {argv[0]}: refused: ").endswith(ending)


def test_a_temperature_too_small_for_float32_is_refused_before_model_work():
    """generation.temperature=1e-40 passed the range check (>= 0) and failed inside the statistical
    gate, after the models loaded, with "q has non-finite entries" (1e-300: "a vector with no
    mass"), naming no option."""
    from harness.config import checked_plan
    from harness.contracts import ConfigError

    for value in ("1e-40", "1e-300"):
        with pytest.raises(ConfigError) as err:
            checked_plan(["model=tiny", "workload.limit=1", "verifier=membership", f"generation.temperature={value}"])
        assert str(err.value).startswith(
            f"generation.temperature={value}: a temperature above 0 must be at least 1e-06, a conservative floor "
            "(far below it the target's law overflows in float32); 0 decodes greedily"
        )
    checked_plan(["model=tiny", "workload.limit=1", "verifier=membership", "generation.temperature=1e-6"])


def test_a_temperature_so_large_that_top_k_and_top_p_stop_selecting_is_refused():
    """generation.temperature=1e39 with top_k=1 ran as argmax decoding by the record (greedy gates
    passed) while both arms sampled uniformly over the vocabulary: float32 logits over the temperature
    were all 0, so top_k and top_p kept every token."""
    import torch

    from harness.config import checked_plan
    from harness.contracts import ConfigError
    from harness.verifiers.sampling import SamplingPolicy

    logits = torch.tensor([[3.0, 1.0, -2.0, 0.5, 2.0]])
    assert (SamplingPolicy(temperature=1e39, top_k=2).probs(logits) > 0).all()  # what it ran: no token masked
    assert SamplingPolicy(temperature=1e4, top_k=2).probs(logits)[0, [1, 2, 3]].tolist() == [0.0] * 3
    for value in ("1e39", "1e5"):
        with pytest.raises(ConfigError) as err:
            checked_plan(["model=tiny", "workload.limit=1", f"generation.temperature={value}", "generation.top_k=1"])
        assert str(err.value).startswith("generation.temperature=") and (
            ": a temperature must be at most 10000, a conservative ceiling (far above it" in str(err.value)
        )
    checked_plan(["model=tiny", "workload.limit=1", "verifier=membership", "generation.temperature=1e4"])


def test_an_override_with_an_empty_value_is_refused(tmp_path, monkeypatch, capsys):
    """proposer.artifact= (an unset shell variable) read as "no artifact": the run trained CPU-budget
    heads in the cache instead of the published ones meant; output_dir= wrote to a timestamped folder."""
    from harness.app import run_main

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    for override in ("proposer.artifact=", "proposer.artifact=''", "proposer.artifact=' '", "output_dir="):
        assert run_main(["model=tiny", "proposer=medusa", override, "workload.limit=1"]) == 2
        key, _, value = override.partition("=")
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"harness run: refused: {key}={value} is empty; give a value, or leave the option out "
            f"({key}=null where it can be unset)"
        )
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "cache" / "artifacts").exists()


def test_a_run_refused_while_it_plans_leaves_no_folder_above_its_run_folder(tmp_path, monkeypatch, capsys):
    """A refusal raised inside the job (opening a named datastore, before any model work) removed the
    run folder but left the empty folders Hydra made above it (``outputs/adhoc``, ``new/`` of
    ``output_dir=new/sub``); a folder that was there, or one holding anything, stays."""
    from harness.app import run_main

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    bad = ["model=tiny", "proposer=rest", f"proposer.datastore.path={tmp_path / 'none'}", "workload.limit=1"]
    for extra, gone in (([], "outputs"), (["output_dir=new/sub"], "new")):
        assert run_main([*bad, *extra]) == 2
        assert "is not a datastore" in capsys.readouterr().err.strip().splitlines()[-1]
        assert not (tmp_path / gone).exists(), extra
    (tmp_path / "kept" / "a").mkdir(parents=True)
    assert run_main([*bad, "output_dir=kept/a/b/c"]) == 2
    assert sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "kept").rglob("*")) == ["kept/a"]


def test_an_empty_group_a_sweep_name_and_a_sampling_fix_are_said_plainly(tmp_path, monkeypatch, capsys):
    """`verifier=` gave Hydra's "In 'config': Could not find 'verifier/'"; `sweep=x` said the config has
    no option 'sweep' (it has: a sweep file sets it); draft_model under verifier=sequoia was offered
    other verifiers, not the sampling its own verifier is proved for."""
    from harness.app import run_main

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)

    def refusal(*overrides: str) -> str:
        assert run_main(["model=tiny", "workload.limit=1", *overrides]) == 2
        return capsys.readouterr().err.strip().splitlines()[-1]

    assert refusal("verifier=") == (
        "harness run: refused: verifier= is empty; give one of greedy, membership, rejection, sequoia, specinfer, "
        "typical"
    )
    assert refusal("sweep=x").startswith(
        "harness run: refused: sweep=x: the sweep name comes from a sweep file; run `harness sweep NAME|PATH.yaml`"
    )
    line = refusal("proposer=draft_model", "verifier=sequoia", "generation.temperature=0.7")
    assert line.endswith("; try proposer.sampling=without_replacement or verifier=membership or verifier=rejection")
    assert not (tmp_path / "outputs").exists()


def test_packed_weights_that_would_not_fit_in_memory_are_refused_in_one_line(tmp_path, workload, capsys, monkeypatch):
    from harness.target import native, options

    if native.native_kernels_problem() is not None:
        pytest.skip("no native kernels here")
    native.load_native_kernels()  # a first build's note goes out here, not among the run's lines
    capsys.readouterr()
    monkeypatch.setattr(options, "available_memory_bytes", lambda: 100_000)  # 0.1 MB free: no copy fits
    argv = argv_for(tmp_path, workload, "model.linear_kernel=streaming_panels")
    assert run_main(argv) == 2
    line = one_line(capsys, "harness run: refused: ")
    assert "model.linear_kernel=streaming_panels keeps a packed copy of the linear weights" in line
    assert "of memory is available: set model.linear_kernel=streaming (the streaming kernel" in line
    assert not (tmp_path / "run" / "record.json").exists()
    with monkeypatch.context() as m:  # a CPU where auto chooses the panels for float32: the message says so
        m.setattr(options, "cpu_vendor", lambda: "AuthenticAMD")
        m.setattr(options, "cpu_has_avx512", lambda: False)
        assert options.resolve_linear_kernel("auto", torch.float32, "cpu") == "streaming_panels"
        assert run_main(argv_for(tmp_path, workload)) == 2
        assert "(what model.linear_kernel=auto chose here)" in one_line(capsys, "harness run: refused: ")
    monkeypatch.setattr(options, "available_memory_bytes", lambda: None)  # unknown: nothing refused
    assert run_main(argv) == 0
    capsys.readouterr()
    record = json.loads((tmp_path / "run" / "record.json").read_text())
    packed = record["load_report"]["target"]["packed_weight_bytes"]
    model = loading.build_tiny_model(seed=0)
    assert packed == sum(w.nbytes for w in options.packed_linear_weights(model)) > 0  # a copy of each, made at load


def test_an_empty_harness_cache_variable_is_refused_and_a_tilde_in_it_is_the_home_folder(
    tmp_path, workload, capsys, monkeypatch, no_models
):
    """``HARNESS_CACHE=$UNSET`` made the working folder the cache (gate results and a native build
    landed there); a ``~`` the shell did not expand made a folder named ``~``."""
    monkeypatch.chdir(tmp_path)
    for blank in ("", "  "):
        monkeypatch.setenv("HARNESS_CACHE", blank)
        assert run_main(argv_for(tmp_path, workload)) == 2
        assert one_line(capsys, "harness run: refused: ").endswith(
            "HARNESS_CACHE is set but empty: unset it (the cache is then ~/.cache/harness) or set it to a folder"
        )
        assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HARNESS_CACHE", "~/cache")
    assert loading.cache_root() == tmp_path / "home" / "cache"


def test_a_path_starting_with_a_tilde_is_refused_with_the_form_the_shell_expands(tmp_path, workload, capsys, no_models):
    """The grammar refusal of ``output_dir=~/x`` offered ``'output_dir="~/x"'``, which then wrote
    into a folder named ``~`` under the working folder."""
    for given in ("output_dir=~/tilde_run", 'output_dir="~/tilde_run"'):
        assert run_main(argv_for(tmp_path, workload, given)) == 2
        line = one_line(capsys, "harness run: refused: ")
        assert "give output_dir=$HOME/tilde_run unquoted, which the shell expands, or an absolute path" in line
        assert '"~/' not in line.partition(":")[2].partition("give")[2]
    assert not (tmp_path / "~").exists() and not (tmp_path / "run").exists()


def test_the_warm_up_generates_no_more_than_the_measured_turns_so_it_stays_inside_the_context_limit(
    tmp_path, workload, capsys, monkeypatch
):
    """The prompts are checked against the context limit with max_new_tokens; a warm-up of 300
    tokens ran 300 past a prompt on a model with too few positions for them, unchecked."""
    from harness.engine.arms import Arms

    seen = []
    real = Arms.warmup

    def spy(self, tokens):
        seen.append(tokens)
        return real(self, tokens)

    monkeypatch.setattr(Arms, "warmup", spy)
    assert run_main(argv_for(tmp_path, workload, "generation.warmup_tokens=300", "gates.enabled=false")) == 0
    assert seen == [4]


def test_a_given_skip_vector_runs_no_search_and_is_not_held_to_the_searchs_positions():
    """The skip search's prompts are checked against the positions only where a search runs: a run
    that names its skip vector searches nothing."""
    small = ["model=tiny", "proposer=layer_skip", "model.tiny.max_position_embeddings=100", "workload.limit=1"]
    with pytest.raises(ConfigError, match="the skip search would run the target past them"):
        runner.check_job(compose(small), None)
    runner.check_job(compose([*small, "proposer.skip=[1]"]), None)


@pytest.mark.parametrize(
    ("exc", "code", "word"),
    [
        (FileNotFoundError(errno.ENOENT, "No such file or directory", "runs/x"), 2, "refused"),
        (IsADirectoryError(errno.EISDIR, "Is a directory", "record.json"), 2, "refused"),
        (PermissionError(errno.EACCES, "Permission denied", "/root/x"), 2, "refused"),
        (OSError(errno.ENOSPC, "No space left on device"), 1, "error: OSError"),
        (OSError(errno.EIO, "Input/output error"), 1, "error: OSError"),
        (OSError(errno.EROFS, "Read-only file system"), 1, "error: OSError"),
    ],
)
def test_a_path_the_user_gave_is_refused_but_a_failing_machine_is_an_error(exc, code, word, capsys):
    assert cli.report_failure("report", exc) == code
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"harness report: {word}") and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("proposer", ["medusa", "hydra", "eagle"])
def test_harness_train_calls_a_folder_published_only_when_it_holds_a_published_checkpoint(
    tmp_path, capsys, no_models, proposer
):
    """`harness train proposer.artifact=DIR` said of an empty folder (any folder without manifest.json)
    that it "is a published checkpoint: a run loads it as it is", where a run refuses it as no
    published checkpoint. A folder is said to be published only when it holds config.json and the
    layout's weights; any other folder is refused as no artifact."""
    empty = tmp_path / "empty"
    empty.mkdir()
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text("{}")
    weights = {"medusa": "medusa_lm_head.safetensors", "hydra": "hydra_lm_head.pt", "eagle": "pytorch_model.bin"}
    published = tmp_path / "published"
    published.mkdir()
    (published / "config.json").write_text("{}")
    (published / weights[proposer]).write_bytes(b"weights")
    for path in (empty, config_only):
        argv = ["train", "model=tiny", f"proposer={proposer}", f"proposer.artifact={path}"]
        assert cli.main(argv) == 2
        line = one_line(capsys, f"harness train: refused: proposer.artifact={str(path)!r} ")
        assert "holds no manifest.json (not an artifact)" in line and "published" not in line, line
    assert cli.main(["train", "model=tiny", f"proposer={proposer}", f"proposer.artifact={published}"]) == 2
    line = one_line(capsys, f"harness train: refused: proposer.artifact={str(published)!r} ")
    assert f"is a published {proposer} checkpoint: a run loads it as it is, nothing is trained here" in line
    if proposer == "medusa":  # a Medusa-2 full model's weights are a published layout too
        (published / weights[proposer]).unlink()
        (published / "model.safetensors").write_bytes(b"weights")
        assert cli.main(["train", "model=tiny", "proposer=medusa", f"proposer.artifact={published}"]) == 2
        assert "is a published medusa checkpoint" in one_line(capsys, "harness train: refused: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config_only", "empty", "published"]
    assert [p.name for p in empty.iterdir()] == []


@pytest.mark.parametrize(
    "argv, refusal",
    [
        (
            ["train", "model=tiny", "proposer=medusa", "generation.max_new_tokens=0"],
            "generation.max_new_tokens=0 is out of range",
        ),
        (
            ["train", "model=tiny", "proposer=medusa", "output_dir=/nowhere", "proposer.data.token_budget=2"],
            "proposer.data.token_budget=2 is out of range",
        ),
        (["calibrate", "model=tiny", "topology=sequence", "output_dir=/nowhere"], "needs topology=sequoia"),
        (["calibrate", "model=tiny", "output_dir=/nowhere", "topology.max_nodes=0"], "max_nodes=0"),
    ],
)
def test_a_refused_train_or_calibrate_prints_no_note_of_its_unread_options(capsys, no_models, argv, refusal):
    """`harness train ... generation.max_new_tokens=0` printed a note that the option has no effect,
    then refused it; `harness calibrate ... output_dir=X` likewise noted output_dir before refusing
    the topology. A refused command prints its refusal alone."""
    assert cli.main(argv) == 2
    line = one_line(capsys, f"harness {argv[0]}: refused: ")
    assert refusal in line and "no effect here" not in line


def test_harness_train_and_calibrate_note_their_unread_options_once_they_proceed(tmp_path, capsys, monkeypatch):
    """The note of the options a command does not read comes once nothing was refused: before the
    training or the measurement, after the models load."""
    import harness.app as app

    said = []

    def trainer(cfg, *, target, force):
        said.append(capsys.readouterr().err)
        return {"kind": "medusa", "path": "p"}

    monkeypatch.setattr(app, "load_models", lambda cfg: ("target", None))
    monkeypatch.setattr(app, "resolve_ref", lambda ref: trainer)
    assert cli.main(["train", "model=tiny", "proposer=medusa", "generation.max_new_tokens=8"]) == 0
    assert said[0].strip() == (
        "harness train: note: option(s) with no effect here: generation.max_new_tokens=8: train decodes nothing: "
        "it trains on proposer.data (a skip search on proposer.search)"
    )
    assert json.loads(capsys.readouterr().out) == {"kind": "medusa", "path": "p"}

    class Artifacts:
        tree = None

        def summary(self):
            return {"chosen": None}

    def measure(cfg, context, *, force, progress):
        said.append(capsys.readouterr().err)
        return Artifacts()

    monkeypatch.setattr(app, "load", lambda cfg, planned: "loaded")
    monkeypatch.setattr(app, "build_context", lambda cfg, loaded: None)
    monkeypatch.setattr(app, "ensure_tree_artifact", measure)
    monkeypatch.setattr(app, "slower_than_ar_note", lambda chosen: None)
    monkeypatch.setattr(app, "idle_nodes_note", lambda tree: None)
    argv = [
        "calibrate",
        "model=tiny",
        "proposer=draft_model",
        "proposer.sampling=without_replacement",
        "verifier=sequoia",
        "generation.temperature=0.7",
        f"output_dir={tmp_path / 'unread'}",
    ]
    assert cli.main(argv) == 0
    assert (
        said[1]
        .strip()
        .endswith(
            f"harness calibrate: note: option(s) with no effect here: output_dir={tmp_path / 'unread'}: calibrate "
            "writes its artifacts to $HARNESS_CACHE/sequoia"
        )
    ), said[1]
    assert json.loads(capsys.readouterr().out) == {"chosen": None, "notes": []}
    assert not (tmp_path / "unread").exists()


def test_a_job_run_with_hydra_job_chdir_reads_paths_relative_to_where_the_command_ran(
    tmp_path, workload, capsys, monkeypatch
):
    """``hydra.job.chdir=true`` moves a job into its folder; a relative ``workload.path`` still names
    the file beside the command, and the run writes its record to its folder."""
    monkeypatch.chdir(tmp_path)
    argv = [
        a if not a.startswith("workload.path=") else f"workload.path={workload.name}"
        for a in argv_for(tmp_path, workload, "gates.enabled=false", "hydra.job.chdir=true")
        if not a.startswith("output_dir=")
    ]
    assert run_main(argv) == 0, capsys.readouterr().err
    record = json.loads((tmp_path / "hydra" / "record.json").read_text())
    assert record["config"]["workload"]["path"] == workload.name
    assert Path.cwd() == tmp_path


def _ends_on_its_one_line(err: str, said: str) -> None:
    """``said`` starts a line of its own on the terminal (nothing shown before it on its line) and is
    the last thing written: no bar text nor carriage return after it."""
    before, _, after = err.rpartition(said)
    shown = before.rpartition("\n")[2].rpartition("\r")[2]  # what the terminal shows before it on its line
    assert before and shown == "", err
    assert after.endswith("\n") and "\r" not in after and "\n" not in after[:-1], err


@pytest.mark.parametrize(
    "batch, patched",
    [(1, "validate_commit"), (2, "batched_commit_kind")],
    ids=["one request", "batched"],
)
@pytest.mark.parametrize(
    "failure, said",
    [(KeyboardInterrupt, "harness run: interrupted"), (RuntimeError("boom"), "harness run: error: RuntimeError: boom")],
    ids=["interrupted", "error"],
)
def test_a_run_stopped_in_the_path_equivalence_gate_clears_its_progress_bar_before_the_one_line(
    tmp_path, workload, capsys, monkeypatch, batch, patched, failure, said
):
    """A run stopped inside the path-equivalence gate (after its first rows were compared) wipes the
    gate's progress bar before saying why: the one line stands alone, and is the last one."""
    import gc

    import harness.gates.equivalence as equivalence

    calls = []

    def stops(*args, **kwargs):
        calls.append(1)
        raise failure

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))  # no cached gate verdict to reuse
    monkeypatch.setenv("HARNESS_TRACEBACK", "0")
    monkeypatch.setenv("CXX", "false")  # no native kernels to compile into the fresh cache
    monkeypatch.setattr(equivalence, patched, stops)
    argv = argv_for(tmp_path, workload, "model.linear_kernel=default", "model.fused_layers=false", "gates.oracle=false")
    assert run_main([*argv, f"generation.batch_size={batch}"]) in (1, 130)
    gc.collect()  # a bar left open would draw itself again when collected
    assert calls, "the gate was not reached"
    err = capsys.readouterr().err
    assert "gate: path equivalence" in err, err  # the bar was drawn
    _ends_on_its_one_line(err, said)


@pytest.mark.parametrize(
    "module, stage, desc",
    [
        ("harness.prepare.heads_data", "_float16_rows", "target hidden states"),
        ("harness.prepare.early_exit", "optimiser_step", "train early-exit adapter"),
    ],
    ids=["hidden states", "adapter training"],
)
@pytest.mark.parametrize(
    "failure, said",
    [(KeyboardInterrupt, "harness train: interrupted"), (RuntimeError("boom"), "harness train: error: RuntimeError")],
    ids=["interrupted", "error"],
)
def test_early_exit_training_stopped_midway_clears_its_progress_bar_before_the_one_line(
    tmp_path, capsys, monkeypatch, module, stage, desc, failure, said
):
    """`harness train proposer=early_exit` stopped while encoding the target's hidden states or while
    distilling the adapter wipes that progress bar before saying why: the one line stands alone, and
    is the last one."""
    import gc

    calls = _fails_at_its_second_call(monkeypatch, module, stage, failure)
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HARNESS_TRACEBACK", "0")
    argv = ["train", "proposer=early_exit", "proposer.exit_layer=1", "model=tiny", "model.linear_kernel=default"]
    argv += ["threads=1", "proposer.data.token_budget=300", "proposer.data.held_out_tokens=100"]
    argv += ["proposer.data.max_len=50"]
    assert cli.main(argv) in (1, 130)
    gc.collect()  # a bar left open would draw itself again when collected
    assert len(calls) == 2
    err = capsys.readouterr().err
    assert desc in err, err  # the bar was drawn
    _ends_on_its_one_line(err, said)
