"""Artifact recipes: the options that define a trained or searched proposer artifact (architecture,
data, training or search), from proposer config. An artifact's directory is named by its recipe and
the target's fingerprint, and a loaded artifact is refused unless both match
(:mod:`harness.heads.checkpoint`), so loading and training agree on what an artifact is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from harness.files import file_sha256
from harness.heads.checkpoint import ArtifactError
from harness.heads.eagle import spec_from_target
from harness.heads.models import HeadSpec
from harness.target.loading import chat_template_hash
from harness.workloads import corpora
from harness.workloads.corpora import sharegpt_path
from harness.workloads.datastore import LEAKAGE_THRESHOLD
from harness.workloads.prompts import HUMANEVAL_BOUNDS, HUMANEVAL_SPLIT_SALT, SHAREGPT_PROMPT_RULE

#: option keys of conf/proposer/{medusa,hydra,clover}.yaml that define the artifact
ARCH_KEYS = ("num_heads", "mlp_layers", "prefix_attention", "prefix_window", "attn_heads")


#: where a training stream's documents come from: ShareGPT's conversations, or documents the caller gives
DATA_SOURCES = ("sharegpt", "inline")

#: which tokens of a training document are labels (the positions a loss counts): ``assistant`` the
#: tokens of its assistant turns (:data:`ASSISTANT_SPAN_RULE`), ``all`` every token. Every token feeds
#: the target's forward and the drafts' context either way.
LOSS_TOKENS = ("assistant", "all")

#: how the assistant tokens of a templated document are found (part of the streams' and the artifacts'
#: keys where ``loss_tokens=assistant`` applies)
ASSISTANT_SPAN_RULE = (
    "each assistant turn's tokens: the conversation's rendering through the chat template up to and "
    "including the turn, less its rendering up to the turn before with the generation prompt added, "
    "cut after the first EOS token (the end-of-turn marker the model emits; template text after it is "
    "not the model's); a turn whose prefix renderings are not prefixes of the document marks nothing"
)


@dataclass(frozen=True)
class DataRecipe:
    source: str = "sharegpt"  # sharegpt | inline
    split: str = "train"
    token_budget: int = 5000  # tokens in the training stream
    held_out_split: str = "dev"
    held_out_tokens: int = 800
    max_len: int = 256  # tokens per document (longer ones are truncated)
    chat: bool = True  # wrap conversations in the tokenizer's chat template when it has one
    loss_tokens: str = "assistant"  # assistant | all: the labels (LOSS_TOKENS)

    def __post_init__(self) -> None:
        if self.source not in DATA_SOURCES:
            raise ValueError(f"data.source must be one of {list(DATA_SOURCES)}; got {self.source!r}")
        if self.loss_tokens not in LOSS_TOKENS:
            raise ValueError(f"data.loss_tokens must be one of {list(LOSS_TOKENS)}; got {self.loss_tokens!r}")
        if self.token_budget < 1 or self.held_out_tokens < 0 or self.max_len < 2:
            raise ValueError(f"need token_budget >= 1, held_out_tokens >= 0, max_len >= 2; got {self}")

    def to_dict(self) -> dict:
        return asdict(self)


#: how ShareGPT conversations become training documents (part of the streams' and the artifacts' keys)
DOCUMENT_RULE = (
    "user and assistant turns with text, from the first user turn, cut before the first turn repeating "
    "its predecessor's role; a conversation the chat template refuses is skipped; a training document "
    f"holding any {LEAKAGE_THRESHOLD}-token window of a held-out text (the first user and first assistant "
    "turn of each conversation of another split, as REST datastores keep out) is dropped, and so is one whose "
    "first user turn is a ShareGPT prompt of another split as the prompts compare texts (whitespace runs one "
    "space, the ends stripped, casefolded), however short (the prompts: "
    f"{SHAREGPT_PROMPT_RULE})"
)


def sharegpt_split_rule() -> str:
    """The rule that puts each ShareGPT conversation in its split, as the data key names it: the
    salt and the bucket bounds :func:`~harness.workloads.corpora.sharegpt_split` reads (a new salt
    or new bounds move conversations between the training, held-out and evaluated splits)."""
    bounds = ", ".join(f"{split} < {upper}" for split, upper in corpora.SPLIT_BOUNDS)
    return f"salt {corpora.SPLIT_SALT!r}; buckets of 10000: {bounds}"


def data_sources_key(data: DataRecipe, tokenizer) -> dict:
    """What the training text of ``data`` is made from besides its options, in the keys of its
    encoded streams and of the artifacts trained on them: :data:`DOCUMENT_RULE`, the ShareGPT file's
    SHA-256 and its split rule (``source=sharegpt``: :func:`sharegpt_split_rule`), the chat
    template the tokenizer applies (``chat`` on and the tokenizer has one; the tokenizer's
    fingerprint leaves it out) and, where ``loss_tokens=assistant`` marks its turns, how
    (:data:`ASSISTANT_SPAN_RULE`)."""
    key: dict = {"document_rule": DOCUMENT_RULE}
    if data.source == "sharegpt":
        key["sharegpt_sha256"] = file_sha256(sharegpt_path())  # what load_sharegpt records, without parsing it
        key["sharegpt_split"] = sharegpt_split_rule()
    template = chat_template_hash(tokenizer) if data.chat else None
    if template:
        key["chat_template"] = template  # as chat_template_key names a replaced one
        if data.loss_tokens == "assistant" and data.source == "sharegpt":
            key["assistant_spans"] = ASSISTANT_SPAN_RULE
    return key


LOSSES = ("hard", "distill")


@dataclass(frozen=True)
class TrainRecipe:
    epochs: int = 1
    lr: float = 1e-3
    batch_size: int = 32
    weight_decay: float = 0.0
    loss: str = "hard"  # hard | distill (Hydra++ teacher distillation)
    distill_temperature: float = 1.0
    head_decay: float = 0.8
    warmup_steps: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"train.loss must be one of {list(LOSSES)}; got {self.loss!r}")
        if self.epochs < 1 or self.batch_size < 1 or not self.lr > 0 or not self.distill_temperature > 0:
            raise ValueError(f"need epochs >= 1, batch_size >= 1, lr > 0, distill_temperature > 0; got {self}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class EagleTrainRecipe:
    """EAGLE's training objective (Li et al., 2024) on cached target features: for every pair
    ``(f_j, x_{j+1})`` of a document, ``feature_weight * SmoothL1(g_j, f_{j+1}) + token_weight *
    CE(softmax(lm_head(f_{j+1})), lm_head(g_j))``, teacher-forced on the target's own features."""

    epochs: int = 1
    lr: float = 1e-3
    batch_size: int = 2  # documents per step (each up to data.max_len pairs)
    weight_decay: float = 0.0
    warmup_steps: int = 10
    feature_weight: float = 1.0  # EAGLE's v_w
    token_weight: float = 0.1  # EAGLE's p_w
    feature_noise: float = 0.0  # U(-a, a) added to input features while training (the paper's augmentation)
    eval_depths: int = 5  # held-out top-1 agreement at draft depths 1..eval_depths
    seed: int = 0

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or not self.lr > 0 or self.eval_depths < 1:
            raise ValueError(f"need epochs >= 1, batch_size >= 1, lr > 0, eval_depths >= 1; got {self}")
        if self.feature_weight < 0 or self.token_weight < 0 or self.feature_weight + self.token_weight <= 0:
            raise ValueError(f"feature_weight and token_weight must be >= 0, not both 0; got {self}")
        if self.feature_noise < 0:
            raise ValueError(f"feature_noise must be >= 0; got {self.feature_noise}")

    def to_dict(self) -> dict:
        return asdict(self)


