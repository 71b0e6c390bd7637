"""Draft heads in the layouts their authors publish, loaded key for key and run with their
published forward: Medusa (Cai et al., 2024) and Hydra (Ankner et al., 2024).

``proposer.artifact`` names a directory or a hub id (``owner/name``, fetched with
``huggingface_hub`` on first use). A directory holding ``manifest.json`` is an artifact trained here
(:mod:`harness.heads.checkpoint`); anything else is read as a published layout:

``medusa`` — heads only: ``config.json`` (``medusa_num_heads``, ``medusa_num_layers``,
``base_model_name_or_path``; optional ``version``) and ``medusa_lm_head.safetensors`` or
``medusa_lm_head.pt``, keys ``{k}.{j}.linear.weight [H, H]`` and ``.bias [H]`` for each head ``k``
and residual block ``j < L``, plus ``{k}.{L}.weight [V, H]``, the head's own vocabulary projection
(no bias). Without the projection keys (the ``"version": "2"`` heads-only layout) each head
projects with the target's LM head. Medusa-2's full-model layout (a Hugging Face checkpoint whose
weight files carry the same keys under ``medusa_head.``) is read from its weight shards. Head
``k`` reads the last committed hidden state ``h`` (the target's final-norm row that predicted the
pending token) and applies its blocks ``x <- x + SiLU(W_j x + b_j)`` then its projection: it
predicts the token ``k + 1`` places past the pending one, with no token embedding.

``hydra`` — ``config.json`` (``hydra_num_heads``, ``hydra_num_layers``, ``hydra_head_arch``,
``grounded_heads``, ``hidden_state_offset``) and ``hydra_lm_head.pt`` (or ``.safetensors``),
architectures ``mlp`` and ``prefix-mlp``. Grounded head ``k``'s input is
``cat(p, E(x_t), E(x̂_{t+1}), ..., E(x̂_{t+k}))`` (``x_t``: the pending token; ``E``: the target's
input embedding), width ``(k + 2) H``; its first block is ``R(x) + SiLU(W x + b)`` with its own
``res_connection`` ``R``, later blocks are ``x + SiLU(W x + b)``; the vocabulary head
``hydra_lm_head.{k}`` has a bias. Ungrounded heads see ``p`` alone (Medusa-like). ``p`` is ``h``
for ``mlp``; for ``prefix-mlp`` it is the output (after its final norm) of a one-layer Llama model
(``prefix_embeding_layer.*``, the attribute's published spelling) run over every committed hidden
state as input embeddings, with its own KV cache, positions those of the committed tokens (for
ungrounded heads too, as Hydra trains them; Hydra's own ungrounded generation skips the prefix
layer, which a loaded bank notes). The
``prefix-mlp`` Sequential interleaves parameterless dropouts, so its blocks sit at ``1, 3, ...`` and
its vocabulary head at ``hydra_lm_head.{k}.1``. ``input_embed_fn.weight`` (the base embedding the
trainer saves incidentally) is checked against the target's shape, its equality with the target's
embedding recorded (``input_embed_matches_target``), and otherwise unused.

Refusals, with expected vs got: a missing, extra or mis-shaped tensor; a hidden size or vocabulary
that is not the target's; a head bank shallower than the topology; ``hydra_head_arch`` ``cross-attn``
or ``eagle-attn`` (not read here); ``hidden_state_offset != 0``. The head count and depth are read off
the weights, not the config: ``medusa-vicuna-7b-v1.3``'s ``config.json`` is known to say 2 heads
where its weights hold 5 (Medusa's own loader overrides it); a disagreement is recorded.

Blocks that a checkpoint stores once per repeat (Medusa's and Hydra's list-multiplied
``nn.Sequential`` saves ``L`` key groups sharing one tensor) are applied group by group, which is
the same forward when the groups are equal.

Not verified against real hub files (none are read by the tests): the Medusa-2 full-model shard
names, the hub Hydra configs' values, and whether ``hidden_state_offset > 0`` reads hidden states
at all upstream (it indexes a model output tuple); docs/architecture.md says so too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from inspect import signature as inspect_signature
from pathlib import Path

import torch
from torch import nn

from harness.files import file_sha256
from harness.heads.checkpoint import (
    MANIFEST_FILE,
    ArtifactError,
    check_weight_tensors,
    read_config_object,
    unreadable_tensor_file,
)
from harness.heads.eagle_formats import is_published_dir
from harness.heads.models import vocab_projection
from harness.target.loading import hub_unreachable, looks_like_hub_id

MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
HYDRA_FILES = ("hydra_lm_head.safetensors", "hydra_lm_head.pt")
FULL_MODEL_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
FULL_MODEL_FILES = ("model.safetensors", "pytorch_model.bin")
MEDUSA_FULL_PREFIX = "medusa_head."
HYDRA_ARCHS = ("mlp", "prefix-mlp")
PREFIX = "prefix_embeding_layer"


# --------------------------------------------------------------------------- locating files


def is_published(ref: str | None) -> bool:
    """Whether ``proposer.artifact`` names a published layout rather than an artifact trained here
    (a local directory with ``manifest.json``)."""
    if not ref:
        return False
    path = Path(str(ref)).expanduser()
    if path.is_dir():
        return not (path / MANIFEST_FILE).is_file()
    return not path.exists() and looks_like_hub_id(str(ref))


def is_published_checkpoint(ref: str | None, kind: str) -> bool:
    """Whether ``proposer.artifact`` names a published ``kind`` checkpoint: a local directory with
    ``config.json`` and that layout's weights (a heads file; for Medusa also Medusa-2 model weights;
    an EAGLE draft's model weights) and no ``manifest.json``, or a hub id no local path shadows.
    Narrower than :func:`is_published`, which takes every folder without a manifest for the
    published loader to read (and refuse, saying what it lacks)."""
    if not ref:
        return False
    path = Path(str(ref)).expanduser()
    if not path.is_dir():
        return is_published(ref)
    if kind == "eagle":
        return is_published_dir(path)
    if (path / MANIFEST_FILE).is_file() or not (path / "config.json").is_file():
        return False
    weights = MEDUSA_FILES + FULL_MODEL_INDEXES + FULL_MODEL_FILES if kind == "medusa" else HYDRA_FILES
    return any((path / name).is_file() for name in weights)


def _hub_file(repo: str, filename: str, revision: str | None = None) -> Path | None:
    """A file of a hub repository (downloaded once into the Hugging Face cache; at commit ``revision``
    where given), or None when the repository has no such file."""
    from huggingface_hub import hf_hub_download  # imported on use: only hub ids need it
    from huggingface_hub.errors import LocalEntryNotFoundError, RemoteEntryNotFoundError

    offline = hub_unreachable()  # then the cache only, at once, not after the client's retries
    pinned = {"revision": revision} if revision else {}
    try:
        return Path(hf_hub_download(repo, filename, local_files_only=offline is not None, **pinned))
    except RemoteEntryNotFoundError:
        return None
    except LocalEntryNotFoundError:
        if offline is not None:
            return None  # not cached: the caller tries the layout's other names, then says why
        raise ArtifactError(
            f"proposer.artifact={repo!r} is not a local directory, and {filename!r} is neither in the local hub "
            f"cache nor reachable ({offline or 'offline?'}): download the repository first or give its directory"
        ) from None
    except Exception as exc:  # no such repository, no access, network errors: one line for the user
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ArtifactError(
            f"proposer.artifact={repo!r} is not a local directory, and fetching {filename!r} from the hub failed: "
            f"{type(exc).__name__}: {first}"
        ) from None


def locate(ref: str, kind: str, *, revision: str | None = None) -> tuple[Path, str, list[Path]]:
    """(directory, layout, weight files) of a published ``kind`` checkpoint; a hub id is fetched (at
    commit ``revision`` where given, else its current one). Layouts: ``heads`` (the heads-only file)
    or ``full-model`` (Medusa-2 weight shards)."""
    heads_files = MEDUSA_FILES if kind == "medusa" else HYDRA_FILES
    local = Path(str(ref)).expanduser()
    if local.is_dir():
        config = local / "config.json"
        if not config.is_file():
            raise ArtifactError(f"proposer.artifact={ref!r} has no config.json: not a published {kind} checkpoint")
        for name in heads_files:
            if (local / name).is_file():
                return local, "heads", [local / name]
        if kind == "medusa":
            shards = _local_shards(local)
            missing = [f.name for f in shards if not f.is_file()]
            if missing:
                raise ArtifactError(
                    f"proposer.artifact={ref!r}: its weight index lists medusa_head.* tensors in "
                    f"{', '.join(missing)}, which the directory lacks"
                )
            if shards:
                return local, "full-model", shards
        raise ArtifactError(
            f"proposer.artifact={ref!r} holds neither a {kind} heads file ({' or '.join(heads_files)})"
            + (" nor Medusa-2 weight files with medusa_head.* tensors" if kind == "medusa" else "")
            + f" nor {MANIFEST_FILE} (an artifact trained here)"
        )
    if not looks_like_hub_id(str(ref)):
        raise ArtifactError(f"proposer.artifact={ref!r}: no such directory (and not a hub id of the form owner/name)")
    offline = hub_unreachable()
    config = _hub_file(str(ref), "config.json", revision)
    if config is None:
        at = f" at revision {revision}" if revision else ""
        if offline is not None:
            raise ArtifactError(
                f"proposer.artifact={ref!r} is not a local directory and not in the local hub cache{at}, and the hub "
                f"cannot be reached ({offline}): download the repository first or give its directory"
            )
        raise ArtifactError(f"hub repository {ref!r} has no config.json: not a published {kind} checkpoint")
    for name in heads_files:
        got = _hub_file(str(ref), name, revision)
        if got is not None:
            return config.parent, "heads", [got]
    if kind == "medusa":
        for index in FULL_MODEL_INDEXES:
            got = _hub_file(str(ref), index, revision)
            if got is not None:
                wanted = _shards_with_prefix(got, MEDUSA_FULL_PREFIX)
                shards = {n: _hub_file(str(ref), n, revision) for n in wanted}
                missing = [n for n, f in shards.items() if f is None]
                if missing:
                    why = (
                        f"not in the local hub cache and the hub cannot be reached ({offline})"
                        if offline is not None
                        else "not in the repository"
                    )
                    raise ArtifactError(
                        f"hub repository {ref!r}: {index} lists medusa_head.* tensors in {', '.join(missing)}, "
                        f"{why}: download the repository first or give its directory"
                    )
                return config.parent, "full-model", list(shards.values())
        for name in FULL_MODEL_FILES:
            got = _hub_file(str(ref), name, revision)
            if got is not None:
                return config.parent, "full-model", [got]
    where = f" in the local hub cache (the hub cannot be reached: {offline})" if offline is not None else ""
    raise ArtifactError(f"hub repository {ref!r} holds no {kind} heads file ({' or '.join(heads_files)}){where}")


def _shards_with_prefix(index: Path, prefix: str) -> list[str]:
    weight_map = read_config_object(index).get("weight_map") or {}
    return sorted({f for k, f in weight_map.items() if k.startswith(prefix)})


def _local_shards(directory: Path) -> list[Path]:
    """The weight files of a local Medusa-2 full model that hold its ``medusa_head.*`` tensors: the
    shards its weight index names, else the first of :data:`FULL_MODEL_FILES` the folder holds (as
    for a hub id; a file read after it would replace its heads)."""
    for index in FULL_MODEL_INDEXES:
        if (directory / index).is_file():
            return [directory / n for n in _shards_with_prefix(directory / index, MEDUSA_FULL_PREFIX)]
    return [directory / n for n in FULL_MODEL_FILES if (directory / n).is_file()][:1]


# --------------------------------------------------------------------------- reading tensors


#: safetensors' dtype names (a file header's ``dtype`` field) as torch dtypes
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    **{
        name: getattr(torch, attr)
        for name, attr in (
            ("U16", "uint16"),
            ("U32", "uint32"),
            ("U64", "uint64"),
            ("F8_E4M3", "float8_e4m3fn"),
            ("F8_E5M2", "float8_e5m2"),
        )
        if hasattr(torch, attr)
    },
}


def _read_safetensors(f: Path, prefix: str, data: bool, out: dict[str, torch.Tensor]) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                if key.startswith(prefix):
                    name = key[len(prefix) :]
                    if data:
                        out[name] = sf.get_tensor(key)
                    else:
                        sl = sf.get_slice(key)
                        dtype = SAFETENSORS_DTYPES.get(sl.get_dtype())
                        if dtype is None:
                            raise ArtifactError(
                                f"{str(f)!r}: {key} is stored as {sl.get_dtype()}, a dtype this harness does not "
                                "read (weights: F32, F16, BF16, F64 or F8)"
                            )
                        out[name] = torch.empty(sl.get_shape(), dtype=dtype, device="meta")
    except ArtifactError:
        raise
    except Exception as exc:  # a truncated or empty file, a header that is not safetensors'
        raise ArtifactError(f"cannot read {str(f)!r} as a safetensors file: {type(exc).__name__}: {exc}") from None


def _read_tensors(files: list[Path], *, prefix: str = "", data: bool) -> dict[str, torch.Tensor]:
    """Tensors of ``files`` whose keys start with ``prefix`` (prefix stripped). ``data=False``
    reads shapes and dtypes only where the format allows (safetensors headers; ``.pt`` files
    memory-mapped)."""
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if f.suffix == ".safetensors":
            _read_safetensors(f, prefix, data, out)
        else:
            try:
                try:
                    state = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError as exc:  # torch.save's legacy (pre-zip) format cannot be mapped
                    if "mmap" not in str(exc):
                        raise
                    state = torch.load(str(f), map_location="cpu", weights_only=True)
            except Exception as exc:
                raise unreadable_tensor_file(f, exc) from None
            if not isinstance(state, dict):
                raise ArtifactError(f"{str(f)!r} holds a {type(state).__name__}, not a state dict of tensors")
            for key, tensor in state.items():
                if isinstance(tensor, torch.Tensor) and key.startswith(prefix):
                    out[key[len(prefix) :]] = (
                        tensor if data else torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
                    )
    return out


# --------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class PublishedLayout:
    """What a published checkpoint holds, read from its config and tensor shapes (no weights)."""

    kind: str  # medusa | hydra
    format: str  # medusa-heads | medusa-heads-v2 | medusa-full-model | hydra-mlp | hydra-prefix-mlp
    ref: str  # proposer.artifact as given
    directory: Path
    files: tuple[Path, ...]
    config: dict
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int | None  # rows of the heads' own projections (None: the target's LM head)
    grounded: bool = False
    prefix_shapes: dict = field(default_factory=dict)
    key_prefix: str = ""
    notes: tuple[str, ...] = ()
    saved_dtypes: dict[str, int] = field(default_factory=dict)  # dtype -> tensors stored in it (the heads
    # run in the target's dtype)

    @property
    def dependent(self) -> bool:
        return self.kind == "hydra" and self.grounded

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return expected_shapes(self)

    def _index_digest(self) -> dict:
        """A full-model layout's weight index (it names the shards read): ``{"index_sha256": ...}``."""
        if self.format.endswith("full-model"):
            for name in FULL_MODEL_INDEXES:
                if (self.directory / name).is_file():
                    return {"index_sha256": file_sha256(self.directory / name)}
        return {}

    def provenance(self) -> dict:
        """Where the heads came from and what they hold: recorded in the run manifest. A local
        folder's path; for a hub id, the snapshot read (the hub cache's ``snapshots/<commit>``
        folder's commit), not where this machine's cache keeps it, so one checkpoint has one
        manifest on every machine."""
        local = Path(self.ref).expanduser().exists() or not looks_like_hub_id(self.ref)
        where = {"directory": str(self.directory)} if local else {"hub_snapshot": self.directory.name}
        return {
            "source": "published",
            "format": self.format,
            "ref": self.ref,
            **where,
            "files": {f.name: file_sha256(f) for f in self.files},
            "config_sha256": file_sha256(self.directory / "config.json"),
            **self._index_digest(),
            "base_model_name_or_path": self.config.get("base_model_name_or_path"),
            "num_heads": self.num_heads,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "grounded": self.grounded,
            "saved_dtypes": dict(self.saved_dtypes),
            "notes": list(self.notes),
        }


