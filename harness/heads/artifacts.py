"""Head artifacts: recipe from config, load when cached, train when absent.

The recipe (architecture + data + training options) and the target fingerprint name the artifact
directory; the manifest records the token budget, held-out top-1 agreement, training time and
whether it is a CPU-budget artifact (trained here on CPU within the ~10-minute budget, so its
results are labelled ``cpu_budget_artifact`` in records).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.heads.checkpoint import ArtifactError, artifact_dir, load_artifact, save_artifact, target_fingerprint
from harness.heads.data import DataRecipe, training_streams
from harness.heads.models import DraftHeads, HeadSpec
from harness.heads.training import TrainRecipe, evaluate, train_heads

log = logging.getLogger("harness.heads")

#: option keys of conf/proposer/{medusa,hydra,clover}.yaml that define the artifact
ARCH_KEYS = ("num_heads", "mlp_layers", "prefix_attention", "prefix_window", "attn_heads")


@dataclass(frozen=True)
class HeadsArtifact:
    heads: DraftHeads
    manifest: dict
    path: Path

    @property
    def cpu_budget_artifact(self) -> bool:
        return bool(self.manifest.get("cpu_budget_artifact", False))


def heads_recipe(kind: str, options: dict, model: torch.nn.Module) -> dict:
    """The artifact recipe from proposer options: architecture, data and training."""
    spec = HeadSpec(
        kind=kind,
        hidden_size=int(model.config.hidden_size),
        embed_size=int(model.get_input_embeddings().embedding_dim),
        **{k: options[k] for k in ARCH_KEYS if k in options},
    )
    data = DataRecipe(**dict(options.get("data") or {}))
    train = dict(options.get("train") or {})
    if options.get("distill") is not None:  # the Hydra++ switch selects the loss
        train["loss"] = "distill" if options["distill"] else "hard"
    train = TrainRecipe(**train)
    return {"spec": spec.to_dict(), "data": data.to_dict(), "train": train.to_dict()}


def build_heads(recipe: dict, state: dict[str, torch.Tensor] | None = None, *, seed: int = 0) -> DraftHeads:
    spec = HeadSpec(**recipe["spec"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        heads = DraftHeads(spec)
    if state is not None:
        heads.load_state_dict(state, strict=True)  # raises on any missing or unexpected tensor
    return heads.eval()


def train_artifact(
    kind: str,
    recipe: dict,
    *,
    model: torch.nn.Module,
    tokenizer,
    target_source: str,
    out_dir: Path,
    documents=None,
    progress: bool = True,
    cache_streams: bool = True,
) -> HeadsArtifact:
    """Build the streams (cached), train, evaluate held-out, save. Returns the loaded artifact."""
    t0 = time.perf_counter()
    target_hash = target_fingerprint(model, tokenizer)
    data = DataRecipe(**recipe["data"])
    train_stream, held = training_streams(
        model, tokenizer, data, target_hash=target_hash, documents=documents, cache=cache_streams, progress=progress
    )
    stream_seconds = time.perf_counter() - t0
    heads = build_heads(recipe, seed=int(recipe["train"]["seed"]))
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    before = evaluate(heads, held, embed=embed, lm_head=lm_head)
    log_ = train_heads(
        heads, train_stream, recipe=TrainRecipe(**recipe["train"]), embed=embed, lm_head=lm_head, progress=progress
    )
    after = evaluate(heads, held, embed=embed, lm_head=lm_head)
    device = str(next(model.parameters()).device)
    manifest = {
        "kind": kind,
        "target_hash": target_hash,
        "target_source": target_source,
        "recipe": recipe,
        "token_budget": int(data.token_budget),
        "tokens_seen": int(len(train_stream)),
        "documents": int(train_stream.num_documents),
        "held_out": {
            "split": data.held_out_split,
            "tokens": len(held),
            **after,
            "top1_agreement_untrained": before["top1_agreement"],
        },
        "training": {
            **log_,
            "stream_seconds": stream_seconds,
            "total_seconds": time.perf_counter() - t0,
            "device": device,
            "threads": torch.get_num_threads(),
        },
        "cpu_budget_artifact": device == "cpu",
        "parameters": heads.num_parameters(),
    }
    save_artifact(out_dir, manifest=manifest, state=heads.state_dict())
    return load_heads(kind, recipe, model=model, tokenizer=tokenizer, path=out_dir)


def load_heads(kind: str, recipe: dict, *, model: torch.nn.Module, tokenizer, path: Path) -> HeadsArtifact:
    manifest, state = load_artifact(path, kind=kind, target_hash=target_fingerprint(model, tokenizer), recipe=recipe)
    if state is None:
        raise ArtifactError(f"artifact {str(path)!r} has no weights")
    return HeadsArtifact(heads=build_heads(recipe, state), manifest=manifest, path=Path(path))


def ensure_heads(
    kind: str,
    options: dict,
    *,
    model: torch.nn.Module,
    tokenizer,
    target_source: str,
    progress: bool = True,
    force: bool = False,
    documents=None,
) -> HeadsArtifact:
    """Load the configured artifact; train it first when absent (and ``auto_train``) or ``force``."""
    recipe = heads_recipe(kind, options, model)
    explicit = options.get("artifact")
    path = (
        Path(explicit)
        if explicit
        else artifact_dir(kind, target_hash=target_fingerprint(model, tokenizer), recipe=recipe)
    )
    if (path / "manifest.json").is_file() and not force:
        return load_heads(kind, recipe, model=model, tokenizer=tokenizer, path=path)
    if explicit and not force:
        raise ArtifactError(
            f"proposer.artifact={explicit!r} does not exist; run `harness train proposer={kind}` "
            "or leave proposer.artifact unset to use the cache"
        )
    if not options.get("auto_train", True) and not force:
        raise ArtifactError(
            f"no {kind} artifact for this target and recipe at {str(path)!r} and "
            f"proposer.auto_train=false; run `harness train proposer={kind} ...` first"
        )
    log.warning("training the %s heads artifact (absent from %s)", kind, path)
    return train_artifact(
        kind,
        recipe,
        model=model,
        tokenizer=tokenizer,
        target_source=target_source,
        out_dir=path,
        documents=documents,
        progress=progress,
    )


def summary(artifact: HeadsArtifact) -> dict:
    m = artifact.manifest
    return {
        "path": str(artifact.path),
        "artifact_id": m["artifact_id"],
        "kind": m["kind"],
        "target_hash": m["target_hash"],
        "token_budget": m["token_budget"],
        "tokens_seen": m["tokens_seen"],
        "held_out_top1_agreement": m["held_out"]["top1_agreement"],
        "held_out_top1_agreement_untrained": m["held_out"]["top1_agreement_untrained"],
        "training_seconds": m["training"]["total_seconds"],
        "cpu_budget_artifact": m["cpu_budget_artifact"],
        "parameters": m["parameters"],
        "recipe": m["recipe"],
    }


def train_from_config(cfg, *, target, force: bool = False, progress: bool = True) -> dict:
    """`harness train proposer=medusa|hydra|clover`: the artifact a run with ``cfg`` would load."""
    from omegaconf import OmegaConf

    options = OmegaConf.to_container(cfg.proposer, resolve=True)
    kind = options.pop("name")
    artifact = ensure_heads(
        kind,
        options,
        model=target.model,
        tokenizer=target.tokenizer,
        target_source=target.source,
        progress=progress,
        force=force,
    )
    return summary(artifact)
