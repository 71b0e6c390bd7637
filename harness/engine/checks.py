"""Checks of a composed config that need no model: :func:`validate_config` runs first in
:func:`harness.engine.build.plan`, so every command refuses bad values before any model work.

* ``proposer.name`` and ``topology.name``, which select the code that runs, against the group option
  composed (its schema: the options the named code takes);
* every option's declared range (a :class:`~harness.contracts.Range` in its schema field's
  metadata, ``harness/config.py``) and every required (``???``) value;
* values that constrain each other (``min_ngram <= max_ngram``, a tiny model's head geometry, a
  parametric draft's vocabulary against the target's; where the statistical gate runs, enough
  chi-square samples for its bins, and no more binned tokens than a vocabulary known from the config;
  no more Sequoia calibration siblings than that vocabulary);
* what the machine must provide for the models the run loads: their device (no ``cuda`` on a
  torch without CUDA) and their checkpoint (an existing folder with a readable ``config.json``, or
  a well-formed hub id; ``model=hf`` needs ``model.name_or_path``).

Each refusal is a :class:`~harness.contracts.ConfigError` naming the key, the value and what is
valid; where a change is certain to be accepted it is offered as a suggestion.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from pathlib import Path

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from harness.contracts import ConfigError, Range, format_override
from harness.files import output_folder_problem
from harness.target.loading import SMOLLM2_GEOMETRY

#: model names the loader builds itself; any other name is a checkpoint folder or a hub id
BUILTIN_MODELS = ("smollm2", "tiny", "hf")
#: the shape of a Hugging Face hub id: ``name`` or ``org/name``
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
#: devices a run may name (``cpu``, ``cuda``, ``cuda:N``, ``mps``, ``xpu``), each checked against this torch
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
#: the chi-square approximation wants an expected count of at least this many per bin
CHI2_MIN_PER_BIN = 5


def validate_config(cfg: DictConfig, *, devices_here: bool = True) -> None:
    """Refuse a config whose values cannot run, before any model work (see the module docstring).
    ``devices_here=False``: the jobs run on other machines (a cluster's), so a device is checked as
    a name, not for being on this one."""
    check_selected_names(cfg)
    check_declared(cfg)
    for key, model in models_in_use(cfg):
        check_model(key, model, devices_here=devices_here)
    check_related_values(cfg)


# --------------------------------------------------------------------------- names that select code

#: the config groups whose ``name`` selects the code that runs (a proposer class, a topology's
#: budget) while the group option composed (``proposer=<name>``) gives the node's options and schema.
#: ``verifier.name`` selects a verifier too, but every verifier shares one schema (and an unknown
#: name is refused when the plan looks it up); ``tracking.name`` and ``workload.name`` declare their
#: choices, each choice on the one schema of its group; ``model.name`` is free (a hub id or a folder)
NAMED_GROUPS = ("proposer", "topology")
#: the folder of the config groups (``harness/conf``)
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


#: the config schemas by group and name (``harness.config.SCHEMAS``), given by the configuration
#: layer when it registers them (:func:`register_schemas`): this layer imports none of it
_SCHEMAS: dict[str, dict[str, type]] = {}


def register_schemas(schemas: dict[str, dict[str, type]]) -> None:
    """Read the schemas ``conf/<group>/<option>.yaml`` compose over from ``schemas`` (group -> schema
    name -> dataclass), for :func:`check_selected_names`."""
    _SCHEMAS.clear()
    _SCHEMAS.update(schemas)


def packaged_schema(group: str, option: str) -> type | None:
    """The schema (a dataclass :func:`register_schemas` gave) that ``conf/<group>/<option>.yaml``
    composes over (its first ``/schema/<group>/<schema>@_here_`` default), or None for no such option."""
    path = CONF_DIR / group / f"{option}.yaml"
    if not path.is_file():
        return None
    prefix = f"/schema/{group}/"
    for entry in OmegaConf.load(path).get("defaults") or []:
        if isinstance(entry, str) and entry.startswith(prefix):
            return _SCHEMAS.get(group, {}).get(entry[len(prefix) :].split("@", 1)[0])
    return None


def group_option_names(group: str) -> list[str]:
    """The options of ``conf/<group>/`` (its YAML files)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def check_selected_names(cfg: DictConfig) -> None:
    """``proposer.name`` and ``topology.name`` (:data:`NAMED_GROUPS`) name an option of their group
    whose packaged config has the node's schema. Set apart from the group option composed
    (``proposer.name=rest`` over prompt lookup's options), the named code would run on options it
    does not take and fail after the models load; options that share the node's schema (medusa,
    hydra and clover; sequence, sequences, set, expansion, merged and dynamic) take each other's
    options, so naming one of them is accepted."""
    if not _SCHEMAS:  # no schemas registered: no composed config to check against them
        return
    for group in NAMED_GROUPS:
        node = cfg.get(group)
        schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
        if not dataclasses.is_dataclass(schema) or OmegaConf.is_missing(node, "name"):
            continue
        name = str(node.name)
        options = group_option_names(group)
        if name not in options:
            close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
            fix = [f"{group}.name={close[0]}"] if close else []
            if close and packaged_schema(group, close[0]) is not schema:
                fix.insert(0, f"{group}={close[0]}")
            raise ConfigError(
                f"{group}.name={name} is no {group}; {group}=<name> selects one of {', '.join(options)}",
                suggestions=[tuple(fix)] if fix else [],
            )
        if packaged_schema(group, name) is schema:
            continue
        composed = [o for o in options if packaged_schema(group, o) is schema]
        raise ConfigError(
            f"{group}.name={name} names another {group} than the options composed ({group}="
            f"{'|'.join(composed) or '?'}, schema {schema.__name__}), which {name} does not take: {group}=<name> "
            f"selects a {group} with its options",
            suggestions=[(f"{group}={name}",)],
        )


# --------------------------------------------------------------------------- declared ranges


def check_declared(node: DictConfig, prefix: str = "") -> None:
    """Every value under ``node`` against the range its schema field declares; required values set."""
    typ = OmegaConf.get_type(node)
    fields = {f.name: f for f in dataclasses.fields(typ)} if dataclasses.is_dataclass(typ) else {}
    for key in node.keys():
        if not prefix and key == "hydra":
            continue
        full = f"{prefix}.{key}" if prefix else str(key)
        if fields and key not in fields:  # added with a leading '+'
            where = f"{prefix} ({typ.__name__})" if prefix else "the config"
            raise ConfigError(f"{full} is no option: {where} has {sorted(fields)}")
        if OmegaConf.is_missing(node, key):
            raise ConfigError(f"{full} is required (it is ???): set {full}=<value>")
        try:
            value = node[key]
        except OmegaConfBaseException as exc:  # an interpolation that does not resolve
            raise ConfigError(f"{full}: {str(exc).splitlines()[0]}") from None
        spec = fields[key].metadata.get("range") if key in fields else None
        if isinstance(value, (DictConfig, ListConfig)):
            if isinstance(spec, Range):
                spec.check(full, OmegaConf.to_container(value, resolve=True))
            if isinstance(value, DictConfig):
                check_declared(value, full)
        elif isinstance(spec, Range):
            spec.check(full, value)


# --------------------------------------------------------------------------- models


def models_in_use(cfg: DictConfig) -> list[tuple[str, DictConfig]]:
    """(key, model config) of every model the run loads: the target and a separate draft model."""
    out = [("model", cfg.model)]
    name = cfg.proposer.get("name")
    if name == "draft_model":
        out.append(("proposer.model", cfg.proposer.model))
    elif name == "merged" and "draft_model" in (cfg.proposer.get("sources") or []):
        out.append(("proposer.draft_model.model", cfg.proposer.draft_model.model))
    return out


def check_model(key: str, m: DictConfig, *, devices_here: bool = True) -> None:
    check_device(f"{key}.device", str(m.device), here=devices_here)
    if m.name == "tiny":
        if m.get("name_or_path"):
            raise ConfigError(
                f"{key}.name_or_path={m.name_or_path} does not apply to {key}.name=tiny, a model built here with "
                f"random weights: load the checkpoint with {key}.name=hf",
                suggestions=[(f"{key}.name=hf",)],
            )
        check_tiny(f"{key}.tiny", m.tiny)
        return
    if m.name == "hf" and not m.name_or_path:
        what = "model=hf" if key == "model" else f"{key}.name=hf"
        raise ConfigError(f"{what} needs {key}.name_or_path=<a checkpoint folder or a hub id>")
    if m.name_or_path:
        check_checkpoint(f"{key}.name_or_path", str(m.name_or_path))
    elif m.name not in BUILTIN_MODELS:
        close = difflib.get_close_matches(str(m.name), BUILTIN_MODELS, n=1, cutoff=0.75)
        if close and not Path(str(m.name)).expanduser().exists():
            fix = f"{key}.name={close[0]}"
            raise ConfigError(
                f"{key}.name={m.name!r} is no model this harness builds and no checkpoint folder "
                f"(a hub id would be looked up on the network)",
                suggestions=[(fix,)],
            )
        check_checkpoint(f"{key}.name", str(m.name))


def check_device(key: str, device: str, *, here: bool = True) -> None:
    """``device`` names a device a run can use and, unless the run is elsewhere (``here=False``),
    this machine has it."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"{key}={device!r} is not a torch device ({exc})", suggestions=[(f"{key}=cpu",)]) from None
    if dev.type not in DEVICE_TYPES:
        raise ConfigError(f"{key}={device} is not a device a run can use: one of {list(DEVICE_TYPES)}")
    if dev.type == "cpu" or not here:
        return
    backend = torch.backends.mps if dev.type == "mps" else getattr(torch, dev.type)
    if not backend.is_available():
        raise ConfigError(
            f"{key}={device}: this torch ({torch.__version__}) has no {dev.type.upper()} device",
            suggestions=[(f"{key}=cpu",)],
        )
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if dev.index is not None and dev.index >= count:
        raise ConfigError(
            f"{key}={device}: this machine has {count} {dev.type} device(s) (indices 0 to {count - 1})",
            suggestions=[(f"{key}={dev.type}:0",)],
        )


def check_checkpoint(key: str, source: str) -> None:
    """A local checkpoint folder with a readable config.json, or a well-formed hub id."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{key}={source}: a checkpoint is a folder (config.json, weights, tokenizer); got a file")
        config = path / "config.json"
        if not config.is_file():
            raise ConfigError(f"{key}={source}: the folder has no config.json, so it is no transformers checkpoint")
        try:
            loaded = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{key}={source}: cannot read {config}: {exc}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{key}={source}: {config} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
            ) from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{key}={source}: {config} must hold a JSON object; got {type(loaded).__name__}")
        return
    if source.startswith(("/", "./", "../", "~")) or source in {".", ".."}:
        raise ConfigError(f"{key}={source}: no such checkpoint folder")
    if not HUB_ID.match(source) or "--" in source or ".." in source or len(source) > 96:
        raise ConfigError(f"{key}={source!r} is neither an existing checkpoint folder nor a hub id (org/name)")