#: option keys of conf/proposer/eagle.yaml that define a trained EAGLE artifact's architecture
EAGLE_ARCH_KEYS = ("num_layers", "intermediate_size", "fc_bias")


@dataclass(frozen=True)
class AdapterRecipe:
    epochs: int = 1
    lr: float = 1e-3
    distill_temperature: float = 1.0
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SearchRecipe:
    trials: int = 12
    workload: str = "sharegpt"
    split: str = "dev"
    prompts: int = 3
    max_prompt_tokens: int = 96
    max_new_tokens: int = 32
    depth: int = 4  # draft chain length cap during the search
    gamma: float = 0.4  # initial threshold (the adaptive loop runs as at run time)
    chat: bool = True
    seed: int = 0
    # the fastest vectors of the trials timed again this many times each, interleaved with the AR
    # reference; each then stands at the median of its timings (0: the trials' single timings)
    confirm: int = 2
    finalists: int = 2

    def __post_init__(self) -> None:
        if self.trials < 1 or self.prompts < 1 or self.max_new_tokens < 1 or self.depth < 1:
            raise ValueError(f"search needs trials, prompts, max_new_tokens, depth >= 1; got {self}")
        if self.confirm < 0 or self.finalists < 1:
            raise ValueError(f"search needs confirm >= 0 and finalists >= 1; got {self}")

    def to_dict(self) -> dict:
        return asdict(self)


SEARCH_ALGORITHM = "optuna-tpe+influence-warm-start+median-confirmed-finalists+untimed-warm-up-v3"

#: the version of the code that trains draft heads (Medusa, Hydra, Clover): the losses, schedule and
#: batching of harness/prepare/heads_training.py and the evaluation the manifest records. Part of
#: every heads recipe (:func:`training_code_key`): bump it when a change to that code trains other
#: weights from the same options, so that an artifact the earlier code trained is trained again
#: under a new key rather than loaded (and one named by proposer.artifact is refused as another
#: recipe's). A change that trains the same weights (speed, logging) keeps it.
HEADS_TRAINING = "heads-training-1"
#: the version of the code that trains EAGLE drafts (harness/prepare/eagle.py: the feature and
#: token losses, feature noise, batching, schedule, the held-out depths): bump it as
#: :data:`HEADS_TRAINING`, when that code trains other weights from the same options
EAGLE_TRAINING = "eagle-training-1"
#: the version of the code that distils the early-exit adapter (harness/prepare/early_exit.py: the
#: distillation loss, document order, schedule, evaluation): bump it as :data:`HEADS_TRAINING`, when
#: that code trains other weights from the same options
EXIT_TRAINING = "exit-training-1"


