"""Checkpoints written by the tests themselves: tiny Hugging Face model directories with a byte-level
tokenizer, and draft heads in the layouts Medusa and Hydra publish (random weights, built from the
published key names and shapes; no file is copied from anywhere)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

#: ids 0..2 are <pad>, <s>, </s>; ids 3..258 the 256 byte-level symbols
BYTE_VOCAB = 259


def boundary_tokenizer():
    """A tiny byte-level BPE tokenizer whose only merges join a space to the letter after it, as
    SmolLM2's do: a text's first word is coded apart from what precedes it (``P`` alone, ``ĠP`` after
    a space)."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = [("Ġ", c) for c in string.ascii_letters]
    vocab.update({a + b: len(vocab) + i for i, (a, b) in enumerate(merges)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def byte_tokenizer(*, rename: dict[int, str] | None = None, lowercase: bool = False):
    """A byte-level BPE tokenizer without merges (259 ids). ``rename`` replaces the token string of
    some ids (a tokenizer that differs from the default one at those ids); ``lowercase`` adds a
    normaliser (same vocabulary, different normalisation)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())):
        vocab[ch] = 3 + i
    if rename:
        by_id = {i: t for t, i in vocab.items()}
        for i, name in rename.items():
            by_id[i] = name
        vocab = {t: i for i, t in by_id.items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def tiny_checkpoint(
    path: Path,
    *,
    seed: int = 0,
    num_layers: int = 2,
    tokenizer=None,
    pad_to: int | None = None,
    pad_scale: float = 10.0,
    hidden_size: int = 32,
    max_shard_size: str | None = None,
) -> Path:
    """A tiny Llama (vocabulary: the byte tokenizer's 259 ids) saved with ``save_pretrained`` plus
    its tokenizer: a checkpoint a user would give by path. ``pad_to`` pads the embedding matrix
    and the LM head to that many rows (``resize_token_embeddings``, as families pad to a multiple),
    the same weights otherwise; padding row ``i`` of the LM head is ``pad_scale`` times real row
    ``i mod 259``, so with ``pad_to >= 518`` the padding wins every unrestricted argmax and a draft
    that proposed outside the tokenizer's range would show. ``max_shard_size`` (``"20KB"``) saves the
    weights in shards of at most that size, with a ``model.safetensors.index.json``."""
    from harness.target.loading import build_tiny_model

    model = build_tiny_model(seed=seed, vocab_size=BYTE_VOCAB, num_layers=num_layers, hidden_size=hidden_size)
    if pad_to is not None:
        model.resize_token_embeddings(pad_to, mean_resizing=False)
        with torch.no_grad():
            w = model.lm_head.weight  # [pad_to, H]
            for i in range(BYTE_VOCAB, pad_to):
                w[i] = pad_scale * w[i % BYTE_VOCAB]
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 1, 2, 0
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    (tokenizer or byte_tokenizer()).save_pretrained(path)
    return path


def prompts_file(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts)))
    return path


# --------------------------------------------------------------------------- Medusa heads


def medusa_state(*, heads: int, layers: int, hidden: int, vocab: int | None, seed: int = 0, share: bool = True):
    """Medusa's heads-only state dict: ``{k}.{j}.linear.weight [H, H]`` and ``.bias [H]`` for
    ``j < layers``, and ``{k}.{layers}.weight [V, H]`` (the head's own vocabulary projection; absent
    when ``vocab`` is None, the "version 2" layout). ``share``: the ``j`` blocks of one head are one
    tensor, as Medusa's list-multiplied ``nn.Sequential`` saves them."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for k in range(heads):
        w = torch.randn(hidden, hidden, generator=g) * 0.05
        b = torch.randn(hidden, generator=g) * 0.05
        for j in range(layers):
            if not share and j:
                w = torch.randn(hidden, hidden, generator=g) * 0.05
                b = torch.randn(hidden, generator=g) * 0.05
            state[f"{k}.{j}.linear.weight"] = w
            state[f"{k}.{j}.linear.bias"] = b
        if vocab is not None:
            state[f"{k}.{layers}.weight"] = torch.randn(vocab, hidden, generator=g) * 0.5
    return state


def write_medusa(
    path: Path,
    state: dict[str, torch.Tensor],
    *,
    config: dict,
    fmt: str = "pt",
) -> Path:
    """``config.json`` + ``medusa_lm_head.pt`` (``torch.save``) or ``medusa_lm_head.safetensors``
    (shared tensors cloned first: safetensors refuses them)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if fmt == "pt":
        torch.save(state, path / "medusa_lm_head.pt")
    else:
        from safetensors.torch import save_file

        save_file({k: v.clone().contiguous() for k, v in state.items()}, str(path / "medusa_lm_head.safetensors"))
    return path


def medusa_config(heads: int, layers: int, **extra) -> dict:
    return {
        "medusa_num_heads": heads,
        "medusa_num_layers": layers,
        "base_model_name_or_path": "tiny",
        "transformers_version": "4.34.0",
        **extra,
    }


# --------------------------------------------------------------------------- Hydra heads


def hydra_state(
    *,
    heads: int,
    layers: int,
    hidden: int,
    vocab: int,
    grounded: bool = True,
    arch: str = "mlp",
    embed: torch.Tensor | None = None,
    prefix: dict[str, torch.Tensor] | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Hydra's ``hydra_lm_head.pt`` state dict for ``hydra_head_arch`` ``mlp`` or ``prefix-mlp``.

    mlp, grounded: head ``k``'s first block ``hydra_mlp.{k}.0`` has ``linear`` and
    ``res_connection`` of shape ``[H, (k + 2) H]`` (input: the hidden state and ``k + 1`` token
    embeddings); blocks ``1..L-1`` are ``[H, H]`` and share one tensor. Ungrounded: every block is
    ``[H, H]``. Vocabulary heads ``hydra_lm_head.{k}.weight [V, H]`` and ``.bias [V]``.
    prefix-mlp: the Sequential interleaves parameterless dropouts, so blocks sit at ``1, 3, ...``
    and the vocabulary head at ``hydra_lm_head.{k}.1``; ``prefix`` holds the one-layer Llama's
    tensors (``prefix_embeding_layer.*``). ``embed``: the base embedding saved as
    ``input_embed_fn.weight``."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    step, first = (2, 1) if arch == "prefix-mlp" else (1, 0)
    for k in range(heads):
        shared_w = torch.randn(hidden, hidden, generator=g) * 0.05
        shared_b = torch.randn(hidden, generator=g) * 0.05
        for j in range(layers):
            key = f"hydra_mlp.{k}.{first + step * j}"
            if j == 0 and grounded:
                width = (k + 2) * hidden
                state[f"{key}.linear.weight"] = torch.randn(hidden, width, generator=g) * 0.05
                state[f"{key}.linear.bias"] = torch.randn(hidden, generator=g) * 0.05
                state[f"{key}.res_connection.weight"] = torch.randn(hidden, width, generator=g) * 0.05
                state[f"{key}.res_connection.bias"] = torch.randn(hidden, generator=g) * 0.05
            else:
                state[f"{key}.linear.weight"] = shared_w
                state[f"{key}.linear.bias"] = shared_b
        head = f"hydra_lm_head.{k}.1" if arch == "prefix-mlp" else f"hydra_lm_head.{k}"
        state[f"{head}.weight"] = torch.randn(vocab, hidden, generator=g) * 0.5
        state[f"{head}.bias"] = torch.randn(vocab, generator=g) * 0.1
    if embed is not None:
        state["input_embed_fn.weight"] = embed.detach().clone()
    if prefix:
        state.update(prefix)
    return state


def hydra_prefix_state(model, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors for Hydra's one-layer prefix model (``prefix_embeding_layer.*``), shaped
    after the base model's config (Llama attention, MLP and norms, the persistent rotary
    ``inv_freq`` buffer, an unused ``embed_tokens``)."""
    c = model.config
    h, nh = c.hidden_size, c.num_attention_heads
    nkv = getattr(c, "num_key_value_heads", None) or nh
    hd = getattr(c, "head_dim", None) or h // nh
    g = torch.Generator().manual_seed(seed)
    p = "prefix_embeding_layer"

    def r(*shape, scale=0.05):
        return torch.randn(*shape, generator=g) * scale

    return {
        f"{p}.embed_tokens.weight": r(c.vocab_size, h),
        f"{p}.layers.0.self_attn.q_proj.weight": r(nh * hd, h),
        f"{p}.layers.0.self_attn.k_proj.weight": r(nkv * hd, h),
        f"{p}.layers.0.self_attn.v_proj.weight": r(nkv * hd, h),
        f"{p}.layers.0.self_attn.o_proj.weight": r(h, nh * hd),
        f"{p}.layers.0.self_attn.rotary_emb.inv_freq": 1.0 / (rope_theta(c) ** (torch.arange(0, hd, 2).float() / hd)),
        f"{p}.layers.0.mlp.gate_proj.weight": r(c.intermediate_size, h),
        f"{p}.layers.0.mlp.up_proj.weight": r(c.intermediate_size, h),
        f"{p}.layers.0.mlp.down_proj.weight": r(h, c.intermediate_size),
        f"{p}.layers.0.input_layernorm.weight": 1.0 + r(h, scale=0.1),
        f"{p}.layers.0.post_attention_layernorm.weight": 1.0 + r(h, scale=0.1),
        f"{p}.norm.weight": 1.0 + r(h, scale=0.1),
    }


def rope_theta(config) -> float:
    """The rotary base of a config (transformers 5 keeps it in ``rope_parameters``)."""
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)


def hydra_config(heads: int, layers: int, *, arch: str = "mlp", grounded: bool = True, **extra) -> dict:
    return {
        "hydra_num_heads": heads,
        "hydra_num_layers": layers,
        "hydra_head_arch": arch,
        "grounded_heads": grounded,
        "hidden_state_offset": 0,
        "base_model_name_or_path": "tiny",
        "transformers_version": "4.34.0",
        **extra,
    }


def write_hydra(path: Path, state: dict[str, torch.Tensor], *, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    torch.save(state, path / "hydra_lm_head.pt")
    return path


def best_first_choices(num_nodes: int, *, max_depth: int = 4, rank_decay: float = 0.6, depth_factor: float = 0.3):
    """A sparse static tree as a choice list, built here (not a published one): the ``num_nodes``
    rank paths of highest score, a path's score the product over its ranks ``r`` of
    ``depth_factor * rank_decay ** r`` (a geometric acceptance profile), ties broken by
    ``(len(path), path)``. A child never outscores its parent nor a lower-ranked sibling, so the
    list is closed under prefixes and has ranks 0..n-1 below every node."""
    frontier = [(1.0, ())]
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < num_nodes:
        frontier.sort(key=lambda sp: (-sp[0], len(sp[1]), sp[1]))
        score, path = frontier.pop(0)
        if path:
            chosen.append(path)
        if len(path) < max_depth:
            children = [(score * depth_factor * rank_decay**r, path + (r,)) for r in range(num_nodes)]
            frontier.extend(children)
    return [list(p) for p in chosen]


def write_choices(path: Path, choices: list[list[int]]) -> Path:
    """A JSON choice-list file, as ``topology.choices_file`` reads it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(choices) + "\n")
    return path
