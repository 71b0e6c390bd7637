"""Structured-config schemas backing every config group.

Each YAML under ``conf/<group>/`` lists its schema first in its defaults
(``/schema/<group>/<name>@_here_``), so a mistyped key or a wrong type fails at compose time. The
schemas live in the ``schema/`` groups of Hydra's ConfigStore, apart from the selectable options:
``proposer=<name>`` offers only the YAML files of ``conf/proposer/``.

Every numeric option declares its valid range beside it (``ranged``: a
:class:`harness.contracts.Range` in the field's metadata), and a few string options their
choices; :func:`harness.engine.checks.validate_config` checks them, with the other checks that need
no model, before any model work.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from harness.cli import one_line
from harness.contracts import ConfigError, Range
from harness.engine.build import plan
from harness.engine.checks import register_schemas
from harness.runner import check_job
from harness.target.loading import DTYPES
from harness.target.options import LINEAR_KERNELS
from harness.topology.budgets import cartesian_rows, choices_size
from harness.workloads.datastore import DEFAULT_MAX_TOKENS, LEAKAGE_THRESHOLD
from harness.workloads.prompts import SPLITS

#: the config groups (schema-backed YAML) that `harness run` composes
CONF_DIR = Path(__file__).resolve().parent / "conf"


#: the largest whole number an option takes (int64's: torch's and numpy's integers); a larger one
#: would pass a range with no upper bound and fail mid-run, in a native op
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class DeclaredRange(Range):
    """A :class:`Range` whose whole numbers end at :data:`INT64_MAX` where it declares no tighter
    upper bound (a float is left to its declared bounds); refused with the bound named."""

    def admits(self, value: Any) -> bool:
        return super().admits(value) and not _beyond_int64(value)

    def check(self, key: str, value: Any) -> None:
        if self.le is None and self.lt is None and _beyond_int64(value):
            dataclasses.replace(self, le=INT64_MAX).check(key, value)
        super().check(key, value)


def _beyond_int64(value: Any) -> bool:
    """Whether ``value``, or an item of it (lists and dicts walked), is a whole number above :data:`INT64_MAX`."""
    if isinstance(value, dict | DictConfig):
        return any(_beyond_int64(v) for v in value.values())
    if isinstance(value, list | tuple | ListConfig):
        return any(_beyond_int64(v) for v in value)
    return isinstance(value, int) and not isinstance(value, bool) and value > INT64_MAX


def ranged(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, **bounds: Any) -> Any:
    """A dataclass field whose valid values are declared beside it (:class:`Range`: ``ge``, ``gt``,
    ``le``, ``lt``, ``choices``, ``each``; a whole number at most :data:`INT64_MAX` unless ``le`` or
    ``lt`` is tighter), checked before any model work."""
    return field(default=default, default_factory=default_factory, metadata={"range": DeclaredRange(**bounds)})


SEED = {"ge": 0, "le": 2**32 - 1}  # numpy's seed range; derived seeds add offsets and multiples within int64
POSITIVE_INT = {"ge": 1}
PROBABILITY = {"ge": 0.0, "le": 1.0}
#: torch threads a run may ask for: far more than any machine's cores, far fewer than would exhaust
#: memory as torch starts them (100,000 do)
MAX_THREADS = 4096
#: tokens the chi-square test bins at most (gates.chi2_top_m): as many as the largest vocabularies of
#: current language models (about 256,000 tokens); the check refuses more than a known vocabulary's
MAX_CHI2_TOP_M = 2**18


@dataclass
class TinyConfig:
    """The LlamaConfig of ``model=tiny`` (harness.target.loading.tiny_llama_config). Token ids 0-2
    are pad, bos and eos; prompts map bytes to ids from 3, so a vocabulary needs at least 4."""

    vocab_size: int = ranged(96, ge=4)
    hidden_size: int = ranged(32, **POSITIVE_INT)
    num_layers: int = ranged(2, **POSITIVE_INT)
    num_heads: int = ranged(4, **POSITIVE_INT)
    num_kv_heads: int = ranged(2, **POSITIVE_INT)
    intermediate_size: int = ranged(64, **POSITIVE_INT)
    max_position_embeddings: int = ranged(512, **POSITIVE_INT)
    rope_theta: float = ranged(10000.0, gt=0.0)
    rms_norm_eps: float = ranged(1e-6, gt=0.0)
    tie_word_embeddings: bool = False  # the LM head shares the input embedding's matrix


#: decoder layers of the default derived draft (proposer=draft_model: the target's first k layers)
DEFAULT_DERIVED_LAYERS = 6


@dataclass
class ModelConfig:
    # smollm2 | tiny | hf (a checkpoint directory or hub id in name_or_path; any other name is taken
    # as one) | derived (a draft only: the target's first num_layers decoder layers)
    name: str = "smollm2"
    name_or_path: Optional[str] = None
    # default: bfloat16 on a CUDA device, float32 elsewhere (an explicit value always wins)
    dtype: str = ranged("${device_dtype:${.device}}", choices=tuple(DTYPES))
    device: str = "cpu"  # cpu | cuda | cuda:N | mps (checked against this torch's devices)
    attn_implementation: str = "sdpa"
    # name=derived only; a model given by name or path loads whole
    num_layers: Optional[int] = ranged(None, **POSITIVE_INT)
    seed: int = ranged(0, **SEED)  # weights seed for model=tiny
    trust_remote_code: bool = False  # explicit opt-in: runs code from the checkpoint
    tiny: TinyConfig = field(default_factory=TinyConfig)  # the LlamaConfig of model=tiny
    # how every nn.Linear computes (harness.target.options): auto (on an x86 CPU whose compiler builds the
    # native kernels: streaming_panels for bfloat16 where the CPU has AMX; on Intel with AVX-512
    # streaming_panels for float32, streaming for bfloat16; default on Intel without AVX-512; elsewhere
    # streaming_panels for float32 without AVX-512, streaming otherwise; never panels under model.compile;
    # without the kernels weight_major for float32 off Intel, else default) | default (F.linear) | onednn |
    # mkl_packed | weight_major
    # ((W @ x.T).T) | streaming (the harness's own kernel) | streaming_panels (the same over a copy of
    # each weight packed: float32 in panels of 16 output features, bfloat16 in pairs for AMX's tiles)
    linear_kernel: str = ranged("auto", choices=LINEAR_KERNELS)
    # torch.compile(dynamic=True) of the model's forward (on CPU it needs a C++ compiler)
    compile: bool = False
    # KV in preallocated buffers written in place (harness.target.kv_cache); false: transformers'
    # DynamicCache, which concatenates every layer's whole cache each forward. The same values.
    # null: preallocated, unless model.compile (a compiled forward breaks its graph at each append)
    static_cache: Optional[bool] = None
    # each Llama decoder layer as one native call (harness.target.fused_layers); null: where the
    # linear kernel is streaming or streaming_panels (CPU), the cache preallocated and the forward
    # uncompiled
    fused_layers: Optional[bool] = None
    # on a CUDA device, whether scaled-dot-product attention may dispatch to cuDNN's attention kernel
    # (harness.target.options.resolve_cudnn_attention); null: false (cuDNN plans each new sequence
    # length, a host-side cost per attention call that dominates a small model's decode step)
    cudnn_attention: Optional[bool] = None


@dataclass
class ProposerConfig:
    name: str = MISSING


@dataclass
class PromptLookupConfig(ProposerConfig):
    name: str = "prompt_lookup"
    max_ngram: int = ranged(3, **POSITIVE_INT)
    min_ngram: int = ranged(1, **POSITIVE_INT)  # <= max_ngram
    max_matches: int = ranged(8, **POSITIVE_INT)
    # fixed | adaptive (rows chosen from measured t(n) and learned acceptance)
    budget_policy: str = ranged("fixed", choices=("fixed", "adaptive"))
    # normalised t(1..max_nodes+1); measured when absent
    verify_cost: Optional[list[float]] = ranged(None, gt=0.0, each=True)
    # tokens of earlier requests' outputs searched too (0: the current request only)
    history_tokens: int = ranged(0, ge=0)
    # after a round, propose the tails of candidates the target rejected by one token (shape=sequences)
    rejected_tails: bool = False
    # a REST datastore whose continuations of the committed suffix join the candidate tree
    # (shape=sequences; `+datastore@proposer.datastore=stdlib` or `=sharegpt`); null: none
    datastore: Optional[DatastoreConfig] = None


@dataclass
class DraftModelConfig(ProposerConfig):
    name: str = "draft_model"
    sampling: str = ranged("iid", choices=("iid", "without_replacement", "beam"))
    # the draft: name=derived (default, conf/proposer/draft_model.yaml), a checkpoint
    # (name=hf name_or_path=...), smollm2 or tiny; dtype, device, attention default to the target's
    model: ModelConfig = field(default_factory=ModelConfig)
    description: str = ""


@dataclass
class DatastoreConfig:
    """A REST datastore (conf/datastore/*.yaml, composed at ``proposer.datastore``)."""

    corpus: str = ranged("stdlib", choices=("stdlib", "sharegpt", "files"))  # harness/workloads/corpora.py
    # corpus=files: the user's own text, a folder (its files matching glob), a text file or a .jsonl file
    corpus_path: Optional[str] = None
    glob: str = "**/*"  # corpus=files, a folder: the files read, relative to it
    roles: list[str] = field(default_factory=lambda: ["assistant"])  # conversation turns read (sharegpt, files)
    path: Optional[str] = None  # a datastore directory (its release manifest rules); null: cache, built on first use
    max_tokens: Optional[int] = ranged(DEFAULT_MAX_TOKENS, **POSITIVE_INT)  # build cap (sentinels included)
    context_len: int = ranged(16, **POSITIVE_INT)
    continuation_len: int = ranged(8, **POSITIVE_INT)
    max_matches: int = ranged(64, **POSITIVE_INT)
    exclude: str = "humaneval"  # humaneval | sharegpt_heldout | none | F.jsonl (comma-separated)
    # run-time refusal at a longest match >= this many tokens: lowered, stricter; never above the standard 32
    # (a prompt held whole would pass as gated: allow_leakage=true runs a leaked workload, ungated)
    leakage_threshold: int = ranged(LEAKAGE_THRESHOLD, ge=1, le=LEAKAGE_THRESHOLD)
    verify_corpus: bool = True  # recompute the corpus snapshot on load


@dataclass
class RestConfig(ProposerConfig):
    name: str = "rest"
    datastore: DatastoreConfig = field(default_factory=DatastoreConfig)
    max_suffix: int = ranged(16, **POSITIVE_INT)
    min_suffix: int = ranged(2, **POSITIVE_INT)  # <= max_suffix
    max_matches: int = ranged(64, **POSITIVE_INT)
    continuation_len: int = ranged(8, **POSITIVE_INT)


@dataclass
class MergedConfig(ProposerConfig):
    """proposer=merged: several sources merged by full prefix into one tree per round."""

    name: str = "merged"
    sources: list[str] = field(default_factory=lambda: ["rest", "prompt_lookup"])
    # per-source depth cap (a draft chain costs one draft forward per level); null: topology.max_depth
    depths: dict[str, Optional[int]] = ranged(
        default_factory=lambda: {"draft_model": 4, "rest": None, "prompt_lookup": None}, ge=1, each=True
    )
    rest: RestConfig = field(default_factory=RestConfig)
    prompt_lookup: PromptLookupConfig = field(default_factory=PromptLookupConfig)
    draft_model: DraftModelConfig = field(default_factory=DraftModelConfig)


@dataclass
class HeadsDataConfig:
    """Training stream of a heads artifact (harness/prepare/heads_data.py)."""

    source: str = ranged("sharegpt", choices=("sharegpt",))  # documents from code: DataRecipe(source="inline")
    split: str = ranged("train", choices=SPLITS)
    # tokens of cached target hidden states; CPU budget: SmolLM2 heads train at ~11 s per 1,000
    # tokens on 2 cores (hidden states + one epoch), so 40,000 is ~7.5 min (docs/measurements.md);
    # below one document's 3 tokens (see held_out_tokens) the stream holds no training row
    token_budget: int = ranged(40000, ge=3)
    held_out_split: str = ranged("dev", choices=SPLITS)
    # a document of fewer than 3 tokens holds no training row (an anchor, its token and a label): a
    # held-out budget or a window below that leaves the artifact with no held-out evaluation, or no data
    held_out_tokens: int = ranged(2000, ge=3)
    max_len: int = ranged(256, ge=3)
    chat: bool = True
    # the loss positions: assistant (the tokens of assistant turns, where a chat template renders the
    # conversation; plain-text documents have no turns and label every token) or all (every token);
    # the token budget counts every token either way
    loss_tokens: str = ranged("assistant", choices=("assistant", "all"))


@dataclass
class HeadsTrainConfig:
    epochs: int = ranged(1, **POSITIVE_INT)
    lr: float = ranged(1e-3, gt=0.0, le=10.0)  # above it Adam's first step overflows float32 or diverges
    batch_size: int = ranged(32, **POSITIVE_INT)
    weight_decay: float = ranged(0.0, ge=0.0)
    distill_temperature: float = ranged(1.0, ge=1e-3)  # far below, the teacher's softmax overflows: NaN weights
    head_decay: float = ranged(0.8, gt=0.0, le=1.0)  # lambda_i = head_decay ** (i - 1)
    warmup_steps: int = ranged(10, ge=0)
    seed: int = ranged(0, **SEED)


@dataclass
class HeadsConfig(ProposerConfig):
    """proposer=medusa | hydra | clover (harness/proposers/heads.py)."""

    name: str = MISSING
    # beam (score_only) | iid | without_replacement (normalized_conditional)
    sampling: str = ranged("beam", choices=("beam", "iid", "without_replacement"))
    num_heads: int = ranged(3, **POSITIVE_INT)
    mlp_layers: int = ranged(1, **POSITIVE_INT)  # Hydra++ switch: 4
    distill: bool = False  # Hydra++ switch: teacher-distribution loss instead of hard labels
    prefix_attention: bool = False  # Hydra++ switch: prefix-attention layer once per round
    prefix_window: int = ranged(16, **POSITIVE_INT)
    attn_heads: int = ranged(4, **POSITIVE_INT)
    artifact: Optional[str] = None  # explicit artifact directory; default: the cache, by target + recipe
    auto_train: bool = True  # train the artifact when absent (progress bar)
    data: HeadsDataConfig = field(default_factory=HeadsDataConfig)
    train: HeadsTrainConfig = field(default_factory=HeadsTrainConfig)


@dataclass
class EagleTrainConfig:
    """EAGLE's objective on cached target features (harness/prepare/eagle.py)."""

    epochs: int = ranged(1, **POSITIVE_INT)
    lr: float = ranged(1e-3, gt=0.0, le=10.0)  # above it Adam's first step overflows float32 or diverges
    batch_size: int = ranged(2, **POSITIVE_INT)  # documents per step (each up to data.max_len pairs)
    weight_decay: float = ranged(0.0, ge=0.0)
    warmup_steps: int = ranged(10, ge=0)
    feature_weight: float = ranged(1.0, ge=0.0)  # SmoothL1 on the predicted feature (EAGLE's v_w)
    token_weight: float = ranged(0.1, ge=0.0)  # cross-entropy to the target's distribution (EAGLE's p_w)
    feature_noise: float = ranged(0.0, ge=0.0)  # U(-a, a) on input features while training
    eval_depths: int = ranged(5, **POSITIVE_INT)  # held-out top-1 agreement at depths 1..eval_depths
    seed: int = ranged(0, **SEED)


@dataclass
class EagleConfig(ProposerConfig):
    """proposer=eagle (harness/proposers/eagle.py): an EAGLE draft trained here, or a published
    EAGLE / EAGLE-2 / EAGLE-3 checkpoint (proposer.artifact=PATH_OR_HUB_ID)."""

    name: str = "eagle"
    # beam (score_only) | iid | without_replacement (normalized_conditional)
    sampling: str = ranged("beam", choices=("beam", "iid", "without_replacement"))
    num_layers: int = ranged(1, **POSITIVE_INT)  # decoder layers of a draft trained here (EAGLE: 1)
    intermediate_size: Optional[int] = ranged(
        None, **POSITIVE_INT
    )  # MLP width of a draft trained here; None: the target's
    fc_bias: bool = True  # the fusion layer's bias (EAGLE's default)
    artifact: Optional[str] = None  # a trained artifact's directory, or a published checkpoint (path or hub id)
    auto_train: bool = True  # train the artifact when absent (progress bar)
    data: HeadsDataConfig = field(default_factory=HeadsDataConfig)
    train: EagleTrainConfig = field(default_factory=EagleTrainConfig)


@dataclass
class AdapterTrainConfig:
    epochs: int = ranged(1, **POSITIVE_INT)
    lr: float = ranged(1e-3, gt=0.0, le=10.0)  # above it Adam's first step overflows float32 or diverges
    distill_temperature: float = ranged(1.0, ge=1e-3)  # tau of Kangaroo's adapter distillation loss (soft-target CE)
    seed: int = ranged(0, **SEED)


@dataclass
class EarlyExitConfig(ProposerConfig):
    """proposer=early_exit (Kangaroo, harness/proposers/selfspec.py)."""

    name: str = "early_exit"
    sampling: str = ranged("beam", choices=("beam", "iid"))  # beam (score_only) | iid (normalized_conditional)
    exit_layer: int = ranged(2, **POSITIVE_INT)  # l: the shared shallow trunk is the target's first l layers
    eta: float = ranged(0.5, ge=0.0, lt=1.0)  # stop drafting when the top-1 confidence is <= eta
    artifact: Optional[str] = None
    auto_train: bool = True
    data: HeadsDataConfig = field(default_factory=HeadsDataConfig)
    train: AdapterTrainConfig = field(default_factory=AdapterTrainConfig)


@dataclass
class SkipThresholdConfig:
    """Draft & Verify's dynamic draft length: stop when the top-1 probability is <= gamma; gamma
    follows an acceptance EMA (``LayerSkipProposer.observe_round``): each round moves it by
    ``(1 - beta2) * epsilon``, up while the EMA is <= target_acceptance and down above it. The
    bounds keep that loop able to move both ways and drafting possible: gamma=1 stops every draft
    (a top-1 probability is never above 1), beta2=1 or epsilon=0 never moves gamma, beta1=1 freezes
    the EMA at the first round's rate, target_acceptance=1 lets gamma only rise and target_acceptance=0
    (once any draft is accepted) only fall."""

    gamma: float = ranged(0.4, ge=0.0, lt=1.0)
    adaptive: bool = True
    beta1: float = ranged(0.5, ge=0.0, lt=1.0)
    beta2: float = ranged(0.9, ge=0.0, lt=1.0)
    epsilon: float = ranged(0.05, gt=0.0, le=1.0)
    target_acceptance: float = ranged(0.7, gt=0.0, lt=1.0)


@dataclass
class SkipSearchConfig:
    """Bayesian optimisation (Optuna TPE) of the skip vector on the dev split."""

    # CPU budget: about 10 minutes on SmolLM2 with 2 busy cores for the trials (13 timings of the dev
    # prompts with the AR reference); the confirmation below adds 6 more at the defaults
    trials: int = ranged(12, **POSITIVE_INT)
    workload: str = ranged("sharegpt", choices=("humaneval", "sharegpt"))  # built-in prompts (no path option)
    split: str = ranged("dev", choices=SPLITS)
    prompts: int = ranged(3, **POSITIVE_INT)
    max_prompt_tokens: int = ranged(96, **POSITIVE_INT)
    max_new_tokens: int = ranged(32, **POSITIVE_INT)
    depth: int = ranged(4, **POSITIVE_INT)
    gamma: float = ranged(0.4, ge=0.0, lt=1.0)  # the trials' starting threshold (proposer.threshold.gamma's rule)
    chat: bool = True
    seed: int = ranged(0, **SEED)
    # the `finalists` fastest vectors of the trials are timed `confirm` more times each, interleaved
    # with the AR reference, and chosen by the median of their timings (one timing is noisier than the
    # gaps between candidates); confirm=0 keeps the trials' single timings
    confirm: int = ranged(2, ge=0)
    finalists: int = ranged(2, **POSITIVE_INT)


@dataclass
class LayerSkipConfig(ProposerConfig):
    """proposer=layer_skip (Draft & Verify, harness/proposers/selfspec.py)."""

    name: str = "layer_skip"
    sampling: str = ranged("beam", choices=("beam", "iid"))
    skip: Optional[list[int]] = ranged(None, ge=0, each=True)  # explicit layers to bypass; None: the search artifact
    artifact: Optional[str] = None
    auto_train: bool = True  # run the search when its artifact is absent
    threshold: SkipThresholdConfig = field(default_factory=SkipThresholdConfig)
    search: SkipSearchConfig = field(default_factory=SkipSearchConfig)


@dataclass
class TopologyConfig:
    name: str = "sequence"  # sequence | sequences | set | expansion | sequoia | merged | cartesian | dynamic
    max_nodes: int = ranged(8, **POSITIVE_INT)  # candidate rows, root excluded
    max_depth: int = ranged(8, **POSITIVE_INT)
    widths: list[int] = ranged(default_factory=list, ge=1, each=True)
    topk: int = ranged(0, ge=0)  # topology=dynamic: children per expanded node and expanded nodes per depth
    sources: list[str] = field(default_factory=list)
    tree_artifact: Optional[str] = None


@dataclass
class SequoiaCalibrationConfig:
    parents: int = ranged(500, **POSITIVE_INT)  # parent nodes measured; fewer (prompts ran out) fails the stage
    branches: int = ranged(8, **POSITIVE_INT)  # sibling slots tried per parent: the acceptance vector's length
    max_new_tokens: int = ranged(64, **POSITIVE_INT)  # committed tokens per calibration prompt
    prompts: Optional[int] = ranged(None, **POSITIVE_INT)  # calibration-split prompts (None: as many as needed)
    # Wilson interval normal quantile; past about 8.3 its confidence 2 Phi(z) - 1 rounds to 1 (no interval), and
    # past about 7.5 too few of its digits are left for scipy to recover z from it
    z: float = ranged(1.96, gt=0.0, le=7.0)


@dataclass
class HardwareProfileConfig:
    prefix_len: int = ranged(256, ge=2)  # cached prefix the timed forwards attend to (>= max_depth + 2 for Sequoia)
    # untimed forwards per size; at least one, so that no first call's costs (kernel builds, compilation,
    # the allocator's growth) are timed
    warmup: int = ranged(2, ge=1)
    repeats: int = ranged(7, **POSITIVE_INT)  # timed forwards per size (median and IQR recorded)


@dataclass
class SequoiaTopologyConfig(TopologyConfig):
    """topology=sequoia: a calibrated, hardware-aware tree (harness/prepare/sequoia.py)."""

    name: str = "sequoia"
    min_nodes: int = ranged(2, **POSITIVE_INT)  # smallest n (root included) searched; 1 admits plain AR
    reuse: bool = True  # load matching artifacts from $HARNESS_CACHE/sequoia instead of re-measuring
    calibration_artifact: Optional[str] = None  # explicit calibration JSON (provenance still checked)
    profile_artifact: Optional[str] = None  # explicit hardware profile JSON (provenance still checked)
    calibration: SequoiaCalibrationConfig = field(default_factory=SequoiaCalibrationConfig)
    profile: HardwareProfileConfig = field(default_factory=HardwareProfileConfig)


@dataclass
class CartesianTopologyConfig(TopologyConfig):
    """topology=cartesian (a Cartesian future-head tree): max_nodes is derived from widths by the
    cartesian_rows resolver."""

    name: str = "cartesian"
    widths: list[int] = ranged(default_factory=lambda: [3, 2, 2], ge=1, each=True)
    max_nodes: int = ranged(21, **POSITIVE_INT)
    max_depth: int = ranged(3, **POSITIVE_INT)


@dataclass
class ChoicesTopologyConfig(TopologyConfig):
    """topology=choices: a tree given as a list of rank paths, as Medusa and EAGLE-1 publish them
    (``[[0], [0, 0], [1], ...]``: path ``[a, b]`` is the rank-``b`` child of the rank-``a`` first
    token), given on the command line or as a JSON file (harness/topology/choices.py). max_nodes and
    max_depth are derived."""

    name: str = "choices"
    choices: Optional[list[list[int]]] = ranged(None, ge=0, each=True)  # child ranks, from 0
    choices_file: Optional[str] = None  # a JSON file holding such a list
    # derived from the list (conf/topology/choices.yaml); another value is refused
    max_nodes: int = ranged(0, ge=0)
    max_depth: int = ranged(0, ge=0)  # derived: the longest path


@dataclass
class VerifierConfig:
    name: str = "greedy"


@dataclass
class WorkloadConfig:
    name: str = ranged("humaneval", choices=("humaneval", "sharegpt", "jsonl", "spec_bench"))
    path: Optional[str] = None  # workload=jsonl | spec_bench
    limit: Optional[int] = ranged(None, **POSITIVE_INT)  # the first N prompts (after categories and per_category)
    split: str = ranged("eval", choices=SPLITS)  # disjoint
    chat: bool = False  # apply the tokenizer's chat template
    # the chat template prompts go through: null, the tokenizer's own; vicuna, FastChat's Vicuna v1.1
    # format (the prompts Spec-Bench's scripts build for every model); or a Jinja file's path
    chat_template: Optional[str] = None
    categories: list[str] = field(default_factory=list)  # keep these categories (mt_bench: MT-bench's 8); []: all
    per_category: Optional[int] = ranged(
        None, **POSITIVE_INT
    )  # the first N prompts of each category (workload=spec_bench: of each Spec-Bench task)
    # a prompt turn that does not fit the models' positions with max_new_tokens and the candidate
    # tree: false refuses before model work; left cuts the prompt from the left (recorded per turn)
    truncate: str = "false"  # false | left (checked with the context limit, before model work)
    # the REST datastore of this workload's domain, for configs that follow the workload
    # (`proposer.datastore.corpus: ${workload.rest_corpus}`, as experiments/sources/ do)
    rest_corpus: str = "stdlib"  # stdlib (code) | sharegpt (chat)
    rest_exclude: str = "humaneval"  # what that datastore's build keeps out (evaluation prompts)


@dataclass
class GenerationConfig:
    max_new_tokens: int = ranged(64, **POSITIVE_INT)
    temperature: float = ranged(0.0, ge=0.0)  # 0: greedy
    top_p: float = ranged(1.0, gt=0.0, le=1.0)
    top_k: int = ranged(0, ge=0)  # 0: no top-k truncation
    batch_size: int = ranged(1, **POSITIVE_INT)
    temp_kv_budget_bytes: Optional[int] = ranged(None, **POSITIVE_INT)
    exact: bool = True  # refuse heuristic verifiers
    warmup_tokens: int = ranged(8, ge=0)  # both arms' untimed first turn; at most max_new_tokens


@dataclass
class GatesConfig:
    enabled: bool = True
    oracle: bool = True
    equivalence: bool = True
    statistical: bool = True  # chi-square first-token test at temperature > 0
    skip_statistical: bool = False  # explicit override; the record states it
    # at least 5 per bin (chi2_top_m tokens and the tail, the tail split by rank when it expects
    # enough) for the chi-square approximation to hold
    chi2_samples: int = ranged(2000, **POSITIVE_INT)
    chi2_top_m: int = ranged(8, ge=1, le=MAX_CHI2_TOP_M)  # at most the target's vocabulary, where it is known
    chi2_alpha: float = ranged(1e-3, gt=0.0, lt=1.0)  # the test's significance level
    # greedy runs fail when recorded near-ties exceed this fraction of the generated tokens
    near_tie_max_fraction: float = ranged(0.01, **PROBABILITY)
    cache: bool = True


@dataclass
class TrackingConfig:
    name: str = ranged("none", choices=("none", "wandb"))
    # offline | online (an unreachable server falls back to offline, with a warning)
    mode: str = ranged("offline", choices=("offline", "online"))
    project: str = "spec-harness"
    entity: Optional[str] = None
    system_metrics: bool = True  # W&B's system monitor: CPU, memory; GPU utilisation and memory on a GPU
    system_metrics_interval_s: float = ranged(5.0, ge=0.1)  # its sampling interval (W&B's minimum: 0.1 s)
    # how long an online run may take to start before it falls back to offline
    init_timeout_s: float = ranged(90.0, gt=0.0)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    proposer: Any = MISSING
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    gates: GatesConfig = field(default_factory=GatesConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    seed: int = ranged(0, **SEED)
    threads: Optional[int] = ranged(None, ge=1, le=MAX_THREADS)  # torch threads; None = torch's default
    experiment: Optional[str] = None
    sweep: Optional[str] = None
    concurrent_jobs: int = ranged(1, **POSITIVE_INT)
    output_dir: Optional[str] = None  # default: Hydra's run directory
    allow_leakage: bool = False  # run despite an evaluation prompt leaked into a datastore (recorded)


#: schema group -> {schema name: dataclass}; ``conf/<group>/<option>.yaml`` starts its defaults with
#: ``/schema/<group>/<name>@_here_``. Kept out of the selectable groups so that Hydra lists only
#: real options and ``proposer=<schema>`` is no option.
SCHEMAS: dict[str, dict[str, type]] = {
    "model": {"base": ModelConfig},
    "proposer": {
        "prompt_lookup": PromptLookupConfig,
        "draft_model": DraftModelConfig,
        "rest": RestConfig,
        "merged": MergedConfig,
        "heads": HeadsConfig,
        "early_exit": EarlyExitConfig,
        "layer_skip": LayerSkipConfig,
        "eagle": EagleConfig,
    },
    "datastore": {"base": DatastoreConfig},
    "topology": {
        "base": TopologyConfig,
        "sequoia": SequoiaTopologyConfig,
        "cartesian": CartesianTopologyConfig,
        "choices": ChoicesTopologyConfig,
    },
    "verifier": {"base": VerifierConfig},
    "workload": {"base": WorkloadConfig},
    "tracking": {"base": TrackingConfig},
}


def device_dtype(device: str) -> str:
    """A model's default dtype: bfloat16 on a CUDA device (tensor cores; both arms alike), float32
    elsewhere (CPU kernels without bf16 support are slower)."""
    return "bfloat16" if str(device).startswith("cuda") else "float32"


def derived_layers(draft_name: str, target_name: str, target_tiny_layers: int) -> Optional[int]:
    """A draft's default layer count: null (loaded whole) unless it is derived; a derived draft
    keeps DEFAULT_DERIVED_LAYERS of the target's layers, or all of a model=tiny target's (it has
    ``model.tiny.num_layers``)."""
    if draft_name != "derived":
        return None
    if target_name == "tiny":
        return min(DEFAULT_DERIVED_LAYERS, int(target_tiny_layers))
    return DEFAULT_DERIVED_LAYERS


def or_default(value: Any, default: Any) -> Any:
    """``value`` unless it is null or empty, else ``default`` (``${oc.select:...}`` returns a null
    value as it is: a run outside any experiment would otherwise land in ``outputs/None``)."""
    return default if value is None or value == "" else value


def when_set(value: Any, then: Any, otherwise: Any) -> Any:
    """``then`` when ``value`` is set (not null, not empty), else ``otherwise``."""
    return otherwise if value is None or value == "" else then


def same_device(value: Any, target_device: str, own_device: str, otherwise: Any) -> Any:
    """A draft's forward option: the target's ``value`` where the draft runs on the same kind of
    device (both arms' forwards alike), ``otherwise`` (the option's default) where it does not (a
    CUDA target's cuDNN switch or compilation says nothing of a CPU draft's forward)."""
    return value if str(target_device).split(":")[0] == str(own_device).split(":")[0] else otherwise


def greedy_else(temperature: Any, at_zero: Any, above: Any, top_k: Any = 0) -> Any:
    """``at_zero`` where the target keeps one token (temperature 0, or ``top_k`` = 1), ``above``
    otherwise: a draft's default child sampling, its top-ranked tokens (``beam``) where i.i.d. draws
    from a one-hot law would all be the argmax, and i.i.d. draws (SpecInfer) where the law is a
    distribution."""
    return at_zero if float(temperature) == 0.0 or int(top_k) == 1 else above


def register_configs() -> None:
    register_schemas(SCHEMAS)  # the packaged options' schemas, for the check of proposer.name and topology.name
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, schemas in SCHEMAS.items():
        for name, node in schemas.items():
            cs.store(group=f"schema/{group}", name=name, node=node)
    OmegaConf.register_new_resolver(
        "cartesian_rows", lambda widths: cartesian_rows([int(w) for w in widths]), replace=True
    )
    OmegaConf.register_new_resolver(
        "choices_size",
        lambda choices, choices_file, what: choices_size(
            OmegaConf.to_container(choices) if choices is not None and not isinstance(choices, list) else choices,
            choices_file,
            what,
        ),
        replace=True,
    )
    OmegaConf.register_new_resolver("derived_layers", derived_layers, replace=True)
    OmegaConf.register_new_resolver("or_default", or_default, replace=True)
    OmegaConf.register_new_resolver("when_set", when_set, replace=True)
    OmegaConf.register_new_resolver("device_dtype", device_dtype, replace=True)
    OmegaConf.register_new_resolver("greedy_else", greedy_else, replace=True)
    OmegaConf.register_new_resolver("same_device", same_device, replace=True)


register_configs()


def compose(overrides: list[str] = (), *, return_hydra_config: bool = False) -> DictConfig:
    """The `harness run` config composed with ``overrides`` (Hydra's compose API, no run). An
    override that sets a key below a node the config holds as null (``proposer.datastore.path=DIR``
    where ``proposer.datastore`` is null), which OmegaConf meets with a bare assertion, is refused as
    a :class:`ConfigError` naming it (:func:`null_node_refusal`)."""
    try:
        return _compose(overrides, return_hydra_config=return_hydra_config)
    except AssertionError as exc:
        refusal = null_node_refusal(list(overrides))
        if refusal is None:
            raise
        raise refusal from exc


def _compose(overrides: list[str] = (), *, return_hydra_config: bool = False) -> DictConfig:
    GlobalHydra.instance().clear()  # an in-process run or sweep leaves Hydra initialised
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=return_hydra_config)


#: null nodes a config group composes into: the group option a key below one needs first
NULL_NODE_GROUPS = {"proposer.datastore": "+datastore@proposer.datastore=stdlib"}


def null_node_refusal(overrides: list[str]) -> ConfigError | None:
    """The refusal of the first override that sets a key below a node the config composed so far
    holds as null, or None where no override does. Group selections take effect wherever they stand
    (Hydra applies them before any value), the value overrides in their order: the config each value
    override meets is the one the selections and the values before it compose. Below a null node a
    config group fills (:data:`NULL_NODE_GROUPS`: ``proposer.datastore``), the candidate fix composes
    the group's option there first and keeps the override."""
    absent = object()
    selections = [o for o in overrides if "@" in o.partition("=")[0] or config_group(o.partition("=")[0]) is not None]
    values = [o for o in overrides if o not in selections]
    for i, override in enumerate(values):
        key, eq, _ = override.lstrip("+").partition("=")
        if not eq or override.startswith("~") or "." not in key:
            continue
        try:
            cfg = _compose(selections + values[:i])
        except (AssertionError, HydraException, OmegaConfBaseException):
            return None
        parts = key.split(".")
        for depth in range(1, len(parts)):
            node = ".".join(parts[:depth])
            held = OmegaConf.select(cfg, node, default=absent, throw_on_missing=False)
            if held is absent:
                break
            if held is None:
                reason = f"{override}: {node} is null in this config, so {key} cannot be set"
                group = NULL_NODE_GROUPS.get(node)
                if group is None:
                    return ConfigError(f"{reason}; give {node} a value first")
                selection = group.partition("=")[0]
                options = ", ".join(group_options(config_group(selection)))
                return ConfigError(
                    f"{reason}; compose one there first, then set its keys: {group} {override.lstrip('+')} "
                    f"({selection} options: {options})",
                    suggestions=[(group, override.lstrip("+"))],
                )
    return None


# --------------------------------------------------------------------------- one-line composition refusals


def override_key(override: str) -> str:
    """The key an override sets: ``+generation.top_k=3`` -> ``generation.top_k``."""
    return override.lstrip("~+").split("=", 1)[0].split("@", 1)[0]


def config_loader():
    """Hydra's config loader over the search path `harness run` composes from (``conf/``, Hydra's own
    configs and its plugins'), as Hydra's sweeper has it: it lists a group's options, which a
    ``glob(...)`` sweep expands over."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path

    return ConfigLoaderImpl(config_search_path=create_config_search_path(str(CONF_DIR)))


def group_options(group: str) -> list[str]:
    """The selectable options of a config group (its YAML files, nested folders included); of one of
    Hydra's own groups (``hydra/launcher``), every option Hydra lists: its own, its installed
    plugins' and ``conf/hydra/<group>``'s."""
    if group.startswith("hydra/"):
        return sorted(config_loader().get_group_options(group))
    root = CONF_DIR / group
    return sorted(
        p.relative_to(root).with_suffix("").as_posix()
        for p in root.rglob("*.yaml")
        if not any(part.startswith("_") for part in p.relative_to(root).parts)
    )


def config_group(key: str) -> str | None:
    """The config group an override's key selects from (``verifier``, ``+datastore@proposer.datastore``
    -> ``datastore``), or None for a key that sets a value."""
    group = key.lstrip("+~").partition("@")[0]
    return group if group and "." not in group and (CONF_DIR / group).is_dir() else None


def group_list_override(overrides: list[str]) -> ConfigError | None:
    """The refusal of a config group given a bracketed list (``verifier=[greedy,membership]``), or
    None. Hydra merges every listed option into one config, the last winning where they overlap: one
    run of one verifier (or model, proposer, ...) was measured and recorded, the others dropped
    without a word."""
    for o in overrides:
        key, eq, value = o.partition("=")
        group = config_group(key) if eq else None
        if group is not None and value.strip().startswith("["):
            items = value.strip()[1:-1] if value.strip().endswith("]") else value.strip()[1:]
            return ConfigError(
                f"{o}: a run takes one {group}; to run one job for each, sweep them: harness run -m {key}={items}"
            )
    return None


def compose_checked(overrides: list[str] = ()) -> DictConfig:
    """:func:`compose`, a composition error refused as one :class:`ConfigError` line (mistyped key,
    group option or value, a key set below a null node) offering the fixes the runner accepts."""
    overrides = list(overrides)
    keyless = keyless_override(overrides) or group_list_override(overrides)
    if keyless is not None:
        raise keyless
    try:
        cfg = compose(overrides)
    except ConfigError as exc:  # an override below a null node
        raise offer(exc, overrides) from exc
    except (HydraException, OmegaConfBaseException) as exc:
        error = explain_compose_error(exc, overrides)
        rest = [o for o in overrides if o != error.replaces]
        raise offer(error, rest) from exc
    check_override_values(cfg, overrides)
    return cfg


def check_override_values(cfg: DictConfig, overrides: list[str]) -> None:
    """What composition lets through in an override's value:

    * an option set to an empty (or blank) string is refused: ``proposer.artifact=`` from an unset
      shell variable read as "no artifact" and trained heads in the cache; ``output_dir=`` wrote to a
      timestamped folder instead;
    * a boolean option given as a number must be 0 or 1: ``generation.exact=2`` is refused, not read
      as true (OmegaConf takes any other integer as true)."""
    for override in overrides:
        key, eq, value = override.lstrip("+~").partition("=")
        if not eq or key.startswith("hydra") or override.startswith("~"):
            continue
        try:
            composed = OmegaConf.select(cfg, key, throw_on_missing=False)
        except OmegaConfBaseException:
            continue
        if isinstance(composed, str) and not composed.strip():
            raise ConfigError(
                f"{key}={value} is empty; give a value, or leave the option out ({key}=null where it can be unset)"
            )
        if isinstance(composed, str) and composed.startswith("~/"):
            raise ConfigError(
                f"{key}={value}: a path starting with ~ is not expanded here (it would name a folder called ~); "
                f"give {key}=$HOME/{composed[2:]} unquoted, which the shell expands, or an absolute path"
            )
        number = value.strip()
        if (
            isinstance(composed, bool)
            and "," not in value
            and re.fullmatch(r"[+-]?\d+", number)
            and number not in ("0", "1")
        ):
            raise ConfigError(
                f"{key}={value}: expected true or false", suggestions=[(f"{key}=true",), (f"{key}=false",)]
            )


def checked_plan(overrides: list[str] = (), run_dir=None):
    """The config of ``overrides`` and its :class:`~harness.runner.Checked` (every refusal the config
    alone decides), a refusal offering the fixes the runner accepts."""
    cfg = compose_checked(overrides)
    try:
        return cfg, check_job(cfg, run_dir)
    except ConfigError as exc:
        raise offer(exc, list(overrides)) from exc


def keyless_override(overrides: list[str]) -> ConfigError | None:
    """The refusal of an override with nothing before its ``=`` (``=5``; Hydra said only "Config group
    override must be a string or a list. Got int"), or None."""
    bad = next((o for o in overrides if "=" in o and not o.lstrip("+~").split("=", 1)[0].strip()), None)
    if bad is not None:
        return ConfigError(f"{bad}: no key before '='; an override is key=value (e.g. seed=5)")
    bare = next((o for o in overrides if "=" not in o and not o.startswith(("-", "~"))), None)
    if bare is not None:  # Hydra said "missing EQUAL at '<EOF>'"
        return ConfigError(f"{bare}: no '='; an override is key=value (e.g. seed=5)")
    removed = next((o for o in overrides if o.startswith("~") and not o.lstrip("~").startswith("hydra")), None)
    if removed is not None:  # a schema option removed composes, then fails wherever it is read
        key = removed.lstrip("~").split("=", 1)[0]
        return ConfigError(
            f"{removed}: options cannot be removed; leave {key} out for its default, or set it ({key}=null "
            "where it can be unset)"
        )
    return None


def explain_compose_error(exc: Exception, overrides: list[str]) -> ConfigError:
    """One line for a Hydra/OmegaConf composition error, a close spelling of the mistyped key or
    option as its candidate fix."""
    keyless = keyless_override(overrides)
    if keyless is not None:
        return keyless
    text = str(exc)
    cause = exc.__cause__
    listed = group_list_override(overrides)
    if listed is not None:
        return listed
    ambiguous = re.match(r"Ambiguous value for argument '([^=']+)=([^']*)'", text)
    if ambiguous:  # a,b on a plain run: a sweep's axis, or a list missing its brackets
        key, value = ambiguous.groups()
        group = config_group(key)
        sweep = f"to run one job for each, sweep them: harness run -m {key}={value}"
        if group is not None:
            return ConfigError(f"{key}={value}: a run takes one {group}; {sweep}")
        try:
            default = OmegaConf.select(compose([]), key.lstrip("+"), throw_on_missing=False)
        except (HydraException, OmegaConfBaseException):
            default = None
        if isinstance(default, ListConfig):
            return ConfigError(f"{key}={value}: a list is written {key}=[{value}]; or, {sweep}")
        return ConfigError(f"{key}={value}: a run takes one value of {key.lstrip('+')}; {sweep}")
    missing = re.match(r"In '[^']*': Could not find '((?:hydra/)?[^'/]+)/([^']*)'", text)
    if missing and not missing.group(2):  # `verifier=`: a group given no option
        group = missing.group(1)
        return ConfigError(f"{group}= is empty; give one of {', '.join(group_options(group))}")
    if missing:
        group, option = missing.groups()
        options = group_options(group)
        close = difflib.get_close_matches(option, options, n=1, cutoff=0.6)
        return ConfigError(
            f"{group}={option} is no option of {group}; the options: {', '.join(options)}",
            suggestions=[(f"{group}={close[0]}",)] if close else [],
        )
    multiple = re.match(r"Multiple values for (\S+)\. To override a value use 'override ", text) or re.match(
        r"(\S+) appears more than once in the final defaults list", text
    )
    if multiple:  # a config group given twice, or added with '+' where the defaults list already selects it
        group = multiple.group(1)
        given = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] == group]
        if len(given) > 1:
            return ConfigError(f"{group} is given more than once ({' '.join(given)}): give it once")
        if given and given[0].startswith("+") and not given[0].startswith("++"):
            return ConfigError(
                f"{group} is already in the config: set it without the leading '+' ({given[0].lstrip('+')})"
            )
    appended = re.match(r"Could not append to config\. An item is already at '([^']+)'", text)
    if appended:
        key = appended.group(1)
        given = next((o for o in overrides if override_key(o) == key), key)
        return ConfigError(f"{key} is already in the config: set it without the leading '+' ({given.lstrip('+')})")
    unknown = re.match(r"Could not override '([^']+)'", text)
    if unknown:
        key = unknown.group(1)
        parent, _, leaf = key.rpartition(".")
        given = next((o for o in overrides if override_key(o) == key), f"{key}=...")
        value = given.split("=", 1)[1] if "=" in given else ""
        known = _keys_at(parent, [o for o in overrides if override_key(o) != key])
        where = f"{parent} has" if parent else "the config has"
        if key == "sweep":  # set by `harness sweep` from the sweep file, not an override
            return ConfigError(
                f"sweep={value}: the sweep name comes from a sweep file; run `harness sweep NAME|PATH.yaml` "
                "(`harness run -m` writes to multirun/adhoc unless hydra.sweep.dir is given)"
            )
        if known is None:
            return ConfigError(f"{key}: {_first_line(cause) if cause else 'no such option'}")
        close = difflib.get_close_matches(leaf, known, n=1, cutoff=0.6)
        fixed = f"{parent}.{close[0]}" if parent and close else (close[0] if close else None)
        return ConfigError(
            f"{where} no option {leaf!r} ({given.lstrip('+')})",
            suggestions=[(f"{fixed}={value}",)] if fixed else [],
            replaces=given,
        )
    merging = re.match(r"Error merging override (\S+?)=(.*)$", text.strip().splitlines()[0] if text.strip() else "")
    if merging and cause is not None:
        key, value = merging.groups()
        why = _first_line(cause)
        if "is not Optional" in why:  # null for an option that takes a value
            parent = getattr(cause, "ref_type", None)
            fields = {f.name: f.type for f in dataclasses.fields(parent)} if dataclasses.is_dataclass(parent) else {}
            kind = str(getattr(fields.get(key.rpartition(".")[2]), "__name__", fields.get(key.rpartition(".")[2])))
            expected = {"int": "a whole number", "float": "a number", "bool": "true or false", "str": "a string"}
            return ConfigError(f"{key}={value}: {key} cannot be null; expected {expected.get(kind, 'a value')}")
        if "is not a ListConfig" in why:
            return ConfigError(f"{key}={value}: {key} takes a list", suggestions=[(f"{key}=[{value}]",)])
        kind = re.search(r"could not be converted to (\w+)", why)
        if kind:
            expected = {"Integer": "a whole number", "Float": "a number", "Boolean": "true or false"}
            return ConfigError(f"{key}={value}: expected {expected.get(kind.group(1), kind.group(1).lower())}")
        if "is not a valid bool" in why:
            return ConfigError(f"{key}={value}: expected true or false")
        element = re.search(r"(\w+) is not a subclass of (\w+)", why)
        if element:
            return ConfigError(f"{key}={value}: each element must be a {element.group(2)}; got {element.group(1)}")
    if type(exc).__name__ == "OverrideParseException":
        return _unparsable_override(overrides) or ConfigError(one_line(text.split("\nSee https://")[0]))
    lines = [text] + ([str(cause)] if cause is not None else [])
    return ConfigError(one_line("; ".join(lines)))