def training_code_key(kind: str) -> dict:
    """The part of a ``kind`` artifact's recipe that names the version of the code that trains it
    (:data:`HEADS_TRAINING`, :data:`EAGLE_TRAINING`, :data:`EXIT_TRAINING`), as
    :data:`SEARCH_ALGORITHM` names the layer-skip search: a new version is a new recipe."""
    versions = {"medusa": HEADS_TRAINING, "hydra": HEADS_TRAINING, "clover": HEADS_TRAINING}
    versions.update({"eagle": EAGLE_TRAINING, "early_exit": EXIT_TRAINING})
    return {"training_code": versions[kind]}


def recipe_key(recipe: SearchRecipe) -> dict:
    """The recipe an artifact is keyed and checked by: the search options, the algorithm and what
    draws its prompts (:func:`search_prompts_key`)."""
    return {**recipe.to_dict(), "algorithm": SEARCH_ALGORITHM, **search_prompts_key(recipe)}


def search_prompts_key(recipe: SearchRecipe) -> dict:
    """What decides the layer-skip search's prompts besides its options: for ShareGPT the file's
    SHA-256, its split rule (as a trained artifact's data key names them) and its rule for which
    turn of a conversation is a prompt, for HumanEval its split rule; a new rule puts other prompts
    in the searched split."""
    if recipe.workload == "sharegpt":
        return {
            "sharegpt_sha256": file_sha256(sharegpt_path()),
            "sharegpt_split": sharegpt_split_rule(),
            "sharegpt_prompts": SHAREGPT_PROMPT_RULE,
        }
    if recipe.workload == "humaneval":
        bounds = ", ".join(f"{split} < {upper}" for split, upper in HUMANEVAL_BOUNDS)
        return {"humaneval_split": f"salt {HUMANEVAL_SPLIT_SALT!r}; buckets of 100: {bounds}"}
    return {}


def _heads_train(options: dict) -> dict:
    train = dict(options.get("train") or {})
    if options.get("distill") is not None:  # the Hydra++ switch selects the loss
        train["loss"] = "distill" if options["distill"] else "hard"
    return train


def heads_inert_options(kind: str, options: dict) -> dict[str, str]:
    """The heads options (dotted, under ``proposer.``) that train no other weights with these
    options, each with why: the recipe keeps their defaults, so setting one neither retrains the
    artifact nor refuses one given by path, and the run lists it under ``inert_options``."""
    out: dict[str, str] = {}
    if not options.get("prefix_attention"):
        no_prefix = "proposer.prefix_attention=false builds no prefix-attention layer"
        out["prefix_window"] = no_prefix
        if kind != "clover":  # Clover's cells and augmenting layers read attn_heads too
            out["attn_heads"] = f"{no_prefix}, the only attention of {kind}'s heads"
    if _heads_train(options).get("loss", "hard") == "hard":
        out["train.distill_temperature"] = "the hard-label loss has no temperature (proposer.distill=true reads it)"
    return out


def heads_recipe(kind: str, options: dict, model: torch.nn.Module) -> dict:
    """The artifact recipe from proposer options: architecture, data and training (the options
    :func:`heads_inert_options` names at their defaults)."""
    inert = heads_inert_options(kind, options)
    spec = HeadSpec(
        kind=kind,
        hidden_size=int(model.config.hidden_size),
        embed_size=int(model.get_input_embeddings().embedding_dim),
        **{k: options[k] for k in ARCH_KEYS if k in options and k not in inert},
    )
    data = DataRecipe(**dict(options.get("data") or {}))
    train = {k: v for k, v in _heads_train(options).items() if f"train.{k}" not in inert}
    train = TrainRecipe(**train)
    return {"spec": spec.to_dict(), "data": data.to_dict(), "train": train.to_dict()}


def eagle_recipe(options: dict, model: torch.nn.Module) -> dict:
    """A trained EAGLE-1/2 draft's recipe: one decoder layer shaped like the target's (EAGLE's own
    choice), the data and the training objective."""
    arch = {k: options[k] for k in EAGLE_ARCH_KEYS if options.get(k) is not None}
    spec = spec_from_target(model.config, **arch)
    return {
        "spec": spec.to_dict(),
        "data": DataRecipe(**dict(options.get("data") or {})).to_dict(),
        "train": EagleTrainRecipe(**dict(options.get("train") or {})).to_dict(),
    }


def exit_recipe(options: dict, model: torch.nn.Module) -> dict:
    layers = int(model.config.num_hidden_layers)
    exit_layer = int(options.get("exit_layer", 2))
    if not 1 <= exit_layer < layers:
        raise ArtifactError(
            f"proposer.exit_layer must be in [1, {layers - 1}] for this {layers}-layer target; got {exit_layer}"
        )
    return {
        "exit_layer": exit_layer,
        "data": DataRecipe(**dict(options.get("data") or {})).to_dict(),
        "train": AdapterRecipe(**dict(options.get("train") or {})).to_dict(),
    }