def _head_blocks(ref, shapes, kind: str, prefix: str = "") -> tuple[int, int]:
    """The number of heads and head 0's last block index among the ``{prefix}{k}.{j}.linear.weight``
    tensors; refuses a file with none."""
    rx = re.compile(re.escape(prefix) + r"(\d+)\.(\d+)\.linear\.weight")
    blocks = [(int(m[1]), int(m[2])) for k in shapes if (m := rx.fullmatch(k))]
    if not blocks:
        raise ArtifactError(
            f"proposer.artifact={ref!r}: no {kind} head tensors ({prefix}{{k}}.{{j}}.linear.weight); got keys "
            f"{sorted(shapes)[:6]}"
        )
    # a head missing from the weights (head 0 included) is named by the key check that follows
    k0 = min(k for k, _ in blocks)
    return max(k for k, _ in blocks) + 1, max(j for k, j in blocks if k == k0)


def inspect(ref: str, kind: str, *, revision: str | None = None) -> PublishedLayout:
    """Read a published checkpoint's config and tensor shapes (a hub id at commit ``revision`` where
    given); refuse what is not its layout."""
    if kind not in ("medusa", "hydra"):
        raise ArtifactError(f"proposer={kind} reads artifacts trained here only; published heads: medusa, hydra")
    directory, layout, files = locate(str(ref), kind, revision=revision)
    config = read_config_object(directory / "config.json")
    prefix = MEDUSA_FULL_PREFIX if layout == "full-model" else ""
    tensors = _read_tensors(files, prefix=prefix, data=False)
    shapes = {k: tuple(t.shape) for k, t in tensors.items()}
    if not shapes:
        raise ArtifactError(f"proposer.artifact={ref!r}: {', '.join(f.name for f in files)} hold no {kind} tensors")
    try:
        read = _inspect_medusa(ref, layout, config, shapes) if kind == "medusa" else _inspect_hydra(ref, config, shapes)
    except ArtifactError:
        raise
    except (KeyError, IndexError, TypeError, ValueError) as exc:  # a layout none of the checks above foresaw
        raise ArtifactError(
            f"proposer.artifact={ref!r}: not a readable {kind} checkpoint ({type(exc).__name__}: {exc})"
        ) from None
    names = MEDUSA_FILES if kind == "medusa" else HYDRA_FILES
    if layout == "full-model":
        names += FULL_MODEL_FILES
    unread = [n for n in names if (directory / n).is_file() and directory / n not in files]
    if unread:  # the first of the layout's names is read
        read["notes"] = (*read.get("notes", ()), f"{', '.join(unread)} left unread: {files[0].name} is read first")
    saved: dict[str, int] = {}
    for tensor in tensors.values():
        name = str(tensor.dtype).removeprefix("torch.")
        saved[name] = saved.get(name, 0) + 1
    out = PublishedLayout(
        kind=kind,
        ref=str(ref),
        directory=directory,
        files=tuple(files),
        config=config,
        saved_dtypes=dict(sorted(saved.items())),
        **read,
    )
    check_keys(out, shapes)
    check_weight_tensors(f"proposer.artifact={ref!r} ({out.format})", tensors)
    return out


