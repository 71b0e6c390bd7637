"""Versioned proposal artifacts, bound to the round manifest's target (release assertion: the
proposal checkpoint is compatible with the target version).

An artifact is a directory with ``manifest.json`` and, for trained artifacts, ``weights.safetensors``.
The manifest carries the target fingerprint, the recipe (architecture + training or search
options), the token budget, held-out quality (top-1 agreement for heads, the measured objective for
a skip vector), whether it is a CPU-budget artifact, and an ``artifact_id`` hashing all of it and
the weights. :func:`load_artifact` refuses a different target, a different recipe, an edited
manifest or changed weights, naming both values.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import weakref
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from harness.files import plain_file_mode, temporary_sibling
from harness.target.loading import cache_root, tokenizer_fingerprint

ARTIFACT_VERSION = "heads-artifact-1"
MANIFEST_FILE = "manifest.json"
WEIGHTS_FILE = "weights.safetensors"

#: per target model (held weakly: a job's model is freed when the job drops it), the fingerprint's
#: hash over its config and parameters, before any tokenizer is folded in
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ArtifactError(ValueError):
    """A proposal artifact does not belong to this target / recipe, or was altered."""


def read_config_object(path: Path) -> dict[str, Any]:
    """A published checkpoint's ``config.json`` (or an artifact's ``manifest.json``): one JSON
    object, or :class:`ArtifactError` naming the file and what is wrong with it."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ArtifactError(f"{str(path)!r} is not UTF-8 text ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ArtifactError(f"{str(path)!r} holds a JSON {type(config).__name__}, not an object of settings")
    return config