#: Hydra's message for an override its lexer stops in: the override, then a caret under the character
_LEXER_STOP = "LexerNoViableAltException: "


def _unparsable_override(overrides: list[str]) -> ConfigError | None:
    """The first override Hydra's grammar cannot read, named with the character it stops at and
    the quoting that passes the value through (None when each parses alone)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for given in overrides:
        if given.startswith("-") or "=" not in given.lstrip("~"):
            continue  # a flag (-m, --cfg) or a flag's value (job, a config dir): no override
        try:
            parser.parse_overrides([given])
        except OverrideParseException as exc:
            lines = str(exc).splitlines()
            where = ""
            if lines and lines[0].startswith(_LEXER_STOP) and len(lines) > 1 and "^" in lines[1]:
                column = lines[1].index("^") - len(_LEXER_STOP)
                if 0 <= column < len(given):
                    where = f" at {given[column]!r} (character {column + 1})"
            why = "" if where else f" ({lines[0] if lines else 'unreadable'})"
            key, sep, value = given.partition("=")
            # a sweep's values (a,b) are quoted one by one, so the sweep stays a sweep; a list is no string
            quoted = None
            if sep and value.startswith("~/"):  # quoted it stays a literal ~ (a folder named ~)
                return ConfigError(
                    f"{given}: Hydra's override grammar cannot read it{where}{why}; a path starting with ~ is "
                    f"not expanded here: give {key}=$HOME/{value[2:]} unquoted, which the shell expands, or an "
                    "absolute path"
                )
            if sep and '"' not in value and not value.startswith("["):
                inner = key + "=" + ",".join(f'"{v}"' for v in value.split(","))
                quoted = f"'{inner}'" if "'" not in value else '"' + inner.replace('"', '\\"') + '"'

            hint = f"; quote a value holding characters such as # = ' [ ] or spaces: {quoted}" if quoted else ""
            return ConfigError(f"{given}: Hydra's override grammar cannot read it{where}{why}{hint}")
    return None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _keys_at(parent: str, overrides: list[str]) -> list[str] | None:
    """The keys of the node at ``parent`` in the config the other overrides compose (None: no such node)."""
    try:
        cfg = compose(overrides)
    except (HydraException, OmegaConfBaseException):
        cfg = compose([])
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else None


def apply_overrides(overrides: list[str], fix: tuple[str, ...]) -> list[str]:
    """``overrides`` with ``fix`` applied: an override of the same key replaced, a new key appended."""
    out = list(overrides)
    for new in fix:
        keys = [i for i, o in enumerate(out) if override_key(o) == override_key(new)]
        if keys:
            out[keys[0]] = new
            out = [o for i, o in enumerate(out) if i not in keys[1:]]
        else:
            out.append(new)
    return out


#: composes (and plans) spent at most on checking the suggestions of one refusal
OFFER_BUDGET = 8
#: suggestions offered at most
OFFER_MAX = 3


def offer(exc: ConfigError, overrides: list[str], *, accept: Callable[[DictConfig], Any] = plan) -> ConfigError:
    """``exc`` offering those of its candidate fixes that the runner accepts (composed and planned:
    every value and combination check, no model, no file read or written; ``accept`` adds a
    command's own checks), a candidate that meets another refusal extended by that refusal's
    candidates (breadth first, at most three overrides, :data:`OFFER_BUDGET` tries). Where ``exc``
    ``replaces`` a mistyped override, its candidates carry the value the user gave under the key
    meant: every fix keeps that correction (``overrides`` no longer hold the mistyped one, so a fix
    without it would run the default instead)."""
    frontier = list(exc.suggestions)
    pinned = {o for fix in exc.suggestions for o in fix} if exc.replaces else set()
    accepted: list[tuple[str, ...]] = []
    seen: set[frozenset[str]] = set()
    tries = 0
    while frontier and tries < OFFER_BUDGET and len(accepted) < OFFER_MAX:
        fix = frontier.pop(0)
        if frozenset(fix) in seen:  # the same overrides in another order are the same fix
            continue
        seen.add(frozenset(fix))
        tries += 1
        try:
            accept(compose(apply_overrides(overrides, fix)))
        except ConfigError as again:
            if len(fix) < 3:
                frontier += [m for m in (_merge(fix, more) for more in again.suggestions) if not _undoes_itself(m)]
            continue
        except (ValueError, OSError, HydraException, OmegaConfBaseException):  # refused otherwise: not offered
            continue
        fix = _minimal(fix, overrides, accept, keep=pinned)
        if all(set(fix) != set(other) for other in accepted):
            accepted.append(fix)
    return type(exc)(exc.reason, suggestions=accepted, offered=True, replaces=exc.replaces)


def _minimal(
    fix: tuple[str, ...], overrides: list[str], accept: Callable[[DictConfig], Any], *, keep: Collection[str] = ()
) -> tuple[str, ...]:
    """``fix`` without the overrides it is accepted without (a chained fix may carry a first step the
    second made unneeded: ``topology.max_nodes=21 topology=sequence`` where ``topology=sequence`` does),
    those in ``keep`` (the correction of a mistyped key) always kept."""
    for o in list(fix):
        if len(fix) == 1:
            break
        if o in keep:
            continue
        rest = tuple(x for x in fix if x != o)
        try:
            accept(compose(apply_overrides(overrides, rest)))
        except (ValueError, OSError, HydraException, OmegaConfBaseException):
            continue
        fix = rest
    return fix


def _undoes_itself(fix: tuple[str, ...]) -> bool:
    """Whether ``fix`` sets to null a node one of its own overrides composes a group option into
    (``+datastore@proposer.datastore=stdlib proposer.datastore=null``): no fix of anything."""
    composed = {o.partition("=")[0].partition("@")[2] for o in fix if "@" in o.partition("=")[0]}
    return any(override_key(o) in composed and o.partition("=")[2].strip() == "null" for o in fix)


def _merge(fix: tuple[str, ...], more: tuple[str, ...]) -> tuple[str, ...]:
    keys = {override_key(o) for o in more}
    return tuple(o for o in fix if override_key(o) not in keys) + tuple(more)