def config_disagreements(config: dict, **from_weights: int) -> list[str]:
    """A note for every ``config.json`` count that differs from what the weights hold (the weights
    decide)."""
    notes = []
    for key, got in from_weights.items():
        said = config.get(key)
        if said is not None and (isinstance(said, bool) or not isinstance(said, int)):
            raise ArtifactError(f"config.json: {key}={said!r} is not a whole number (the weights hold {got})")
        if said is not None and int(said) != got:
            notes.append(f"config.json says {key}={said}; the weights hold {got} (read from the weights)")
    return notes


def _inspect_medusa(ref, layout, config, shapes) -> dict:
    """The :class:`PublishedLayout` fields a Medusa checkpoint's config and shapes give."""
    heads, last = _head_blocks(ref, shapes, "Medusa")
    layers = last + 1
    for key, shape in sorted(shapes.items()):  # a residual block maps the hidden state to itself
        if key.endswith(".linear.weight") and (len(shape) != 2 or shape[0] != shape[1]):
            raise ArtifactError(
                f"proposer.artifact={ref!r}: {key} has shape {list(shape)}; a Medusa residual block's weight is "
                "square, [hidden, hidden]"
            )
    hidden = next(shape[1] for key, shape in sorted(shapes.items()) if key.endswith(".0.linear.weight"))
    proj = f"0.{layers}.weight"
    vocab = shapes[proj][0] if proj in shapes else None
    notes = []
    version = str(config.get("version", "")) or None
    if version not in (None, "1", "2"):
        raise ArtifactError(
            f"proposer.artifact={ref!r}: config.json says version={config['version']!r}; readable Medusa "
            "versions: 1 (heads with their own vocabulary projection) and 2 (heads projecting with the target's)"
        )
    if version == "1" and vocab is None:
        raise ArtifactError(
            f"proposer.artifact={ref!r}: config.json says version 1 (heads with their own vocabulary projection) "
            f"but the weights hold no {proj}: the file is truncated, or its config should say version 2"
        )
    if version is None and vocab is None:
        notes.append(
            f"the weights hold no {proj} and config.json names no version: read as version 2 (heads projecting "
            "with the target's LM head)"
        )
    if version == "2" and vocab is not None:
        raise ArtifactError(
            f"proposer.artifact={ref!r}: config.json says version 2 (heads without their own vocabulary "
            f"projection) but the weights hold {proj} {list(shapes[proj])}"
        )
    notes += config_disagreements(config, medusa_num_heads=heads, medusa_num_layers=layers)
    if layout == "full-model":
        notes.append(
            "a Medusa-2 full model: only its medusa_head.* tensors are read; its heads were trained with its own "
            "fine-tuned backbone, which is not compared with the configured target (use that backbone as the target)"
        )
    fmt = (
        "medusa-full-model" if layout == "full-model" else ("medusa-heads" if vocab is not None else "medusa-heads-v2")
    )
    return dict(
        format=fmt,
        num_heads=heads,
        num_layers=layers,
        hidden_size=hidden,
        vocab_size=vocab,
        key_prefix=MEDUSA_FULL_PREFIX if layout == "full-model" else "",
        notes=tuple(notes),
    )


