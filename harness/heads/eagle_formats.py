"""Reading published EAGLE draft checkpoints (config plus weights, key for key).

Layouts read (key names and shapes from the public EAGLE, SpecForge, speculators and vLLM sources;
no file of theirs is used):

- ``eagle`` — EAGLE-1 and EAGLE-2 (SafeAILab/EAGLE; the hub's ``yuhuili/EAGLE-*``): a Llama-style
  ``config.json`` (one decoder layer; ``"bias": false`` drops ``fc.bias``; ``qkv_bias`` adds q/k/v
  biases; as in EAGLE's loader, a bias the weights hold that the config does not build is unused)
  and ``pytorch_model.bin`` or ``model.safetensors`` with ``fc.weight [H, 2H]`` (input
  ``concat(embedding, feature)``), ``fc.bias [H]``, ``layers.{l}.self_attn.{q,k,v,o}_proj.*``,
  ``layers.{l}.mlp.{gate,up,down}_proj.weight``, ``layers.{l}.post_attention_layernorm.weight``,
  ``layers.{l}.input_layernorm.weight`` for ``l >= 1`` only, and usually ``embed_tokens.weight``
  (a copy of the base model's embedding). No final norm and no LM head: the target's is used.
- ``eagle3`` — EAGLE-3 (EAGLE repo / SpecForge; ``yuhuili/EAGLE3-*``): config with
  ``draft_vocab_size`` (optionally ``target_hidden_size``), weights ``fc.weight [H, 3 H_t]``,
  ``midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight``,
  ``midlayer.self_attn.{q,k,v}_proj.weight [*, 2H]``, ``o_proj``, ``midlayer.mlp.*``,
  ``norm.weight``, ``lm_head.weight [Vd, H]``, ``d2t [Vd]`` (unused when ``Vd == V``, as EAGLE's
  code drops it) and ``t2d [V]`` (not read by the draft, but checked: true exactly at the ids ``d2t``
  maps the draft vocabulary to), optionally ``embed_tokens.weight``; q/k/v biases only where the
  config says ``attention_bias`` (EAGLE's code builds none).
- ``speculators-eagle3`` — vLLM's ``speculators`` format (``speculators_model_type: eagle3``;
  ``transformer_layer_config`` holds the decoder layer's config): the EAGLE-3 keys with
  ``midlayer.`` spelled ``layers.0.``.
- ``speculators-eagle`` — the older ``speculators_model_type: eagle`` form of EAGLE-1
  (``fusion_fc.*`` and ``transformer.*``), read only without its extra layernorms
  (``layernorms: false``); that variant (HASS) is refused.

Uncertain points, stated rather than guessed: which layers an EAGLE-3 checkpoint fuses is not in
the EAGLE repo's config (its code uses ``2, N // 2, N - 3``; speculators writes
``eagle_aux_hidden_state_layer_ids`` when it differs), so that default is used unless the config
names them; EAGLE's code places pair ``j`` at position ``j`` while speculators trains it at
``j + 1`` (RoPE sees only offsets within one call of the draft, so outputs agree either way);
whether every hub checkpoint carries ``embed_tokens.weight`` was not verified (when present it is
used, as EAGLE does; otherwise the target's embedding is).

Weights are read from ``model.safetensors`` or else ``pytorch_model.bin`` (the other, where both are
present, is noted as left unread), or from the shards a shard index names, each tensor from the shard
the index assigns it to (:func:`read_weights`).

Every check against the target (hidden size, vocabulary, fused layers, ``d2t`` range) refuses with
the expected and the actual value before anything runs. ``config.json``'s settings are read as their
JSON types (a whole number, a number, a boolean, a list of layer indices; a string or a fraction
where a whole number belongs is refused, never converted), and what the config of a local folder
decides (its types, hidden size, vocabulary and fused layers) is checked when the run is planned,
before the target loads, by the same code the load runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
from pathlib import Path

import torch

from harness.heads.checkpoint import ArtifactError, check_weight_tensors, read_config_object, unreadable_tensor_file
from harness.heads.eagle import EagleSpec
from harness.target.loading import hub_unreachable, looks_like_hub_id

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
#: keys a published file may carry that the draft does not need: a decoder layer's rotary frequencies
#: (computed from the config). EAGLE-3's target-to-draft mask ``t2d`` is not one: it is checked against
#: ``d2t`` (:func:`_check_t2d`), and noted as unread beside an EAGLE-1/2 draft
IGNORED_KEYS = re.compile(r"(?:layers\.\d+|midlayer)\.self_attn\.rotary_emb\.inv_freq")
_QKV_BIAS = re.compile(r"(?:layers\.\d+|midlayer)\.self_attn\.[qkv]_proj\.bias")


def is_published_dir(path: Path) -> bool:
    """A directory in a published layout: ``config.json`` and weights, no harness manifest."""
    return (
        path.is_dir()
        and (path / "config.json").is_file()
        and not (path / "manifest.json").is_file()
        and any((path / f).is_file() for f in WEIGHT_FILES + INDEX_FILES)
    )


def published_draft_vocab(options) -> int | None:
    """The draft vocabulary of the published EAGLE-3 draft ``options`` names by a local folder
    (``draft_vocab_size`` in its config.json), or None: no such folder, no reduced vocabulary, or a
    config that cannot be read (the load then says why). Read before any model work."""
    artifact = options.get("artifact") if options is not None else None
    path = Path(str(artifact)).expanduser() if artifact else None
    if path is None or not path.is_dir() or not is_published_dir(path):
        return None
    try:
        size = json.loads((path / "config.json").read_text(encoding="utf-8")).get("draft_vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return int(size) if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def published_config_problem(artifact, geometry) -> str | None:
    """Why the published EAGLE draft in local folder ``artifact`` cannot serve the target whose
    ``geometry()`` (layers, hidden size, vocabulary) is given, read from its config.json (and, where
    they can be read without the tensors, its weights' names) before any model work, by the rules
    the load applies (the weights are checked again when they load): a setting of the wrong type,
    another hidden size or vocabulary, EAGLE-3's fused layers outside the target. None: no such
    folder, a harness artifact's, a config that cannot be read (the load says why), or a fit; a
    folder in neither layout is refused. A draft by hub id is checked when it loads."""
    path = Path(str(artifact)).expanduser() if artifact else None
    if path is None or not path.is_dir() or (path / "manifest.json").is_file():
        return None
    if not is_published_dir(path):  # a folder of something else (a head bank, a model): said before loading
        return not_an_eagle_draft(str(artifact))
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # the load names what is wrong with it
    if not isinstance(cfg, dict):
        return None
    try:
        with config_refusals():
            fmt, layer = draft_layout(cfg, weight_names(path))
            fields = _layer_fields(layer)
            eagle3 = fmt.endswith("eagle3")
            hidden = _whole(layer, "target_hidden_size", fields["hidden_size"]) if eagle3 else fields["hidden_size"]
            vocab = _whole(layer, "vocab_size", None)
            if eagle3:
                _whole(layer, "draft_vocab_size", None)
    except ArtifactError as exc:
        return f"proposer.artifact={artifact!r}: {exc}"
    target = geometry()
    where = f"proposer.artifact={artifact!r} ({'EAGLE-3' if eagle3 else 'EAGLE'} draft)"
    if hidden != int(target["hidden_size"]):
        return (
            f"{where} reads features of hidden size {hidden}; the target's is {target['hidden_size']}: "
            "a draft serves the model it was trained for"
        )
    if vocab is not None and vocab != int(target["vocab_size"]):
        return f"{where} has vocab_size {vocab}; the target's vocabulary is {target['vocab_size']}"
    if eagle3:
        try:
            fused_layers(fmt, layer, int(target["num_hidden_layers"]))
        except ArtifactError as exc:
            return f"proposer.artifact={artifact!r}: {exc}"
    return None


def weight_names(path: Path) -> set[str] | None:
    """The tensor names of the published directory ``path`` where they can be read without its
    tensors (a shard index's ``weight_map``, a ``model.safetensors`` header), in the order
    :func:`read_weights` looks for its files; None where they cannot (a ``pytorch_model.bin``, a
    file that does not parse: the load reads or refuses it)."""
    for name in INDEX_FILES:
        if (path / name).is_file():
            try:
                weight_map = json.loads((path / name).read_text(encoding="utf-8")).get("weight_map")
            except (OSError, ValueError, AttributeError):
                return None
            return set(weight_map) if isinstance(weight_map, dict) else None
    if not (path / WEIGHT_FILES[0]).is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path / WEIGHT_FILES[0]), framework="pt") as f:
            return set(f.keys())
    except Exception:  # a truncated or empty file: the load says why
        return None


def not_an_eagle_draft(source: str) -> str:
    """The refusal of a folder that holds neither layout an EAGLE draft is read from."""
    return (
        f"proposer.artifact={source!r} is neither a harness EAGLE artifact (manifest.json) nor a "
        f"published EAGLE checkpoint (config.json plus one of {list(WEIGHT_FILES)})"
    )


def resolve_source(source: str, *, revision: str | None = None) -> Path:
    """A local directory, or a hub id downloaded to the hub cache (config and weights only; at commit
    ``revision`` where given, else the id's current one). A snapshot that holds no complete published
    checkpoint (an interrupted download, one that fetched ``config.json`` only) is refused: while the
    hub cannot be reached as not in the local hub cache, else as not an EAGLE draft."""
    path = Path(source).expanduser()
    if path.exists():
        if not is_published_dir(path):
            raise ArtifactError(not_an_eagle_draft(source))
        return path
    if not looks_like_hub_id(source):
        raise ArtifactError(f"proposer.artifact={source!r} does not exist (and is not a hub id owner/name)")
    offline = hub_unreachable()  # then the cache only, at once, not after the client's retries
    at = f" at revision {revision}" if revision else ""
    not_cached = (
        f"proposer.artifact={source!r} is not a local directory, not in the local hub cache{at}, and the hub "
        f"cannot be reached ({offline}): download the repository first or give its directory"
    )
    try:
        # huggingface_hub imports in ~0.3 s; only a hub id pays for it
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            repo_id=source,
            allow_patterns=["*.json", "*.safetensors", "*.bin"],
            local_files_only=offline is not None,
            **({"revision": revision} if revision else {}),
        )
    except Exception as exc:  # network, authentication, missing repository
        if offline is not None:
            raise ArtifactError(not_cached) from None
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ArtifactError(
            f"cannot download the EAGLE checkpoint {source!r}{at} from the hub: {type(exc).__name__}: {first}"
        ) from None
    local = Path(local)
    if not complete_checkpoint(local):
        if offline is not None:  # the cache holds part of it (config.json only, some shards)
            raise ArtifactError(not_cached)
        raise ArtifactError(not_an_eagle_draft(source) + f" (hub snapshot {local.name})")
    return local


def complete_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a whole published checkpoint: ``config.json`` and a weight file, or a
    shard index (a JSON object with a ``weight_map``) and every shard it names."""
    if not is_published_dir(path):
        return False
    for name in INDEX_FILES:
        if (path / name).is_file():
            try:
                weight_map = json.loads((path / name).read_text(encoding="utf-8")).get("weight_map")
            except (OSError, ValueError, AttributeError):
                return True  # present but unreadable: the load says why
            if not isinstance(weight_map, dict):
                return True
            return all(isinstance(f, str) and (path / f).is_file() for f in weight_map.values())
    return True


def _shard_map(path: Path, index: Path) -> dict[str, list[str]]:
    """shard file -> the tensor names the index ``index`` assigns to it, in the index's order."""
    weight_map = read_config_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ArtifactError(
            f"published checkpoint {str(path)!r}: {index.name}'s weight_map is not an object mapping each tensor "
            "name to its shard file"
        )
    shards: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        shards.setdefault(shard, []).append(key)
    return dict(sorted(shards.items()))


def _read_file(f: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        if f.suffix == ".safetensors":
            part = load_file(str(f))
        else:
            part = torch.load(str(f), map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or empty file, a pickle of something else
        raise unreadable_tensor_file(f, exc) from None
    if not isinstance(part, dict) or not all(isinstance(t, torch.Tensor) for t in part.values()):
        raise ArtifactError(f"{str(f)!r} holds a {type(part).__name__}, not a state dict of tensors")
    return part


def read_weights(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """The tensors of a published directory, each file's SHA-256, and notes on what was left unread.

    A shard index (``model.safetensors.index.json`` first, then ``pytorch_model.bin.index.json``)
    decides, as transformers reads it: from each shard only the tensors its ``weight_map`` assigns to
    that shard are taken; a tensor the index assigns to a shard that lacks it is refused (naming both);
    a tensor a shard holds that the index assigns elsewhere, or to no shard, is ignored (noted). Without
    an index the first of ``model.safetensors`` and ``pytorch_model.bin`` is read. Any of those files the
    folder holds that is not read (the other single file, a single file beside an index, the second
    index) is noted as left unread."""
    shards: dict[str, list[str]] | None = None
    read_first = None
    for name in INDEX_FILES:
        if (path / name).is_file():
            shards, read_first = _shard_map(path, path / name), name
            break
    if shards is None:
        files = [f for f in WEIGHT_FILES if (path / f).is_file()][:1]
        read_first = files[0] if files else None
        shards = {f: None for f in files}
    state: dict[str, torch.Tensor] = {}
    digests: dict[str, str] = {}
    notes: list[str] = []
    ignored: list[str] = []
    for name, keys in shards.items():
        f = path / name
        if not f.is_file():
            raise ArtifactError(f"published checkpoint {str(path)!r}: shard {name!r} missing")
        digests[name] = hashlib.sha256(f.read_bytes()).hexdigest()
        part = _read_file(f)
        if keys is None:
            state.update(part)
            continue
        lacking = [k for k in keys if k not in part]
        if lacking:
            raise ArtifactError(
                f"published checkpoint {str(path)!r}: {read_first} assigns {lacking[0]} to {name}, which does not "
                f"hold it{f' ({len(lacking) - 1} more such tensor(s))' if len(lacking) > 1 else ''}"
            )
        assigned = set(keys)
        ignored += [f"{k} in {name}" for k in part if k not in assigned]
        state.update({k: part[k] for k in keys})
    if ignored:
        more = f" and {len(ignored) - 3} more" if len(ignored) > 3 else ""
        notes.append(
            f"{', '.join(ignored[:3])}{more} not read: {read_first} assigns those tensors to another shard or none "
            "(the index decides, as transformers reads it)"
        )
    unread = [n for n in (*INDEX_FILES, *WEIGHT_FILES) if (path / n).is_file() and n != read_first and n not in shards]
    if unread and read_first is not None:
        notes.append(f"{', '.join(unread)} left unread: {read_first} is read first")
    if not state:
        raise ArtifactError(f"published checkpoint {str(path)!r}: its weight files hold no tensors")
    return state, digests, notes


def _shape(state: dict, key: str) -> tuple[int, ...] | None:
    t = state.get(key)
    return None if t is None else tuple(t.shape)


_REQUIRED = object()


def _whole(cfg: dict, key: str, default=_REQUIRED, *, least: int | None = 1) -> int:
    """``cfg[key]``, a JSON integer (not a boolean) of at least ``least``, or ``default`` where the key
    is absent or null (without a default the key is required: KeyError)."""
    if default is _REQUIRED:
        value = cfg[key]
    else:
        value = cfg.get(key)
        if value is None:
            return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArtifactError(f"EAGLE checkpoint config.json: {key}={value!r} is not a whole number (a JSON integer)")
    if least is not None and value < least:
        raise ArtifactError(f"EAGLE checkpoint config.json: {key}={value}; expected at least {least}")
    return value


def _number(cfg: dict, key: str, default: float) -> float:
    """``cfg[key]``, a finite positive JSON number (not a boolean), or ``default`` where absent."""
    if key not in cfg:
        return default
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ArtifactError(f"EAGLE checkpoint config.json: {key}={value!r} is not a positive number (a JSON number)")
    return float(value)


def _flag(cfg: dict, key: str, default: bool) -> bool:
    """``cfg[key]``, a JSON boolean, or ``default`` where absent."""
    if key not in cfg:
        return default
    value = cfg[key]
    if not isinstance(value, bool):
        raise ArtifactError(f"EAGLE checkpoint config.json: {key}={value!r} is not true or false (a JSON boolean)")
    return value


#: a decoder layer's switches: each a JSON boolean where the config gives it
LAYER_FLAGS = ("bias", "qkv_bias", "attention_bias", "mlp_bias", "norm_before_residual")


def _rope(cfg: dict) -> dict:
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and rope:
        rope = dict(rope)
    else:
        rope = cfg.get("rope_scaling")
        if rope is not None and not isinstance(rope, dict):
            raise ArtifactError(
                f"EAGLE checkpoint config.json: rope_scaling={rope!r} is not an object of RoPE settings (or null)"
            )
        rope = dict(rope or {})
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope.setdefault("rope_type", "default")
    if "rope_theta" not in rope:
        rope["rope_theta"] = _number(cfg, "rope_theta", 10000.0)
    return rope


def _layer_fields(cfg: dict) -> dict:
    """The decoder layer's settings of ``cfg``, each of its JSON type (a whole number, a number, a
    boolean switch) or refused naming the field and its value."""
    for key in LAYER_FLAGS:
        _flag(cfg, key, False)
    h = _whole(cfg, "hidden_size", least=None)
    heads = _whole(cfg, "num_attention_heads", least=None)
    if heads < 1 or h < 1:
        raise ValueError(f"hidden_size={h} and num_attention_heads={heads} must be >= 1")
    return dict(
        hidden_size=h,
        intermediate_size=_whole(cfg, "intermediate_size"),
        num_attention_heads=heads,
        num_key_value_heads=_whole(cfg, "num_key_value_heads", heads),
        head_dim=_whole(cfg, "head_dim", h // heads),
        rms_norm_eps=_number(cfg, "rms_norm_eps", 1e-6),
        hidden_act=str(cfg.get("hidden_act", "silu")),
        max_position_embeddings=_whole(cfg, "max_position_embeddings", 2048),
        rope_parameters=_rope(cfg),
        mlp_bias=_flag(cfg, "mlp_bias", False),
    )


def default_aux_layers(target_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's fused target layers: the residual stream entering layers 2, N // 2 and N - 3."""
    return (2, target_layers // 2, target_layers - 3)


AUX_KEY = "eagle_aux_hidden_state_layer_ids"


def fused_layers(fmt: str, cfg: dict, target_layers: int) -> tuple[int, ...]:
    """The target layers the EAGLE-3 draft of config ``cfg`` fuses, as its config lists them (its
    ``eagle_aux_hidden_state_layer_ids``; absent, null or empty: EAGLE's default 2, N // 2, N - 3),
    refused unless three distinct layers of a target of ``target_layers`` decoder layers. The plan
    and the load both check with this."""
    said = cfg.get(AUX_KEY)
    if said is None or said == []:
        aux = default_aux_layers(target_layers)
        if len(set(aux)) != 3 or not all(0 <= i < target_layers for i in aux):
            raise ArtifactError(
                f"{fmt} draft: config.json names no {AUX_KEY}, and EAGLE-3's default fused layers 2, N // 2, "
                f"N - 3 need a target of 3 or at least 7 decoder layers; this one has {target_layers} (a draft "
                "serves the target it was trained for)"
            )
        return aux
    if not isinstance(said, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in said):
        raise ArtifactError(
            f"EAGLE checkpoint config.json: {AUX_KEY}={said!r} is not a list of layer indices (JSON integers)"
        )
    if len(said) != 3 or not all(0 <= i < target_layers for i in said):
        raise ArtifactError(
            f"{fmt} draft fuses target layers {said}; the target has {target_layers} decoder layers "
            "(expected three layer indices in [0, N))"
        )
    if len(set(said)) != 3:  # EAGLE's code collects each layer once: its fc would not load
        raise ArtifactError(f"{fmt} draft fuses target layers {said}: a layer twice, expected three distinct layers")
    return tuple(said)


def _rename(state: dict, old: str, new: str) -> dict:
    return {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in state.items()}


#: EAGLE-3's vocabulary maps: index tensors, not weights
INDEX_KEYS = ("d2t", "t2d")


def parse_published(
    cfg: dict, state: dict[str, torch.Tensor], *, target_config
) -> tuple[str, EagleSpec, dict, list[str]]:
    """(format name, spec, state dict in this harness's key names, notes on what the config leaves
    unused) of a published checkpoint,
    checked against the target's config. Raises :class:`ArtifactError` naming expected vs got: a
    config field that is missing or of the wrong type, a weight that is not floating point or not
    finite, a vocabulary map that is not integer."""
    check_weight_tensors("EAGLE checkpoint", state, integer_keys=INDEX_KEYS)
    with config_refusals():
        return _parse_published(cfg, state, target_config=target_config)


@contextlib.contextmanager
def config_refusals():
    """Errors reading a published config said as one :class:`ArtifactError`: a missing field, a
    setting of the wrong type, settings that do not go together (the plan's check and the load's)."""
    try:
        yield
    except KeyError as exc:
        raise ArtifactError(f"EAGLE checkpoint config.json lacks {exc} (a decoder layer's settings)") from None
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ArtifactError):
            raise
        text = str(exc)
        if isinstance(exc, TypeError) or text.startswith(("invalid literal", "could not convert")):
            raise ArtifactError(f"EAGLE checkpoint config.json: a setting of the wrong type ({exc})") from None
        # a value a layer refuses beside the others (attention heads that do not divide the hidden size, ...)
        raise ArtifactError(f"EAGLE checkpoint config.json: settings that do not go together ({exc})") from None


def is_eagle3(cfg: dict, names) -> bool:
    """Whether a config in EAGLE's own layout, with weights named ``names`` (None: not read), is an
    EAGLE-3 draft: its config names a draft vocabulary or the target's width, or its weights hold
    ``midlayer.*``. The plan and the load both decide with this; where the plan cannot read the names
    (a ``pytorch_model.bin``), a draft that only its weights call EAGLE-3 has its hidden size checked
    there as an EAGLE-1/2 draft's (its config names no other width, so the two checks agree), and its
    fused layers when it loads."""
    return (
        cfg.get("draft_vocab_size") is not None
        or cfg.get("target_hidden_size") is not None
        or any(k.startswith("midlayer.") for k in names or ())
    )


def draft_layout(cfg: dict, names) -> tuple[str, dict]:
    """(format name, the settings its draft is built from) of a published config, its weights named
    ``names`` (None where they are not read): a speculators config's ``transformer_layer_config``
    with the top-level settings its format reads, or an EAGLE config as it is. Refuses a speculators
    config of another model type or variant, or without a layer config object."""
    kind = cfg.get("speculators_model_type")
    if kind is None:
        return ("eagle3" if is_eagle3(cfg, names) else "eagle"), cfg
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict) or not layer:
        got = "absent" if layer is None else f"{layer!r}"
        raise ArtifactError(
            f"speculators config.json: transformer_layer_config is {got}; expected an object holding the decoder "
            "layer's settings"
        )
    if kind == "eagle3":
        for flag in ("norm_before_fc", "fc_norm", "norm_output"):
            if _flag(cfg, flag, False):
                raise ArtifactError(f"speculators EAGLE-3 variant {flag}=true is not supported here")
        merged = {**layer, **{k: cfg[k] for k in ("draft_vocab_size", "target_hidden_size", AUX_KEY) if k in cfg}}
        merged["norm_before_residual"] = _flag(cfg, "norm_before_residual", False)
        return "speculators-eagle3", merged
    if kind == "eagle":
        if _flag(cfg, "layernorms", False):
            raise ArtifactError(
                "speculators EAGLE with layernorms=true (the HASS variant: extra embedding and pre-LM-head "
                "norms) is not supported; only the plain EAGLE-1 layout is"
            )
        return "speculators-eagle", {**layer, "bias": _flag(cfg, "fusion_bias", False), "num_hidden_layers": 1}
    raise ArtifactError(f"speculators_model_type {kind!r} is not an EAGLE draft this harness reads (eagle3, eagle)")


def _parse_published(cfg: dict, state: dict[str, torch.Tensor], *, target_config) -> tuple[str, EagleSpec, dict, list]:
    target_h = int(target_config.hidden_size)
    target_v = int(target_config.vocab_size)
    fmt, layer = draft_layout(cfg, state)
    if fmt == "speculators-eagle3":
        return _eagle3(fmt, layer, _rename(state, "layers.0.", "midlayer."), target_config)
    if fmt == "speculators-eagle":
        state = _rename(_rename(state, "fusion_fc.", "fc."), "transformer.", "layers.0.")
        state = {k: v for k, v in state.items() if not k.startswith("layers.0.input_layernorm")}
        return _eagle12(fmt, layer, state, target_h, target_v)
    if fmt == "eagle3":
        return _eagle3(fmt, layer, state, target_config)
    if "fc.weight" in state:
        return _eagle12(fmt, layer, state, target_h, target_v)
    raise ArtifactError(
        "not an EAGLE draft checkpoint: no fc.weight (EAGLE-1/2) and no midlayer.* keys (EAGLE-3); "
        f"keys start {sorted(state)[:6]}"
    )


def config_notes(cfg: dict, spec: EagleSpec) -> list[str]:
    """A note for every setting of an EAGLE-1/2 ``config.json`` the weights contradict where the weights
    decide (another layer count: EAGLE's code would leave the layers the weights lack uninitialised)."""
    if cfg.get("speculators_model_type") is not None or spec.version != "eagle":
        return []
    said = cfg.get("num_hidden_layers")
    if isinstance(said, int) and not isinstance(said, bool) and said != spec.num_layers:
        return [
            f"config.json says num_hidden_layers={said}; the weights hold {spec.num_layers} (read from the weights)"
        ]
    return []


def _require_said_biases(fmt: str, cfg: dict, state: dict, *, fc: bool, qkv: str) -> None:
    """Refuse a checkpoint whose config builds a bias its weights lack (a truncated file): ``bias``
    (``fc``'s, where ``fc`` may have one), ``qkv_bias`` or ``attention_bias`` (the q/k/v of the layer at
    ``qkv``)."""
    for key, tensor in (
        *((("bias", "fc.bias"),) if fc else ()),
        ("qkv_bias", qkv + "self_attn.q_proj.bias"),
        ("attention_bias", qkv + "self_attn.q_proj.bias"),
    ):
        if _flag(cfg, key, False) and tensor not in state:
            raise ArtifactError(f"{fmt} checkpoint: config.json says {key}=true but the weights hold no {tensor}")


def _unused_biases(fmt: str, cfg: dict, state: dict, *, eagle3: bool) -> tuple[dict, bool, bool, list[str]]:
    """(state, fc bias used, q/k/v biases used, notes) of a checkpoint in EAGLE's own layout, where the
    config decides as the code that runs it does: for EAGLE-1/2 ``bias`` (default true) builds ``fc``
    with a bias (EAGLE-3's ``fc`` never has one), and ``qkv_bias`` (EAGLE's name) or ``attention_bias``
    (a Llama config's, read by runtimes built on Llama's layer) builds q/k/v with biases. Biases the
    weights hold that the config does not build are left unused, as the authors' loader
    (``strict=False``) leaves them, and noted. A bias the config builds and the weights lack is a
    truncated file: refused."""
    notes: list[str] = []
    qkv = "midlayer." if eagle3 else "layers.0."
    fc_has = "fc.bias" in state
    qkv_has = qkv + "self_attn.q_proj.bias" in state
    fc_said = not eagle3 and _flag(cfg, "bias", True)
    qkv_keys = [k for k in ("qkv_bias", "attention_bias") if _flag(cfg, k, False)]
    _require_said_biases(fmt, cfg, state, fc=not eagle3, qkv=qkv)
    if fc_has and not fc_said:
        state = {k: v for k, v in state.items() if k != "fc.bias"}
        why = "EAGLE-3's fc has no bias" if eagle3 else "config.json says bias=false"
        notes.append(f"{why}: fc.bias in the weights is not used (EAGLE's code builds fc without one)")
    if qkv_has and not qkv_keys:
        state = {k: v for k, v in state.items() if not _QKV_BIAS.fullmatch(k)}
        notes.append(
            "config.json says neither qkv_bias nor attention_bias is true: the q/k/v biases in the weights are "
            "not used (EAGLE's code builds q/k/v without them)"
        )
    return state, fc_has and fc_said, qkv_has and bool(qkv_keys), notes


def _check_keys(fmt: str, state: dict, expected: dict[str, tuple[int, ...]], optional: set[str]) -> dict:
    missing = sorted(k for k in expected if k not in state)
    if missing:
        raise ArtifactError(f"{fmt} checkpoint lacks {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    bad = [(k, expected[k], tuple(state[k].shape)) for k in expected if tuple(state[k].shape) != expected[k]]
    if bad:
        k, want, got = bad[0]
        raise ArtifactError(f"{fmt} checkpoint: {k} has shape {list(got)}, expected {list(want)}")
    extra = sorted(k for k in state if k not in expected and k not in optional and not IGNORED_KEYS.fullmatch(k))
    if extra:
        raise ArtifactError(f"{fmt} checkpoint has keys this layout does not define: {extra[:8]}")
    return {k: v for k, v in state.items() if k in expected or k in optional}


def _eagle12(fmt: str, cfg: dict, state: dict, target_h: int, target_v: int) -> tuple[str, EagleSpec, dict, list[str]]:
    fields = _layer_fields(cfg)
    h, v = fields["hidden_size"], _whole(cfg, "vocab_size", target_v)
    if h != target_h:
        raise ArtifactError(
            f"{fmt} draft has hidden_size {h}; the target's hidden size is {target_h} (expected {target_h}, got {h}): "
            "an EAGLE-1/2 draft reads the target's features and feeds the target's LM head"
        )
    if v != target_v:
        raise ArtifactError(
            f"{fmt} draft has vocab_size {v}; the target's vocabulary is {target_v} (expected {target_v})"
        )
    stray_t2d = "t2d" in state
    state = {k: v for k, v in state.items() if k != "t2d"}
    layers = sorted({int(k.split(".")[1]) for k in state if k.startswith("layers.")})
    n = len(layers)
    if layers != list(range(n)) or n < 1:
        raise ArtifactError(f"{fmt} checkpoint decoder layers {layers}; expected 0..n-1 with n >= 1")
    if fmt == "eagle":
        state, fc_bias, qkv_bias, notes = _unused_biases(fmt, cfg, state, eagle3=False)
    else:  # speculators: the layer's config and the weights, as vLLM reads them
        fc_bias, qkv_bias, notes = "fc.bias" in state, "layers.0.self_attn.q_proj.bias" in state, []
        _require_said_biases(fmt, cfg, state, fc=True, qkv="layers.0.")
    if stray_t2d:
        notes.append(
            "t2d (EAGLE-3's target-to-draft vocabulary mask) in the weights is not read: an EAGLE-1/2 draft "
            "drafts over the target's whole vocabulary"
        )
    spec = EagleSpec(version="eagle", vocab_size=target_v, num_layers=n, fc_bias=fc_bias, qkv_bias=qkv_bias, **fields)
    hd, nh, nkv, inter = spec.head_dim, spec.num_attention_heads, spec.num_key_value_heads, spec.intermediate_size
    expected = {"fc.weight": (h, 2 * h)}
    if fc_bias:
        expected["fc.bias"] = (h,)
    for i in range(n):
        p = f"layers.{i}."
        expected.update(
            {
                p + "self_attn.q_proj.weight": (nh * hd, h),
                p + "self_attn.k_proj.weight": (nkv * hd, h),
                p + "self_attn.v_proj.weight": (nkv * hd, h),
                p + "self_attn.o_proj.weight": (h, nh * hd),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
        if i > 0:
            expected[p + "input_layernorm.weight"] = (h,)
        if qkv_bias:
            expected.update(
                {
                    p + "self_attn.q_proj.bias": (nh * hd,),
                    p + "self_attn.k_proj.bias": (nkv * hd,),
                    p + "self_attn.v_proj.bias": (nkv * hd,),
                }
            )
    if "embed_tokens.weight" in state and _shape(state, "embed_tokens.weight") != (target_v, h):
        raise ArtifactError(
            f"{fmt} checkpoint embed_tokens.weight is {list(_shape(state, 'embed_tokens.weight'))}; the target "
            f"needs [{target_v}, {h}] (expected vocabulary {target_v})"
        )
    return fmt, spec, _check_keys(fmt, state, expected, {"embed_tokens.weight"}), notes


def _eagle3(fmt: str, cfg: dict, state: dict, target_config) -> tuple[str, EagleSpec, dict, list[str]]:
    target_h, target_v = int(target_config.hidden_size), int(target_config.vocab_size)
    target_layers = int(target_config.num_hidden_layers)
    fields = _layer_fields(cfg)
    h = fields["hidden_size"]
    ht = _whole(cfg, "target_hidden_size", h)
    v = _whole(cfg, "vocab_size", target_v)
    vd = _whole(cfg, "draft_vocab_size", v)
    if ht != target_h:
        raise ArtifactError(
            f"{fmt} draft reads target features of width {ht}; the target's hidden size is {target_h} "
            f"(expected {target_h}, got {ht})"
        )
    if v != target_v:
        raise ArtifactError(
            f"{fmt} draft has vocab_size {v}; the target's vocabulary is {target_v} (expected {target_v})"
        )
    aux = fused_layers(fmt, cfg, target_layers)
    t2d = state.get("t2d")
    state = {k: v for k, v in state.items() if k != "t2d"}
    if fmt == "eagle3":
        state, _, qkv_bias, notes = _unused_biases(fmt, cfg, state, eagle3=True)
    else:  # speculators: the layer's config and the weights, as vLLM reads them
        qkv_bias, notes = "midlayer.self_attn.q_proj.bias" in state, []
    if list(aux) != sorted(aux):  # EAGLE's and vLLM's targets collect the features walking their layers
        if cfg.get(AUX_KEY):
            notes.append(
                f"{AUX_KEY} lists {list(aux)}: the features are joined in layer order "
                f"{sorted(aux)}, as EAGLE's code collects them while the target runs its layers"
            )
        aux = tuple(sorted(aux))
    if "d2t" in state and state["d2t"].dtype == torch.bool:
        raise ArtifactError(
            f"{fmt} checkpoint: d2t is torch.bool; it holds each draft token's offset to its target id (integers)"
        )
    if vd == target_v and "d2t" in state:  # EAGLE's code drops the map where the vocabularies are one
        if bool(state["d2t"].ne(0).any()):
            notes.append(
                "draft_vocab_size is the target's vocabulary: d2t is not used (EAGLE's code drops it), though it "
                "is not the identity"
            )
        state = {k: v for k, v in state.items() if k != "d2t"}
    spec = EagleSpec(
        version="eagle3",
        vocab_size=target_v,
        num_layers=1,
        fc_bias=False,
        qkv_bias=qkv_bias,
        draft_vocab_size=vd,
        target_hidden_size=ht,
        aux_layers=aux,
        norm_before_residual=_flag(cfg, "norm_before_residual", False),
        **fields,
    )
    hd, nh, nkv, inter = spec.head_dim, spec.num_attention_heads, spec.num_key_value_heads, spec.intermediate_size
    p = "midlayer."
    expected = {
        "fc.weight": (h, 3 * ht),
        p + "hidden_norm.weight": (h,),
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (nh * hd, 2 * h),
        p + "self_attn.k_proj.weight": (nkv * hd, 2 * h),
        p + "self_attn.v_proj.weight": (nkv * hd, 2 * h),
        p + "self_attn.o_proj.weight": (h, nh * hd),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (inter, h),
        p + "mlp.up_proj.weight": (inter, h),
        p + "mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,),
        "lm_head.weight": (vd, h),
    }
    if spec.qkv_bias:
        expected.update(
            {
                p + "self_attn.q_proj.bias": (nh * hd,),
                p + "self_attn.k_proj.bias": (nkv * hd,),
                p + "self_attn.v_proj.bias": (nkv * hd,),
            }
        )
    if vd != target_v or "d2t" in state:
        expected["d2t"] = (vd,)
    state = _check_keys(fmt, state, expected, {"embed_tokens.weight"})
    if "embed_tokens.weight" in state and _shape(state, "embed_tokens.weight") != (target_v, h):
        raise ArtifactError(
            f"{fmt} checkpoint embed_tokens.weight is {list(_shape(state, 'embed_tokens.weight'))}; expected "
            f"[{target_v}, {h}]"
        )
    if h != target_h and "embed_tokens.weight" not in state:
        raise ArtifactError(
            f"{fmt} draft width {h} differs from the target's {target_h} and the checkpoint has no "
            "embed_tokens.weight of its own"
        )
    if "d2t" in state:
        d2t = state["d2t"].long()
        ids = torch.arange(vd) + d2t
        if int(ids.min()) < 0 or int(ids.max()) >= target_v or ids.unique().numel() != vd:
            raise ArtifactError(
                f"{fmt} d2t maps the draft vocabulary outside the target's [0, {target_v}) or onto repeated ids"
            )
        state["d2t"] = d2t
    else:  # the draft's vocabulary is the target's: the identity map (what the draft's buffer holds unset)
        state["d2t"] = torch.zeros(vd, dtype=torch.long)
    if t2d is not None:
        _check_t2d(fmt, t2d, torch.arange(vd) + state["d2t"], target_v=target_v)
    return fmt, spec, state, notes


def _check_t2d(fmt: str, t2d: torch.Tensor, ids: torch.Tensor, *, target_v: int) -> None:
    """EAGLE-3's ``t2d``, the mask over the target's vocabulary of the ids the draft proposes, against
    the ids ``d2t`` maps the draft vocabulary to (``ids``): of shape ``[target vocabulary]``, booleans
    or 0/1, true exactly at ``ids``. The draft reads ``d2t`` only, so a mask that disagrees says the
    two maps come from different vocabularies: refused."""
    if tuple(t2d.shape) != (target_v,):
        raise ArtifactError(
            f"{fmt} checkpoint: t2d has shape {list(t2d.shape)}; expected [{target_v}] (one entry per target token id)"
        )
    if t2d.dtype != torch.bool and bool(((t2d != 0) & (t2d != 1)).any()):
        raise ArtifactError(f"{fmt} checkpoint: t2d holds values other than 0 and 1; it is a mask over the target ids")
    marked = t2d.bool()
    expected = torch.zeros(target_v, dtype=torch.bool)
    expected[ids] = True
    if not torch.equal(marked, expected):
        extra = torch.nonzero(marked & ~expected).flatten()
        absent = torch.nonzero(expected & ~marked).flatten()
        first = (
            f"marks id {int(extra[0])}, which d2t maps no draft token to"
            if len(extra)
            else f"leaves out id {int(absent[0])}, which d2t maps a draft token to"
        )
        raise ArtifactError(
            f"{fmt} checkpoint: t2d disagrees with d2t: it {first} ({len(extra)} id(s) marked beyond d2t's, "
            f"{len(absent)} of d2t's unmarked); the two maps come from different vocabularies"
        )