def _checkable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or in float32 where torch has no ``isfinite`` for its dtype (the float8 ones)."""
    return tensor.float() if tensor.element_size() == 1 else tensor


def check_weight_tensors(where: str, state: dict[str, torch.Tensor], *, integer_keys: tuple[str, ...] = ()) -> None:
    """Every weight of a published checkpoint is a floating-point tensor with finite values (index
    tensors, ``integer_keys``, hold integers or booleans): a weight stored as integers, an index
    stored as floats, or a weight holding NaN or inf is refused naming the tensor, before any
    forward."""
    for key, tensor in state.items():
        if key in integer_keys:
            if tensor.is_floating_point() or tensor.is_complex():
                raise ArtifactError(f"{where}: {key} is {tensor.dtype}; it holds token ids and must be integer")
            continue
        if not tensor.is_floating_point():
            raise ArtifactError(f"{where}: {key} is {tensor.dtype}; weights must be floating point")
        if tensor.device.type != "meta" and not bool(torch.isfinite(_checkable(tensor)).all()):
            bad = int((~torch.isfinite(_checkable(tensor))).sum())
            raise ArtifactError(f"{where}: {key} holds {bad} non-finite value(s) (NaN or inf)")


#: an artifact that recorded fewer training tokens than this is a CPU-budget artifact: the label
#: reports keep apart (trained here on tens of thousands of tokens, not a full training run)
CPU_BUDGET_MAX_TOKENS = 10_000_000


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def unreadable_tensor_file(path: Path, exc: BaseException) -> ArtifactError:
    """One line for a weight file ``torch.load(weights_only=True)`` refused: a pickle of Python
    objects (a whole module saved with ``torch.save(model)``) said as such, anything else by the
    first line of the error (torch's own advice, to unpickle with ``weights_only=False``, would run
    the file's code)."""
    text = _ANSI.sub("", str(exc))
    if "Unsupported global" in text:  # a class the file asks to import: a pickled object
        return ArtifactError(
            f"{str(path)!r} holds pickled Python objects, not only tensors (a whole module saved with "
            "torch.save(model)?): save its state_dict instead; weights are read without running a pickle's code"
        )
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if "WeightsUnpickler error:" in text:  # torch's preamble, then the unpickler's own words
        after = text.split("WeightsUnpickler error:", 1)[1]
        lines = [line.strip() for line in after.splitlines() if line.strip()] or lines
    first = lines[0] if lines else ""
    return ArtifactError(f"cannot read {str(path)!r} as a tensor file: {type(exc).__name__}: {first[:200]}")


def cpu_budget_label(manifest: dict) -> bool:
    """Whether results from this artifact are labelled ``cpu_budget_artifact``: decided by what the
    artifact recorded about its training (``tokens_seen``, else its ``token_budget``, e.g. a
    layer-skip search's trials x prompts x tokens), never by the device it was made or runs on.
    Published checkpoints and explicit settings (``proposer.skip``) were not trained here: False."""
    if manifest.get("source") in ("published", "proposer.skip"):
        return False
    tokens = manifest.get("tokens_seen", manifest.get("token_budget"))
    if tokens is None:
        return bool(manifest.get("cpu_budget_artifact", False))
    return int(tokens) < CPU_BUDGET_MAX_TOKENS


def canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def short_hash(obj: Any, n: int = 16) -> str:
    return hashlib.sha256(canonical(obj).encode()).hexdigest()[:n]


def target_fingerprint(model: torch.nn.Module, tokenizer=None) -> str:
    """SHA-256 over the target's config, every parameter (name, shape, dtype, bytes) and the
    tokenizer fingerprint. The parameters' part is cached per model object (about 1 s for SmolLM2 in
    float32), the tokenizer's folded in at each call."""
    cached = _FINGERPRINTS.get(model)
    if cached is not None:
        h = cached.copy()
        if tokenizer is not None:
            h.update(tokenizer_fingerprint(tokenizer).encode())
        return h.hexdigest()
    h = hashlib.sha256()
    cfg = model.config.to_dict()
    for key in (
        "_name_or_path",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "attn_implementation",
        "use_cache",
    ):
        cfg.pop(key, None)
    h.update(canonical(cfg).encode())
    for name, tensor in model.state_dict().items():
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    _FINGERPRINTS[model] = h.copy()
    if tokenizer is not None:
        h.update(tokenizer_fingerprint(tokenizer).encode())
    return h.hexdigest()


def weights_hash(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _artifact_id(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "artifact_id"}
    return short_hash(body, 24)


def _check_replaceable(out_dir: Path, kind: Any) -> None:
    """Refuse to replace ``out_dir`` unless it is absent or an artifact folder of ``kind`` (one holding
    ``manifest.json``; a manifest that does not read is taken for a broken artifact of the cache):
    :func:`save_artifact` deletes what it replaces."""
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if out_dir.is_symlink() or not out_dir.is_dir() or not (out_dir / MANIFEST_FILE).is_file():
        raise ArtifactError(
            f"{str(out_dir)!r} is not an artifact folder (no {MANIFEST_FILE} in it): nothing was saved, and what "
            "it holds is left as it is; leave proposer.artifact unset to use the cache"
        )
    try:
        there = json.loads((out_dir / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return
    if isinstance(there, dict) and there.get("kind") != kind:
        raise ArtifactError(
            f"{str(out_dir)!r} holds an artifact of kind {there.get('kind')!r}, not {kind!r}: nothing was saved, and "
            "it is left as it is; leave proposer.artifact unset to use the cache"
        )


def save_artifact(out_dir: str | Path, *, manifest: dict, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write atomically: a temporary directory no other process names, renamed into place (an
    earlier artifact of the same kind there is replaced: moved aside first, removed once the new one
    is in place, and put back where it cannot be; anything else there is refused, left as it is).
    Builders hold :func:`harness.files.artifact_lock` on ``out_dir`` around the check, the training
    and this write, so concurrent jobs train once."""

    out_dir = Path(out_dir)
    _check_replaceable(out_dir, manifest.get("kind"))
    if state is not None:  # a diverged training is no artifact: nothing is written (a run would load it)
        bad = sorted(k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all()))
        if bad:
            recipe = manifest.get("recipe") or {}
            train = recipe.get("train") or {}
            lr, tau = train.get("lr"), train.get("distill_temperature")
            # a distillation loss's temperature divides the teacher's logits: a small one overflows too
            distills = tau is not None and (train.get("loss") == "distill" or manifest.get("kind") == "early_exit")
            raise ArtifactError(
                f"the training diverged: {len(bad)} of {len(state)} weight tensors hold NaN or inf ({bad[0]}"
                + (", ..." if len(bad) > 1 else "")
                + f"); nothing was saved to {str(out_dir)!r}: lower proposer.train.lr"
                + (f" (now {lr})" if lr is not None else "")
                + (f", or raise proposer.train.distill_temperature (now {tau})" if distills else "")
            )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(out_dir)
    replaced = None  # where an earlier artifact waits while the new one is renamed in
    try:
        tmp.mkdir()
        manifest = dict(manifest)
        manifest["version"] = ARTIFACT_VERSION
        if state is not None:
            state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
            save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
            os.chmod(tmp / WEIGHTS_FILE, plain_file_mode())  # safetensors writes 0600; the manifest is 0644
            manifest["weights_sha256"] = weights_hash(state)
        manifest["artifact_id"] = _artifact_id(manifest)
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n")
        if out_dir.exists():
            _check_replaceable(out_dir, manifest.get("kind"))
            replaced = temporary_sibling(out_dir, "replaced")
            out_dir.rename(replaced)  # moved aside, not removed: it goes back if the new one cannot take its place
        tmp.rename(out_dir)
    finally:
        if replaced is not None and replaced.exists():
            if not tmp.exists():  # the new artifact is in place
                shutil.rmtree(replaced, ignore_errors=True)
            elif not out_dir.exists():  # it is not: the earlier one goes back
                replaced.rename(out_dir)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


#: recipe sections and the proposer options that set their fields
_RECIPE_OPTIONS = {"data": "proposer.data.", "train": "proposer.train.", "spec": "proposer."}
#: recipe fields no proposer option sets (they come from the target or the artifact kind)
_DERIVED_FIELDS = {"kind", "hidden_size", "embed_size", "vocab_size", "version"}
#: top-level recipe fields a proposer option sets (an early-exit adapter's layer); the others are
#: derived (the chat template's hash, the ShareGPT file's, the training code's version)
_TOP_OPTIONS = {"exit_layer": "proposer.exit_layer"}


def recipe_differences(have: dict, want: dict) -> list[tuple[str, Any, Any]]:
    """``(key, artifact's value, configured value)`` for every recipe field that differs, the key as
    the override that sets it (``proposer.data.token_budget``; the training loss is
    ``proposer.distill``), or in parentheses where no option sets it (a field the target decides)."""
    out: list[tuple[str, Any, Any]] = []
    for section in sorted(set(have) | set(want)):
        a, c = have.get(section), want.get(section)
        if isinstance(a, dict) and isinstance(c, dict) and section in _RECIPE_OPTIONS:
            for field in sorted(set(a) | set(c)):
                if a.get(field) == c.get(field):
                    continue
                if section == "train" and field == "loss":
                    key, va, vc = "proposer.distill", a.get(field) == "distill", c.get(field) == "distill"
                    out.append((key, va, vc))
                    continue
                key = f"({section}.{field})" if field in _DERIVED_FIELDS else _RECIPE_OPTIONS[section] + field
                out.append((key, a.get(field), c.get(field)))
        elif a != c:
            out.append((_TOP_OPTIONS.get(section, f"({section})"), a, c))
    return out


def _spelled(value: Any) -> str:
    """A value as an override spells it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_spelled(v) for v in value) + "]"
    return "null" if value is None else str(value)


def load_artifact(
    path: str | Path, *, kind: str, target_hash: str, recipe: dict | None = None, target_source: str | None = None
) -> tuple[dict, dict[str, torch.Tensor] | None]:
    """(manifest, weights or None). Refuses a mismatched target, kind or recipe, or edited or unreadable
    files. ``target_source``: what the configured target was loaded from (named in a refusal)."""
    path = Path(path)
    mpath = path / MANIFEST_FILE
    if not mpath.is_file():
        raise ArtifactError(f"{str(path)!r} is not a proposal artifact: {MANIFEST_FILE} missing")
    manifest = read_config_object(mpath)
    if manifest.get("version") != ARTIFACT_VERSION:
        raise ArtifactError(
            f"artifact {str(path)!r} has version {manifest.get('version')!r}; "
            f"this harness reads {ARTIFACT_VERSION!r}: rebuild it"
        )
    if manifest.get("artifact_id") != _artifact_id(manifest):
        raise ArtifactError(
            f"artifact {str(path)!r}: manifest edited after it was written "
            f"(artifact_id {manifest.get('artifact_id')!r} != content hash {_artifact_id(manifest)!r})"
        )
    if manifest.get("kind") != kind:
        raise ArtifactError(f"artifact {str(path)!r} is a {manifest.get('kind')!r} artifact; proposer needs {kind!r}")
    if manifest.get("target_hash") != target_hash:
        raise ArtifactError(
            f"artifact {str(path)!r} was built for target {str(manifest.get('target_hash'))[:16]}... "
            f"({manifest.get('target_source')!r}); the configured target is {target_hash[:16]}..."
            f"{f' ({target_source!r})' if target_source else ''}: a proposal artifact is only valid for the target it "
            "was trained or searched on (run it with that target, or leave proposer.artifact unset to use or train "
            "the configured target's)"
        )
    if recipe is not None and canonical(manifest.get("recipe")) != canonical(recipe):
        diff = recipe_differences(manifest.get("recipe") or {}, recipe)
        shown = "; ".join(f"{key}: artifact {_spelled(a)}, configured {_spelled(c)}" for key, a, c in diff[:6])
        more = f"; and {len(diff) - 6} more" if len(diff) > 6 else ""
        settable = [f"{key}={_spelled(a)}" for key, a, _ in diff if a is not None and not key.startswith("(")]
        hint = f"; to use it, set {' '.join(settable)}" if settable and len(settable) == len(diff) else ""
        raise ArtifactError(
            f"artifact {str(path)!r} was built with another recipe: {shown}{more}{hint} (or leave "
            "proposer.artifact unset to use or train the cache's artifact for the configured recipe)"
        )
    state = None
    wpath = path / WEIGHTS_FILE
    if "weights_sha256" in manifest:
        if not wpath.is_file():
            raise ArtifactError(f"artifact {str(path)!r}: {WEIGHTS_FILE} missing")
        try:
            state = load_file(str(wpath))
        except Exception as exc:  # a truncated or overwritten file: safetensors' own error names neither
            raise ArtifactError(
                f"artifact {str(path)!r}: cannot read {WEIGHTS_FILE} as a safetensors file ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}): rebuild it, or leave proposer.artifact unset"
            ) from None
        got = weights_hash(state)
        if got != manifest["weights_sha256"]:
            raise ArtifactError(
                f"artifact {str(path)!r}: weights changed since release "
                f"(manifest {manifest['weights_sha256'][:16]}..., file {got[:16]}...)"
            )
    return manifest, state


def artifact_dir(kind: str, *, target_hash: str, recipe: dict) -> Path:
    """Default location: ``$HARNESS_CACHE/artifacts/<kind>-<target[:12]>-<recipe[:12]>``."""

    return cache_root() / "artifacts" / f"{kind}-{target_hash[:12]}-{short_hash(recipe, 12)}"