def _inspect_hydra(ref, config, shapes) -> dict:
    """The :class:`PublishedLayout` fields a Hydra checkpoint's config and shapes give."""
    arch = str(config.get("hydra_head_arch", "mlp"))
    if arch not in HYDRA_ARCHS:
        raise ArtifactError(
            f"proposer.artifact={ref!r}: hydra_head_arch={arch!r} is not read here; readable: {list(HYDRA_ARCHS)}"
        )
    offset = int(config.get("hidden_state_offset", 0) or 0)
    if offset != 0:
        raise ArtifactError(
            f"proposer.artifact={ref!r}: hidden_state_offset={offset} is not read here (only 0: the target's "
            "final-norm hidden state)"
        )
    grounded = config.get("grounded_heads", False)
    if not isinstance(grounded, bool):
        raise ArtifactError(
            f"proposer.artifact={ref!r}: config.json: grounded_heads={grounded!r} must be true or false "
            "(a JSON boolean)"
        )
    prefix_weights = "hydra_lm_head.0.1.weight" in shapes or any(k.startswith(PREFIX + ".") for k in shapes)
    if arch == "mlp" and prefix_weights and "hydra_lm_head.0.weight" not in shapes:
        said = "says hydra_head_arch=mlp" if "hydra_head_arch" in config else "names no hydra_head_arch (mlp)"
        raise ArtifactError(
            f"proposer.artifact={ref!r}: the weights are a prefix-mlp Hydra bank (hydra_lm_head.0.1.*, {PREFIX}.*) "
            f'but config.json {said}: set "hydra_head_arch": "prefix-mlp" in it'
        )
    step, first = (2, 1) if arch == "prefix-mlp" else (1, 0)
    heads, last = _head_blocks(ref, shapes, "Hydra", "hydra_mlp.")
    layers = (last - first) // step + 1
    last = f"hydra_mlp.0.{first + step * (layers - 1)}.linear.weight"
    if last not in shapes:
        raise ArtifactError(f"proposer.artifact={ref!r}: missing tensor(s) ['{last}'] (head 0's last block)")
    hidden = shapes[last][0]
    head = "hydra_lm_head.0.1.weight" if arch == "prefix-mlp" else "hydra_lm_head.0.weight"
    if head not in shapes:
        raise ArtifactError(f"proposer.artifact={ref!r}: {head} missing (the first head's vocabulary projection)")
    vocab = shapes[head][0]
    notes = config_disagreements(config, hydra_num_heads=heads, hydra_num_layers=layers)
    if arch == "prefix-mlp" and not grounded:
        notes.append(
            "ungrounded prefix-mlp heads read the prefix layer's output, as Hydra's training forward does; "
            "Hydra's own ungrounded generation passes them the target's hidden state instead"
        )
    prefix_shapes = {k: v for k, v in shapes.items() if k.startswith(PREFIX + ".")}
    return dict(
        format=f"hydra-{arch}",
        num_heads=heads,
        num_layers=layers,
        hidden_size=hidden,
        vocab_size=vocab,
        grounded=grounded,
        prefix_shapes=prefix_shapes,
        notes=tuple(notes),
    )