def check_tiny(key: str, tiny: DictConfig) -> None:
    hidden, heads, kv = int(tiny.hidden_size), int(tiny.num_heads), int(tiny.num_kv_heads)
    if hidden % heads:
        raise ConfigError(f"{key}.hidden_size={hidden} must be a multiple of {key}.num_heads={heads}")
    if (hidden // heads) % 2:
        raise ConfigError(
            f"{key}.hidden_size / {key}.num_heads = {hidden // heads} must be even (rotary embeddings rotate pairs)"
        )
    if heads % kv:
        raise ConfigError(f"{key}.num_heads={heads} must be a multiple of {key}.num_kv_heads={kv}")


# --------------------------------------------------------------------------- values that constrain each other


#: the smallest temperature above 0 a run takes, a conservative floor: far below it, logits over the
#: temperature overflow float32 (1e-40 is subnormal: inf, then NaN) and the sampling has no mass
MIN_TEMPERATURE = 1e-6
#: the largest temperature a run takes, a conservative ceiling: far above it, float32 logits over the
#: temperature round to one value (above float32's largest, to 0): top_k and top_p keep every token,
#: ranked by index, and the law the runs sample differs from the one a float64 oracle computes
MAX_TEMPERATURE = 1e4


def check_related_values(cfg: DictConfig) -> None:
    temperature = float(cfg.generation.temperature)
    if 0.0 < temperature < MIN_TEMPERATURE:
        raise ConfigError(
            f"generation.temperature={cfg.generation.temperature}: a temperature above 0 must be at least "
            f"{MIN_TEMPERATURE:g}, a conservative floor (far below it the target's law overflows in float32); "
            "0 decodes greedily",
            suggestions=[("generation.temperature=0",), (f"generation.temperature={MIN_TEMPERATURE:g}",)],
        )
    if temperature > MAX_TEMPERATURE:
        raise ConfigError(
            f"generation.temperature={cfg.generation.temperature}: a temperature must be at most "
            f"{MAX_TEMPERATURE:g}, a conservative ceiling (far above it the target's logits over the temperature "
            "round to one value in float32, and top_k and top_p no longer select)",
            suggestions=[(f"generation.temperature={MAX_TEMPERATURE:g}",)],
        )
    for key, node in proposer_nodes(cfg.proposer, "proposer"):
        if "min_ngram" in node and int(node.min_ngram) > int(node.max_ngram):
            raise ConfigError(
                f"{key}.min_ngram={node.min_ngram} exceeds {key}.max_ngram={node.max_ngram}",
                suggestions=[(f"{key}.min_ngram={node.max_ngram}",)],
            )
        if "min_suffix" in node and int(node.min_suffix) > int(node.max_suffix):
            raise ConfigError(
                f"{key}.min_suffix={node.min_suffix} exceeds {key}.max_suffix={node.max_suffix}",
                suggestions=[(f"{key}.min_suffix={node.max_suffix}",)],
            )
        store = node.get("datastore")
        if store is not None and store.get("path") is None:  # built as configured: its limits are the config's
            for option, limit in (
                ("max_suffix", "context_len"),
                ("max_matches", "max_matches"),
                ("continuation_len",) * 2,
            ):
                if option in node and limit in store and int(node[option]) > int(store[limit]):
                    raise ConfigError(
                        f"{key}.{option}={node[option]} exceeds {key}.datastore.{limit}={store[limit]}: a datastore "
                        f"built so serves at most {store[limit]}",
                        suggestions=[(f"{key}.{option}={store[limit]}",), (f"{key}.datastore.{limit}={node[option]}",)],
                    )
    check_disjoint_splits(cfg)
    models = dict(models_in_use(cfg))
    for key, draft in models.items():
        if key == "model" or draft.name != "tiny" or cfg.model.name != "tiny":
            continue
        target_vocab, draft_vocab = int(cfg.model.tiny.vocab_size), int(draft.tiny.vocab_size)
        if draft_vocab != target_vocab:
            raise ConfigError(
                f"{key}.tiny.vocab_size={draft_vocab} differs from model.tiny.vocab_size={target_vocab}: "
                "a parametric draft shares the target's tokenizer",
                suggestions=[(f"{key}.tiny.vocab_size={target_vocab}",)],
            )
    check_chi_square(cfg)
    check_calibration_branches(cfg)


def check_calibration_branches(cfg: DictConfig) -> None:
    """A Sequoia calibration drafts ``topology.calibration.branches`` distinct siblings below each
    parent: no more than a vocabulary known from the config (:func:`known_vocabulary`; a checkpoint's
    is checked once the model has loaded, before the calibration runs)."""
    t = cfg.topology
    cal = t.get("calibration") if t.get("name") == "sequoia" else None
    if cal is None:
        return
    vocab = known_vocabulary(cfg.model)
    if vocab is not None and int(cal.branches) > vocab[0]:
        raise ConfigError(
            f"topology.calibration.branches={cal.branches} exceeds the target's vocabulary ({vocab[0]} tokens, "
            f"{vocab[1]}): the calibration drafts that many siblings of one parent, each a token of it",
            suggestions=[(f"topology.calibration.branches={vocab[0]}",)],
        )


def check_chi_square(cfg: DictConfig) -> None:
    """The statistical gate's options against each other and the target's vocabulary, where the gate
    runs: at temperature 0, or with no gate, its options are inert (the run lists them), not refused."""
    g = cfg.gates
    if float(cfg.generation.temperature) == 0.0 or not g.get("enabled", True):
        return
    vocab = known_vocabulary(cfg.model)
    if vocab is not None and int(g.chi2_top_m) > vocab[0]:
        raise ConfigError(
            f"gates.chi2_top_m={g.chi2_top_m} exceeds the target's vocabulary ({vocab[0]} tokens, {vocab[1]}): "
            "the test bins at most every token of it",
            suggestions=[(f"gates.chi2_top_m={vocab[0]}",)],
        )
    bins = int(g.chi2_top_m) + 1
    if int(g.chi2_samples) < CHI2_MIN_PER_BIN * bins:
        need = CHI2_MIN_PER_BIN * bins
        raise ConfigError(
            f"{format_override('gates.chi2_samples', g.chi2_samples)} is too few for gates.chi2_top_m="
            f"{g.chi2_top_m}: the chi-square test needs at least {CHI2_MIN_PER_BIN} samples per bin "
            f"({bins} bins: the top {g.chi2_top_m} tokens and the rest), so >= {need}",
            suggestions=[(f"gates.chi2_samples={need}",)],
        )


def known_vocabulary(model: DictConfig) -> tuple[int, str] | None:
    """The vocabulary size of a target known from its config alone, and where it comes from: a tiny
    model's ``model.tiny.vocab_size`` or the embedded SmolLM2's; None for a checkpoint (its config
    is read with the model)."""
    if model.name == "tiny":
        return int(model.tiny.vocab_size), "model.tiny.vocab_size"
    if model.name == "smollm2" and not model.get("name_or_path"):
        return int(SMOLLM2_GEOMETRY["vocab_size"]), "model=smollm2"
    return None


def check_disjoint_splits(cfg: DictConfig) -> None:
    """What a proposer trains or searches on is no split the run evaluates: heads, EAGLE drafts and
    early-exit adapters train on ShareGPT's ``data.split`` (and check it on ``data.held_out_split``),
    a layer-skip search scores skip vectors on ``search.workload``'s ``search.split``. A published
    checkpoint (``proposer.artifact``) trains nothing here; an artifact trained here and given by
    path (a folder with its ``manifest.json``) matches the configured recipe, so it trained on
    ``data.split`` and is checked alike. A given skip vector searches nothing."""
    w = cfg.workload
    evaluated = (str(w.name), str(w.get("split")))
    for key, node in proposer_nodes(cfg.proposer, "proposer"):
        data = node.get("data")
        artifact = node.get("artifact")
        trained_here = artifact is None or (Path(str(artifact)).expanduser() / "manifest.json").is_file()
        if data is not None and trained_here:
            if str(data.split) == str(data.held_out_split):
                raise ConfigError(
                    f"{key}.data.held_out_split={data.held_out_split} is the training split ({key}.data.split): "
                    "the held-out rows must be others"
                )
            if (str(data.get("source", "sharegpt")), str(data.split)) == evaluated:
                raise ConfigError(
                    f"{key}.data.split={data.split} is the split this run evaluates (workload={w.name} "
                    f"workload.split={w.split}): the proposer would train on the prompts it is measured on"
                )
        search = node.get("search")
        if search is not None and node.get("skip") is None and (str(search.workload), str(search.split)) == evaluated:
            raise ConfigError(
                f"{key}.search.split={search.split} is the split this run evaluates (workload={w.name} "
                f"workload.split={w.split}): the skip search would choose its layers on the prompts it is measured on"
            )


def proposer_nodes(node: DictConfig, key: str) -> list[tuple[str, DictConfig]]:
    """The proposer's config and, for a merged tree, each source's sub-config."""
    out = [(key, node)]
    if node.get("name") == "merged":
        for source in node.get("sources") or []:
            if source in node:
                out.append((f"{key}.{source}", node[source]))
    return out


# --------------------------------------------------------------------------- output folders


def check_output_dir(key: str, path: str | os.PathLike, *, user_folder_problem=None) -> None:
    """``path`` is a folder this process can create or write into (:func:`output_folder_problem`);
    ``output_dir``, a folder the user names, is also one of the run's own where ``user_folder_problem``
    (``path -> why not, or None``: the runner's, which knows the files of records, sweeps and
    datastores) says so. A sweep's job folders (``the run folder``) lie in its sweep folder, named by
    the sweep."""
    problem = output_folder_problem(key, path)
    if problem is None and key == "output_dir" and user_folder_problem is not None:
        problem = user_folder_problem(path)
    if problem is not None:
        raise ConfigError(problem)
