"""The immutable round manifest: frozen before the first proposal, hashed, and
carried by every proposal result and record."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness.engine.arms import SEED_RULE
from harness.heads.eagle_formats import resolve_source
from harness.heads.published import inspect, is_published
from harness.measure.hardware import cpu_capability, device_name, manifest_versions, threads_in_effect
from harness.proposers.rest import datastore_sources, manifest_datastores
from harness.target.loading import (  # noqa: F401  (checkpoint_fingerprint: the manifest's binding, imported from here)
    checkpoint_fingerprint,
    checkpoint_ref,
    looks_like_hub_id,
    pin_hub_snapshot,
    resolve_dtype,
)
from harness.target.options import (
    resolve_cudnn_attention,
    resolve_linear_kernel,
    resolve_static_cache,
    resolved_fused_layers,
)
from harness.tracking.job_folder import read_cached_artifacts_with, read_machines_with

COMPILER_VERSION = "compiler-1"
RECORD_SCHEMA_VERSION = 2

# a job folder's record of a manifest is complete only where it was timed on this machine: the manifest
# names no machine (a sweep launched on two machines shares its manifests)
read_machines_with(device_name, cpu_capability)


def cached_artifact_id(entry) -> str | None:
    """The id of the artifact this cache holds where a record's artifact entry (its ``kind``,
    ``target_hash`` and ``recipe``) says a job finds it (:func:`harness.heads.checkpoint.artifact_dir`),
    or None where it holds none (or none readable)."""
    from harness.heads.checkpoint import MANIFEST_FILE, artifact_dir

    try:
        folder = artifact_dir(str(entry["kind"]), target_hash=str(entry["target_hash"]), recipe=entry["recipe"])
        held = json.loads((folder / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return held.get("artifact_id") if isinstance(held, dict) else None


# a record's proposer artifact from the cache is the one this job would load only where the cache holds it
read_cached_artifacts_with(cached_artifact_id)


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


PACKAGE_DIR = Path(__file__).resolve().parent


#: the package's source files: Python and the native kernels' C++ (compiled on first use)
SOURCE_SUFFIXES = (".py", ".cpp", ".cc", ".c", ".h", ".hpp")


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """SHA-256 (16 hex) over every source file's path and content under ``harness/`` (Python and
    the native kernels' C++: :data:`SOURCE_SUFFIXES`), read once per process.

    Part of every run manifest, so a record is tied to the code that produced it and a sweep
    re-runs a finished job after a code change (works from a wheel too: no git needed)."""
    h = hashlib.sha256()
    for path in sorted(p for p in PACKAGE_DIR.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()):
        h.update(path.relative_to(PACKAGE_DIR).as_posix().encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]


def freeze_manifest(cfg: DictConfig, *, versions: dict[str, str], extra: dict[str, Any] | None = None) -> dict:
    c = OmegaConf.to_container(cfg, resolve=True)
    manifest = {
        "target": c["model"],
        "sampling_policy": {k: c["generation"][k] for k in ("temperature", "top_p", "top_k")},
        "rng_policy": {"seed": c["seed"], "source": SEED_RULE},
        "proposer": c["proposer"],
        "topology": c["topology"],
        "topology_compiler": COMPILER_VERSION,
        "verifier": {"name": c["verifier"]["name"], "exact_mode": c["generation"]["exact"]},
        "generation": c["generation"],
        "workload": c["workload"],
        "batch_regime": {"batch_size": c["generation"]["batch_size"]},
        "backend": {
            "device": c["model"]["device"],
            "dtype": c["model"]["dtype"],
            "attn_implementation": c["model"]["attn_implementation"],
            "linear_kernel": resolve_linear_kernel(
                c["model"].get("linear_kernel", "auto"),
                resolve_dtype(c["model"]["dtype"]),
                c["model"]["device"],
                compiled=bool(c["model"].get("compile")),
            ),
            "static_cache": resolve_static_cache(c["model"].get("static_cache"), bool(c["model"].get("compile"))),
            "compile": bool(c["model"].get("compile", False)),
            "fused_layers": resolved_fused_layers(c["model"]),
            "cudnn_attention": resolve_cudnn_attention(c["model"].get("cudnn_attention"), c["model"]["device"]),
            "threads": threads_in_effect(c.get("threads")),  # the count the job runs with, set or not
        },
        "versions": versions,
        "harness_code": code_fingerprint(),
    }
    for key in checkpoint_decides(cfg.proposer):  # set by the published checkpoint, not by these options
        manifest["proposer"].pop(key, None)
    if extra:
        manifest.update(extra)
    published = (extra or {}).get("proposer_artifact") or {}
    if published.get("source") == "published" and "num_heads" in published:
        manifest["proposer"] = published_bank_options(manifest["proposer"], published)
    return manifest


#: options of a proposer that trains its artifact here (a published checkpoint is never trained)
TRAINING_OPTIONS = ("auto_train", "data", "train")
#: an EAGLE draft's shape options (a published draft's shape is read from its files)
EAGLE_SHAPE_OPTIONS = ("num_layers", "intermediate_size", "fc_bias")
#: a head bank's shape options (a published bank's heads, layers and prefix layer are its files'; its
#: Hydra++ switches set true are refused)
HEADS_SHAPE_OPTIONS = ("num_heads", "mlp_layers", "prefix_window", "attn_heads")


def checkpoint_decides(proposer) -> tuple[str, ...]:
    """The options of ``proposer`` (a config node) that a published checkpoint makes inert: its
    training options, and the draft's shape (read from the checkpoint's files, which the manifest
    binds)."""
    if proposer.name not in ("medusa", "hydra", "eagle") or not is_published(proposer.get("artifact")):
        return ()
    return TRAINING_OPTIONS + (EAGLE_SHAPE_OPTIONS if proposer.name == "eagle" else HEADS_SHAPE_OPTIONS)


def published_bank_options(proposer: dict, provenance: dict) -> dict:
    """The proposer options as a published head bank runs them: its architecture comes from the
    checkpoint, so ``num_heads`` and ``mlp_layers`` are the bank's (the configured values are left
    out of the manifest, and listed among the record's inert options when set: the record never
    claims a shape that did not run)."""
    return {**proposer, "num_heads": provenance["num_heads"], "mlp_layers": provenance["num_layers"]}


def manifest_hash(manifest: dict) -> str:
    return hashlib.sha256(canonical_json(manifest).encode()).hexdigest()[:16]


def job_manifest(cfg: DictConfig, *, versions: dict[str, str] | None = None) -> dict:
    """The manifest a job with config ``cfg`` records, computed before any model work.

    The same computation as the runner's (``freeze_manifest`` with the same extras), so a sweep
    can tell whether a stored record belongs to this job, and which keys differ when it does not.
    ``versions`` defaults to the installed versions the manifest binds
    (``harness.measure.hardware.manifest_versions``), as in the runner.
    """
    if versions is None:
        versions = manifest_versions()
    return freeze_manifest(cfg, versions=versions, extra=manifest_extras(cfg))


def job_manifest_hash(cfg: DictConfig, *, versions: dict[str, str] | None = None) -> str:
    """The manifest hash a job with config ``cfg`` records (:func:`job_manifest`, hashed)."""
    return manifest_hash(job_manifest(cfg, versions=versions))


def draft_model_config(cfg: DictConfig):
    """The separate draft model a run needs: ``proposer=draft_model``, or a merged tree with
    ``draft_model`` among ``proposer.sources``; None otherwise (nothing is loaded)."""
    if cfg.proposer.name == "draft_model":
        return cfg.proposer.model
    if cfg.proposer.name == "merged" and "draft_model" in (cfg.proposer.get("sources") or []):
        return cfg.proposer.draft_model.model
    return None


def manifest_extras(cfg: DictConfig) -> dict:
    """Versioned artifacts the manifest binds beyond the config: the datastore release ids of a
    retrieval proposer or of prompt lookup's datastore, a merged tree's sources' included
    (:func:`~harness.proposers.rest.datastore_sources`; opened, or built on first use, before any
    model is loaded), the provenance of a published head checkpoint (path or hub id, layout, SHA-256
    of every file read; a hub id's snapshot, which its load in this process then reads:
    :func:`~harness.target.loading.pin_hub_snapshot`),
    the files of any other artifact directory given by path (EAGLE's, trained heads') and of a
    target or draft loaded by path (:func:`checkpoint_fingerprint`), and the SHA-256 of a prompt
    file (``workload.path``: its content is the prompts) and of a choice-list file
    (``topology.choices_file``: its content is the tree)."""
    p = cfg.proposer
    extras: dict = {}
    if datastore_sources(cfg):  # every datastore a source searches, a merged tree's prompt lookup's too
        extras.update(manifest_datastores(cfg))
    elif p.name in ("medusa", "hydra") and is_published(p.get("artifact")):
        layout = inspect(str(p.artifact), p.name)
        extras["proposer_artifact"] = layout.provenance()
        pin_hub_snapshot(str(p.artifact), layout.directory)  # a hub id: its load reads the snapshot recorded
    elif p.get("artifact") and Path(str(p.artifact)).expanduser().is_dir():
        extras["proposer_artifact"] = checkpoint_fingerprint(str(p.artifact))
    elif p.name == "eagle" and p.get("artifact") and looks_like_hub_id(str(p.artifact)):
        # a published draft by hub id: the snapshot it resolves to (downloaded now, before any model
        # work, as the load would), so new weights under the same id make another manifest
        local = resolve_source(str(p.artifact))  # the hub cache's snapshots/<revision>
        files = checkpoint_fingerprint(str(local))["files"]  # not the folder: another cache holds the same draft
        extras["proposer_artifact"] = {"ref": str(p.artifact), "revision": local.name, "files": files}
        pin_hub_snapshot(str(p.artifact), local)  # the load reads this snapshot, not one the id moves to later
    target = checkpoint_ref(cfg.model)
    if target is not None:
        extras["target_checkpoint"] = checkpoint_fingerprint(target)
    draft = draft_model_config(cfg)
    if draft is not None and checkpoint_ref(draft) is not None:
        extras["draft_checkpoint"] = checkpoint_fingerprint(checkpoint_ref(draft))
    workload_file = cfg.workload.get("path") if cfg.workload.name in ("jsonl", "spec_bench") else None
    if workload_file and Path(str(workload_file)).expanduser().is_file():  # its content is the prompts
        data = Path(str(workload_file)).expanduser().read_bytes()
        extras["workload_file"] = {"path": str(workload_file), "sha256": hashlib.sha256(data).hexdigest()}
    template = cfg.workload.get("chat_template")
    if template and Path(str(template)).expanduser().is_file():  # a Jinja file: its content formats the prompts
        data = Path(str(template)).expanduser().read_bytes()
        extras["chat_template_file"] = {"path": str(template), "sha256": hashlib.sha256(data).hexdigest()}
    choices_file = cfg.topology.get("choices_file")
    if cfg.topology.name == "choices" and choices_file:
        data = Path(str(choices_file)).expanduser().read_bytes()  # the budget has read it already
        extras["topology_choices_file"] = {"path": str(choices_file), "sha256": hashlib.sha256(data).hexdigest()}
    return extras