#: tensors a published file may carry beyond the heads: Hydra's trainer saves the base embedding
OPTIONAL_KEYS = ("input_embed_fn.weight",)


def expected_shapes(layout: PublishedLayout) -> dict[str, tuple[int, ...]]:
    """Every tensor the layout must hold, with its shape (the prefix layer's from its own file,
    checked for consistency by :func:`check_prefix_shapes`)."""
    h, k_heads, layers = layout.hidden_size, layout.num_heads, layout.num_layers
    out: dict[str, tuple[int, ...]] = {}
    if layout.kind == "medusa":
        for k in range(k_heads):
            for j in range(layers):
                out[f"{k}.{j}.linear.weight"] = (h, h)
                out[f"{k}.{j}.linear.bias"] = (h,)
            if layout.vocab_size is not None:
                out[f"{k}.{layers}.weight"] = (layout.vocab_size, h)
        return out
    prefix = layout.format == "hydra-prefix-mlp"
    step, first = (2, 1) if prefix else (1, 0)
    for k in range(k_heads):
        for j in range(layers):
            key = f"hydra_mlp.{k}.{first + step * j}"
            width = (k + 2) * h if (j == 0 and layout.grounded) else h
            out[f"{key}.linear.weight"] = (h, width)
            out[f"{key}.linear.bias"] = (h,)
            if j == 0 and layout.grounded:
                out[f"{key}.res_connection.weight"] = (h, width)
                out[f"{key}.res_connection.bias"] = (h,)
        head = f"hydra_lm_head.{k}.1" if prefix else f"hydra_lm_head.{k}"
        out[f"{head}.weight"] = (layout.vocab_size, h)
        out[f"{head}.bias"] = (layout.vocab_size,)
    if prefix:
        out.update(layout.prefix_shapes)
    return out


def check_keys(layout: PublishedLayout, shapes: dict[str, tuple[int, ...]]) -> None:
    """Key for key and shape for shape; names what is missing, extra or mis-shaped."""
    want = expected_shapes(layout)
    where = f"proposer.artifact={layout.ref!r} ({layout.format})"
    missing = sorted(set(want) - set(shapes))
    extra = sorted(set(shapes) - set(want) - set(OPTIONAL_KEYS))
    # Hydra's grounded heads hold a res_connection in their first layer: a mismatch there is the
    # config's grounded_heads flag disagreeing with the weights
    flag = ""
    if layout.kind == "hydra" and any("res_connection" in k for k in missing + extra):
        said = layout.config.get("grounded_heads")
        flag = (
            f" (config.json {'has no grounded_heads, read as false' if said is None else f'says grounded_heads={said}'}"
            f"; the weights {'lack' if missing and any('res_connection' in k for k in missing) else 'hold'} "
            "the grounded heads' res_connection: fix the flag)"
        )
    if missing:
        raise ArtifactError(
            f"{where}: missing tensor(s) {missing[:6]}{' ...' if len(missing) > 6 else ''}{flag}"
            f"{_partial_heads(want, shapes)}"
        )
    if extra:
        raise ArtifactError(f"{where}: unexpected tensor(s) {extra[:6]}{' ...' if len(extra) > 6 else ''}{flag}")
    for key, shape in want.items():
        if tuple(shapes[key]) != tuple(shape):
            raise ArtifactError(f"{where}: {key} has shape {list(shapes[key])}, expected {list(shape)}")
    if layout.format == "hydra-prefix-mlp":
        check_prefix_shapes(layout)


def _head_of(key: str) -> int | None:
    """The head a per-head tensor (Medusa's ``{k}.*``, Hydra's ``hydra_mlp.{k}.*`` and
    ``hydra_lm_head.{k}.*``) belongs to; None for a shared one (Hydra's prefix layer)."""
    m = re.match(r"(?:hydra_mlp\.|hydra_lm_head\.)?(\d+)\.", key)
    return int(m[1]) if m else None


def _partial_heads(want: Mapping[str, tuple[int, ...]], shapes: Mapping[str, tuple[int, ...]]) -> str:
    """Where heads are complete but the last ones hold only some of their tensors (a truncated file,
    or a stray tensor of a head that does not exist), a note that says which: the missing tensors
    alone read as a broken head that is not there."""
    heads: dict[int, list[str]] = {}
    for key in want:
        if (k := _head_of(key)) is not None:
            heads.setdefault(k, []).append(key)
    complete = [k for k, keys in heads.items() if all(key in shapes for key in keys)]
    partial = {k: [key for key in keys if key in shapes] for k, keys in heads.items() if k not in complete}
    if not complete or not partial or min(partial) < max(complete):
        return ""
    held = "; ".join(f"head {k} holds only {sorted(keys)}" for k, keys in sorted(partial.items()))
    return (
        f" ({_span(complete)} complete; {held}: a truncated file, or a stray tensor of a head that does not exist, "
        f"read as {max(partial) + 1} heads)"
    )


def _span(heads: Sequence[int]) -> str:
    heads = sorted(heads)
    if len(heads) > 1 and heads == list(range(heads[0], heads[-1] + 1)):
        return f"heads {heads[0]} to {heads[-1]}"
    return f"head{'s' if len(heads) > 1 else ''} {', '.join(map(str, heads))}"


PREFIX_KEYS = (
    "embed_tokens.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "layers.0.input_layernorm.weight",
    "layers.0.post_attention_layernorm.weight",
    "norm.weight",
)
PREFIX_OPTIONAL = ("layers.0.self_attn.rotary_emb.inv_freq",)


def check_prefix_shapes(layout: PublishedLayout, geometry: dict | None = None) -> None:
    """The one-layer prefix model's tensors: every key present, shapes consistent with the hidden
    size (and, given the target's geometry, with its attention heads and vocabulary)."""
    got = {k[len(PREFIX) + 1 :]: tuple(v) for k, v in layout.prefix_shapes.items()}
    where = f"proposer.artifact={layout.ref!r} ({layout.format})"
    missing = [f"{PREFIX}.{k}" for k in PREFIX_KEYS if k not in got]
    extra = [f"{PREFIX}.{k}" for k in got if k not in PREFIX_KEYS + PREFIX_OPTIONAL]
    if missing:
        raise ArtifactError(f"{where}: missing tensor(s) {missing}")
    if extra:
        raise ArtifactError(f"{where}: unexpected tensor(s) {sorted(extra)}")
    h = layout.hidden_size
    gate = got["layers.0.mlp.gate_proj.weight"]
    if len(gate) != 2:  # its rows give the intermediate size every other MLP shape is checked against
        raise ArtifactError(
            f"{where}: {PREFIX}.layers.0.mlp.gate_proj.weight has shape {list(gate)}, expected [intermediate, {h}]"
        )
    inter = gate[0]
    want = {
        "layers.0.mlp.gate_proj.weight": (inter, h),
        "layers.0.mlp.up_proj.weight": (inter, h),
        "layers.0.mlp.down_proj.weight": (h, inter),
        "layers.0.input_layernorm.weight": (h,),
        "layers.0.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
    }
    if geometry is not None:
        nh, nkv, hd = geometry["num_attention_heads"], geometry["num_key_value_heads"], geometry["head_dim"]
        want.update(
            {
                "embed_tokens.weight": (geometry["vocab_size"], h),
                "layers.0.self_attn.q_proj.weight": (nh * hd, h),
                "layers.0.self_attn.k_proj.weight": (nkv * hd, h),
                "layers.0.self_attn.v_proj.weight": (nkv * hd, h),
                "layers.0.self_attn.o_proj.weight": (h, nh * hd),
            }
        )
        if "layers.0.self_attn.rotary_emb.inv_freq" in got:
            want["layers.0.self_attn.rotary_emb.inv_freq"] = (hd // 2,)
    for key, shape in want.items():
        if got[key] != shape:
            raise ArtifactError(f"{where}: {PREFIX}.{key} has shape {list(got[key])}, expected {list(shape)}")


def check_target(layout: PublishedLayout, geometry: dict, *, depth: int) -> None:
    """The heads fit the configured target and topology (before any model work): hidden size,
    vocabulary, prefix-layer attention shapes, and a head per drafted depth."""
    where = f"proposer.artifact={layout.ref!r} ({layout.format})"
    if layout.hidden_size != geometry["hidden_size"]:
        raise ArtifactError(
            f"{where} has hidden size {layout.hidden_size}; the target's is {geometry['hidden_size']}: "
            "heads are only valid for the model they were trained on"
        )
    if layout.vocab_size is not None and layout.vocab_size != geometry["vocab_size"]:
        raise ArtifactError(
            f"{where} projects to {layout.vocab_size} tokens; the target's vocabulary has {geometry['vocab_size']}"
        )
    if layout.format == "hydra-prefix-mlp":
        check_prefix_shapes(layout, geometry)
    if depth > layout.num_heads:
        raise ArtifactError(
            f"the topology drafts {depth} tokens deep but {where} has {layout.num_heads} heads "
            "(one per depth): use a shallower topology"
        )


# --------------------------------------------------------------------------- the heads


@dataclass(frozen=True)
class PublishedSpec:
    """What :class:`~harness.proposers.heads.HeadsProposer` reads off a head bank."""

    kind: str
    num_heads: int
    hidden_size: int
    dependent: bool
    prefix_attention: bool = False  # the window-based prefix layer of heads trained here (never here)
    prefix_window: int = 1


class _Block(nn.Module):
    """``R(x) + SiLU(W x + b)``: ``R`` is the identity unless the block has a ``res_connection``."""

    def __init__(self, width_in: int, width_out: int, residual_linear: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(width_in, width_out)
        self.res_connection = nn.Linear(width_in, width_out) if residual_linear else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.res_connection(x) if self.res_connection is not None else x
        return r + nn.functional.silu(self.linear(x))


class PublishedHeads(nn.Module):
    """A published Medusa or Hydra head bank with its published forward.

    The interface :class:`~harness.proposers.heads.HeadsProposer` uses: ``spec``, ``context``,
    ``depth`` (1-based depth ``i`` = published head ``i - 1``), ``vocab_logits`` and, for
    ``prefix-mlp``, ``prefix_model`` with :meth:`prefix_step`."""

    def __init__(self, layout: PublishedLayout, *, target_config=None) -> None:
        super().__init__()
        self.layout = layout
        h, k_heads, layers = layout.hidden_size, layout.num_heads, layout.num_layers
        self.spec = PublishedSpec(
            kind=layout.kind, num_heads=k_heads, hidden_size=h, dependent=layout.dependent, prefix_window=1
        )
        self.grounded = layout.grounded
        self.blocks = nn.ModuleList()
        for k in range(k_heads):
            head = nn.ModuleList()
            for j in range(layers):
                conditioned = layout.kind == "hydra" and layout.grounded and j == 0
                head.append(_Block((k + 2) * h if conditioned else h, h, residual_linear=conditioned))
            self.blocks.append(head)
        if layout.vocab_size is not None:
            bias = layout.kind == "hydra"
            self.proj = nn.ModuleList(nn.Linear(h, layout.vocab_size, bias=bias) for _ in range(k_heads))
        else:
            self.proj = None
        self.prefix_model = None
        self._prefix_inv_freq32: torch.Tensor | None = None
        if layout.format == "hydra-prefix-mlp":
            self.prefix_model = _prefix_model(layout, target_config)
            self._prefix_inv_freq32 = self.prefix_model.rotary_emb.inv_freq.detach().float().clone()

    def _apply(self, fn, recurse: bool = True):
        """Casts keep the prefix layer's rotary frequencies in float32 (as a transformers model loaded
        in a half-precision dtype keeps its own), so its RoPE angles at long positions are not
        rounded to the heads' dtype."""
        super()._apply(fn, recurse)
        if self._prefix_inv_freq32 is not None:
            rotary = self.prefix_model.rotary_emb
            rotary.inv_freq = self._prefix_inv_freq32.to(rotary.inv_freq.device)
            if hasattr(rotary, "original_inv_freq"):
                rotary.original_inv_freq = self._prefix_inv_freq32.to(rotary.inv_freq.device)
        return self

    # ------------------------------------------------------------------ published key names
    def published_keys(self) -> dict[str, str]:
        """Published key -> this module's parameter name."""
        lay = self.layout
        out: dict[str, str] = {}
        prefix = lay.format == "hydra-prefix-mlp"
        step, first = (2, 1) if prefix else (1, 0)
        for k in range(lay.num_heads):
            for j in range(lay.num_layers):
                pub = f"{k}.{j}" if lay.kind == "medusa" else f"hydra_mlp.{k}.{first + step * j}"
                for part in ("linear.weight", "linear.bias"):
                    out[f"{pub}.{part}"] = f"blocks.{k}.{j}.{part}"
                if self.blocks[k][j].res_connection is not None:
                    for part in ("res_connection.weight", "res_connection.bias"):
                        out[f"{pub}.{part}"] = f"blocks.{k}.{j}.{part}"
            if self.proj is not None:
                if lay.kind == "medusa":
                    out[f"{k}.{lay.num_layers}.weight"] = f"proj.{k}.weight"
                else:
                    pub = f"hydra_lm_head.{k}.1" if prefix else f"hydra_lm_head.{k}"
                    out[f"{pub}.weight"] = f"proj.{k}.weight"
                    out[f"{pub}.bias"] = f"proj.{k}.bias"
        if self.prefix_model is not None:
            for key in PREFIX_KEYS:
                out[f"{PREFIX}.{key}"] = f"prefix_model.{key}"
        return out

    def load_published(self, state: dict[str, torch.Tensor]) -> None:
        """Copy every published tensor into place (strict: each parameter filled exactly once)."""
        mapping = self.published_keys()
        own = dict(self.named_parameters())
        filled = set()
        for pub, name in mapping.items():
            if pub not in state:
                raise ArtifactError(f"proposer.artifact={self.layout.ref!r}: missing tensor {pub}")
            target = own[name]
            if tuple(state[pub].shape) != tuple(target.shape):
                raise ArtifactError(
                    f"proposer.artifact={self.layout.ref!r}: {pub} has shape {list(state[pub].shape)}, "
                    f"expected {list(target.shape)}"
                )
            with torch.no_grad():
                target.copy_(state[pub].to(target.dtype))
            filled.add(name)
        unfilled = sorted(set(own) - filled)
        if unfilled:
            raise ArtifactError(f"proposer.artifact={self.layout.ref!r}: parameters left unfilled: {unfilled[:6]}")
        inv = state.get(f"{PREFIX}.layers.0.self_attn.rotary_emb.inv_freq")
        if inv is not None and self.prefix_model is not None:
            # compared at the precision they were saved in: Hydra casts its heads (this buffer
            # included) to the base model's dtype before it saves them
            ours = self._prefix_inv_freq32.to(inv.dtype).float()
            saved = inv.float().cpu()
            if inv.shape != ours.shape or not torch.allclose(
                saved, ours, rtol=max(1e-4, torch.finfo(inv.dtype).eps), atol=0
            ):
                raise ArtifactError(
                    f"proposer.artifact={self.layout.ref!r}: the prefix layer's rotary frequencies differ from "
                    "the target config's (rope theta or head width): the heads were trained for another base"
                )

    # ------------------------------------------------------------------ forward
    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def context(self, window: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, W, d]`` committed rows -> ``h``, the newest row ``[B, d]`` (prefix-mlp heads get
        their context from :meth:`prefix_step` instead)."""
        return window[:, -1]

    def depth(self, i: int, ctx: torch.Tensor, path_emb: torch.Tensor) -> torch.Tensor:
        """Published head ``i - 1``: ``ctx`` ``[B, d]``; ``path_emb`` ``[B, >= i, d]``
        (``E(x_t), E(x̂_{t+1}), ...``; grounded Hydra uses the first ``i``) -> ``[B, d]``."""
        if not 1 <= i <= self.spec.num_heads:
            raise ValueError(f"head index must be in [1, {self.spec.num_heads}]; got {i}")
        x = ctx.to(self.dtype)
        if self.grounded:
            if path_emb.shape[1] < i:
                raise ValueError(f"grounded Hydra head {i} needs {i} path embeddings; got {path_emb.shape[1]}")
            used = path_emb[:, :i].to(self.dtype)
            x = torch.cat([x, used.reshape(used.shape[0], -1)], dim=-1)  # [B, (i + 1) d]
        for block in self.blocks[i - 1]:
            x = block(x)
        return x

    def vocab_logits(self, depths: list[int], hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Row ``r`` of ``hidden`` ``[n, d]`` through head ``depths[r]``'s projection -> ``[n, V]``
        (the target's LM head for Medusa's version-2 layout)."""
        if self.proj is None:
            w = lm_head.weight
            return vocab_projection(lm_head, hidden.to(device=w.device, dtype=w.dtype))
        hidden = hidden.to(self.dtype)
        out = [None] * len(depths)
        for i in dict.fromkeys(depths):  # one product per head, over all its rows
            idx = [r for r, d in enumerate(depths) if d == i]
            logits = vocab_projection(self.proj[i - 1], hidden[idx])  # [len(idx), V]
            for j, r in enumerate(idx):
                out[r] = logits[j]
        return torch.stack(out)

    # ------------------------------------------------------------------ Hydra's prefix layer
    def prefix_step(self, rows: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """Feed committed hidden rows ``[n, d]`` at ``positions`` ``[n]`` to the prefix model
        (its KV ``cache`` grows by ``n``) -> its final-norm outputs ``[n, d]``."""
        # transformers 5.24 renamed `past_key_values=` to `cache=`; older releases only know the former
        params = inspect_signature(self.prefix_model.forward).parameters
        cache_kw = "cache" if "cache" in params else "past_key_values"
        out = self.prefix_model(
            inputs_embeds=rows[None].to(self.dtype),
            position_ids=positions[None].to(rows.device),
            use_cache=True,
            **{cache_kw: cache},
        )
        return out.last_hidden_state[0]

    def new_prefix_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.prefix_model.config)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _prefix_model(layout: PublishedLayout, target_config):
    """Hydra's one-layer prefix model as a transformers Llama model built from the target's
    config (attention heads, rotary settings, norm epsilon), one decoder layer."""
    from transformers import LlamaConfig, LlamaModel

    if target_config is None:
        raise ArtifactError("a prefix-mlp Hydra head bank needs the target's config")
    c = target_config
    h = layout.hidden_size
    nh = int(c.num_attention_heads)
    inter = layout.prefix_shapes[f"{PREFIX}.layers.0.mlp.gate_proj.weight"][0]
    cfg = LlamaConfig(
        vocab_size=int(c.vocab_size),
        hidden_size=h,
        intermediate_size=int(inter),
        num_hidden_layers=1,
        num_attention_heads=nh,
        num_key_value_heads=int(getattr(c, "num_key_value_heads", None) or nh),
        head_dim=int(getattr(c, "head_dim", None) or h // nh),
        rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
        max_position_embeddings=int(getattr(c, "max_position_embeddings", 2048)),
        hidden_act=str(getattr(c, "hidden_act", "silu")),
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    )
    rope = getattr(c, "rope_parameters", None)
    if rope:
        cfg.rope_parameters = dict(rope)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        return LlamaModel(cfg)


#: a saved embedding this close to the target's, relative to its norm, is the target's: rounded to
#: bf16 (about 2e-3) or read from a quantised GGUF (Q8_0: about 6e-3); another model's is about 1
SAME_EMBEDDING_RELATIVE = 1e-2


def same_embedding(saved: torch.Tensor, target: torch.Tensor, *, rows: int = 8192) -> tuple[bool, float]:
    """Whether a draft's saved copy of an input embedding is the target's up to rounding or
    quantisation (``||saved - target|| / ||target||`` below :data:`SAME_EMBEDDING_RELATIVE`), and the
    largest absolute difference. Compared ``rows`` rows at a time on the target's device: no float32
    copy of a whole large vocabulary."""
    diff_sq = norm_sq = 0.0
    largest = 0.0
    for i in range(0, target.shape[0], rows):
        theirs = target[i : i + rows].detach().float()
        mine = saved[i : i + rows].detach().to(theirs.device, torch.float32)
        diff = mine - theirs
        diff_sq += float(diff.pow(2).sum())
        norm_sq += float(theirs.pow(2).sum())
        largest = max(largest, float(diff.abs().max()) if diff.numel() else 0.0)
    relative = (diff_sq**0.5) / (norm_sq**0.5) if norm_sq > 0 else (0.0 if diff_sq == 0 else float("inf"))
    return relative < SAME_EMBEDDING_RELATIVE, largest


def load_published_heads(layout: PublishedLayout, *, model: nn.Module) -> PublishedHeads:
    """The head bank of ``layout`` with its weights, on the target's device and in its dtype.
    ``embed_matches_target`` says whether a saved base embedding (Hydra's ``input_embed_fn``)
    equals the target's (None: none saved)."""
    state = _read_tensors(list(layout.files), prefix=layout.key_prefix, data=True)
    check_keys(layout, {k: tuple(v.shape) for k, v in state.items()})  # the files may have changed since
    check_weight_tensors(f"proposer.artifact={layout.ref!r} ({layout.format})", state)
    embed = model.get_input_embeddings().weight.detach()
    saved = state.get("input_embed_fn.weight")
    matches = None
    if saved is not None:
        if tuple(saved.shape) != tuple(embed.shape):
            raise ArtifactError(
                f"proposer.artifact={layout.ref!r}: input_embed_fn.weight has shape {list(saved.shape)}, "
                f"the target's input embedding {list(embed.shape)}"
            )
        matches = same_embedding(saved, embed)[0]
    heads = PublishedHeads(layout, target_config=model.config)
    heads.load_published(state)
    p = next(model.parameters())
    heads = heads.to(device=p.device, dtype=p.dtype).eval().requires_grad_(False)
    heads.embed_matches_target = matches
    return heads
