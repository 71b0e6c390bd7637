"""Structured-config schemas backing every config group.

Each YAML under ``conf/<group>/`` lists its schema (``base_<group>`` or a proposer-specific
schema) first in its defaults, so a mistyped key or a wrong type fails at compose time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import MISSING, DictConfig, OmegaConf

from harness.topology.budgets import cartesian_rows

#: the config groups (schema-backed YAML) that `harness run` composes
CONF_DIR = Path(__file__).resolve().parent / "conf"


@dataclass
class ModelConfig:
    name: str = "smollm2"  # smollm2 | tiny | any HF checkpoint path or hub id (see name_or_path)
    name_or_path: Optional[str] = None
    dtype: str = "float32"
    device: str = "cpu"
    attn_implementation: str = "sdpa"
    num_layers: Optional[int] = None  # keep only the first k decoder layers (draft derivation)
    seed: int = 0  # weights seed for model=tiny
    trust_remote_code: bool = False  # explicit opt-in: runs code from the checkpoint
    tiny: dict[str, Any] = field(default_factory=dict)  # LlamaConfig overrides for model=tiny


@dataclass
class ProposerConfig:
    name: str = MISSING


@dataclass
class PromptLookupConfig(ProposerConfig):
    name: str = "prompt_lookup"
    max_ngram: int = 3
    min_ngram: int = 1
    max_matches: int = 8
    budget_policy: str = "fixed"  # fixed | adaptive (rows chosen from measured t(n) and learned acceptance)
    verify_cost: Optional[list[float]] = None  # normalised t(1..max_nodes+1); measured when absent


@dataclass
class DraftModelConfig(ProposerConfig):
    name: str = "draft_model"
    sampling: str = "iid"  # iid | without_replacement | beam
    model: ModelConfig = field(default_factory=ModelConfig)
    description: str = ""


@dataclass
class DatastoreConfig:
    """A REST datastore (conf/datastore/*.yaml, composed at ``proposer.datastore``)."""

    corpus: str = "stdlib"  # stdlib | sharegpt (harness/workloads/corpora.py)
    path: Optional[str] = None  # a datastore directory (its release manifest rules); null: cache, built on first use
    max_tokens: Optional[int] = 2_000_000  # build cap (sentinels included)
    context_len: int = 16
    continuation_len: int = 8
    max_matches: int = 64
    exclude: str = "humaneval"  # humaneval | sharegpt_heldout | none | F.jsonl (comma-separated)
    leakage_threshold: int = 32  # run-time refusal at a longest match >= this many tokens
    verify_corpus: bool = True  # recompute the corpus snapshot on load


@dataclass
class RestConfig(ProposerConfig):
    name: str = "rest"
    datastore: DatastoreConfig = field(default_factory=DatastoreConfig)
    max_suffix: int = 16
    min_suffix: int = 2
    max_matches: int = 64
    continuation_len: int = 8


@dataclass
class MergedConfig(ProposerConfig):
    """proposer=merged: several sources merged by full prefix into one tree per round."""

    name: str = "merged"
    sources: list[str] = field(default_factory=lambda: ["rest", "prompt_lookup"])
    # per-source depth cap (a draft chain costs one draft forward per level); absent: topology.max_depth
    depths: dict[str, int] = field(default_factory=lambda: {"draft_model": 4})
    rest: RestConfig = field(default_factory=RestConfig)
    prompt_lookup: PromptLookupConfig = field(default_factory=PromptLookupConfig)
    draft_model: DraftModelConfig = field(default_factory=DraftModelConfig)


@dataclass
class HeadsDataConfig:
    """Training stream of a heads artifact (harness/prepare/heads_data.py)."""

    source: str = "sharegpt"
    split: str = "train"
    # tokens of cached target hidden states; CPU budget: SmolLM2 heads train at ~11 s per 1,000
    # tokens on 2 cores (hidden states + one epoch), so 40,000 is ~7.5 min (docs/measurements.md)
    token_budget: int = 40000
    held_out_split: str = "dev"
    held_out_tokens: int = 2000
    max_len: int = 256
    chat: bool = True


@dataclass
class HeadsTrainConfig:
    epochs: int = 1
    lr: float = 1e-3
    batch_size: int = 32
    weight_decay: float = 0.0
    distill_temperature: float = 1.0
    head_decay: float = 0.8  # lambda_i = head_decay ** (i - 1)
    warmup_steps: int = 10
    seed: int = 0


@dataclass
class HeadsConfig(ProposerConfig):
    """proposer=medusa | hydra | clover (harness/proposers/heads.py)."""

    name: str = MISSING
    sampling: str = "beam"  # beam (score_only) | iid | without_replacement (normalized_conditional)
    num_heads: int = 3
    mlp_layers: int = 1  # Hydra++ switch: 4
    distill: bool = False  # Hydra++ switch: teacher-distribution loss instead of hard labels
    prefix_attention: bool = False  # Hydra++ switch: prefix-attention layer once per round
    prefix_window: int = 16
    attn_heads: int = 4
    artifact: Optional[str] = None  # explicit artifact directory; default: the cache, by target + recipe
    auto_train: bool = True  # train the artifact when absent (progress bar)
    data: HeadsDataConfig = field(default_factory=HeadsDataConfig)
    train: HeadsTrainConfig = field(default_factory=HeadsTrainConfig)


@dataclass
class EagleTrainConfig:
    """EAGLE's objective on cached target features (harness/prepare/eagle.py)."""

    epochs: int = 1
    lr: float = 1e-3
    batch_size: int = 2  # documents per step (each up to data.max_len pairs)
    weight_decay: float = 0.0
    warmup_steps: int = 10
    feature_weight: float = 1.0  # SmoothL1 on the predicted feature (EAGLE's v_w)
    token_weight: float = 0.1  # cross-entropy to the target's distribution (EAGLE's p_w)
    feature_noise: float = 0.0  # U(-a, a) on input features while training
    eval_depths: int = 5  # held-out top-1 agreement at depths 1..eval_depths
    seed: int = 0


@dataclass
class EagleConfig(ProposerConfig):
    """proposer=eagle (harness/proposers/eagle.py): an EAGLE draft trained here, or a published
    EAGLE / EAGLE-2 / EAGLE-3 checkpoint (proposer.artifact=PATH_OR_HUB_ID)."""

    name: str = "eagle"
    sampling: str = "beam"  # beam (score_only) | iid | without_replacement (normalized_conditional)
    num_layers: int = 1  # decoder layers of a draft trained here (EAGLE: 1)
    intermediate_size: Optional[int] = None  # MLP width of a draft trained here; None: the target's
    fc_bias: bool = True  # the fusion layer's bias (EAGLE's default)
    artifact: Optional[str] = None  # a trained artifact's directory, or a published checkpoint (path or hub id)
    auto_train: bool = True  # train the artifact when absent (progress bar)
    data: HeadsDataConfig = field(default_factory=HeadsDataConfig)
    train: EagleTrainConfig = field(default_factory=EagleTrainConfig)


@dataclass
class AdapterTrainConfig:
    epochs: int = 1
    lr: float = 1e-3
    distill_temperature: float = 1.0  # tau of Kangaroo's adapter distillation loss (soft-target CE)
    seed: int = 0


@dataclass
class EarlyExitConfig(ProposerConfig):
    """proposer=early_exit (Kangaroo, harness/proposers/selfspec.py)."""

    name: str = "early_exit"
    sampling: str = "beam"  # beam (score_only) | iid (normalized_conditional)
    exit_layer: int = 2  # l: the shared shallow trunk is the target's first l layers
    eta: float = 0.5  # stop drafting when the top-1 confidence is <= eta
    artifact: Optional[str] = None
    auto_train: bool = True
    data: HeadsDataConfig = field(default_factory=HeadsDataConfig)
    train: AdapterTrainConfig = field(default_factory=AdapterTrainConfig)


@dataclass
class SkipThresholdConfig:
    """Draft & Verify's dynamic draft length: stop below gamma; gamma follows an acceptance EMA."""

    gamma: float = 0.4
    adaptive: bool = True
    beta1: float = 0.5
    beta2: float = 0.9
    epsilon: float = 0.05
    target_acceptance: float = 0.7


@dataclass
class SkipSearchConfig:
    """Bayesian optimisation (Optuna TPE) of the skip vector on the dev split."""

    trials: int = 12  # CPU budget: about 10 minutes on SmolLM2 with 2 busy cores
    workload: str = "sharegpt"
    split: str = "dev"
    prompts: int = 3
    max_prompt_tokens: int = 96
    max_new_tokens: int = 32
    depth: int = 4
    gamma: float = 0.4
    chat: bool = True
    seed: int = 0


@dataclass
class LayerSkipConfig(ProposerConfig):
    """proposer=layer_skip (Draft & Verify, harness/proposers/selfspec.py)."""

    name: str = "layer_skip"
    sampling: str = "beam"  # beam | iid
    skip: Optional[list[int]] = None  # explicit layers to bypass; None: the search artifact
    artifact: Optional[str] = None
    auto_train: bool = True  # run the search when its artifact is absent
    threshold: SkipThresholdConfig = field(default_factory=SkipThresholdConfig)
    search: SkipSearchConfig = field(default_factory=SkipSearchConfig)


@dataclass
class TopologyConfig:
    name: str = "sequence"  # sequence | sequences | set | expansion | sequoia | merged | cartesian | dynamic
    max_nodes: int = 8  # candidate rows, root excluded
    max_depth: int = 8
    widths: list[int] = field(default_factory=list)
    topk: int = 0  # topology=dynamic: children per expanded node and expanded nodes per depth
    sources: list[str] = field(default_factory=list)
    tree_artifact: Optional[str] = None


@dataclass
class SequoiaCalibrationConfig:
    parents: int = 500  # parent nodes measured; fewer (prompts ran out) fails the stage
    branches: int = 8  # sibling slots tried per parent: the acceptance vector's length
    max_new_tokens: int = 64  # committed tokens per calibration prompt
    prompts: Optional[int] = None  # limit on calibration-split prompts (None: as many as needed)
    z: float = 1.96  # Wilson interval normal quantile


@dataclass
class HardwareProfileConfig:
    prefix_len: int = 256  # cached prefix the timed forwards attend to
    warmup: int = 2  # untimed forwards per size
    repeats: int = 7  # timed forwards per size (median and IQR recorded)


@dataclass
class SequoiaTopologyConfig(TopologyConfig):
    """topology=sequoia: a calibrated, hardware-aware tree (harness/prepare/sequoia.py)."""

    name: str = "sequoia"
    min_nodes: int = 2  # smallest n (root included) searched; 1 admits plain AR
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
    widths: list[int] = field(default_factory=lambda: [3, 2, 2])
    max_nodes: int = 21
    max_depth: int = 3


@dataclass
class VerifierConfig:
    name: str = "greedy"


@dataclass
class WorkloadConfig:
    name: str = "humaneval"  # humaneval | sharegpt | jsonl
    path: Optional[str] = None  # workload=jsonl
    limit: Optional[int] = None
    split: str = "eval"  # calibration | dev | train | eval (disjoint)
    chat: bool = False  # apply the tokenizer's chat template
    # the REST datastore of this workload's domain, for configs that follow the workload
    # (`proposer.datastore.corpus: ${workload.rest_corpus}`, as experiments/sources/ do)
    rest_corpus: str = "stdlib"  # stdlib (code) | sharegpt (chat)
    rest_exclude: str = "humaneval"  # what that datastore's build keeps out (evaluation prompts)


@dataclass
class GenerationConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    batch_size: int = 1
    temp_kv_budget_bytes: Optional[int] = None
    exact: bool = True  # refuse heuristic verifiers
    warmup_tokens: int = 8


@dataclass
class GatesConfig:
    enabled: bool = True
    oracle: bool = True
    equivalence: bool = True
    statistical: bool = True  # chi-square first-token test at temperature > 0
    skip_statistical: bool = False  # explicit override; the record states it
    chi2_samples: int = 2000
    chi2_top_m: int = 8
    chi2_alpha: float = 1e-3
    # greedy runs fail when recorded near-ties exceed this fraction of the generated tokens
    near_tie_max_fraction: float = 0.01
    cache: bool = True


@dataclass
class TrackingConfig:
    name: str = "none"  # none | wandb
    mode: str = "offline"  # offline | online
    project: str = "spec-harness"
    entity: Optional[str] = None


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
    seed: int = 0
    threads: Optional[int] = None  # torch threads; None = torch's default
    experiment: Optional[str] = None
    sweep: Optional[str] = None
    concurrent_jobs: int = 1
    output_dir: Optional[str] = None  # default: Hydra's run directory
    allow_leakage: bool = False  # run despite an evaluation prompt leaked into a datastore (recorded)


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="model", name="base_model", node=ModelConfig)
    cs.store(group="proposer", name="base_prompt_lookup", node=PromptLookupConfig)
    cs.store(group="proposer", name="base_draft_model", node=DraftModelConfig)
    cs.store(group="proposer", name="base_rest", node=RestConfig)
    cs.store(group="proposer", name="base_merged", node=MergedConfig)
    cs.store(group="datastore", name="base_datastore", node=DatastoreConfig)
    cs.store(group="topology", name="base_topology", node=TopologyConfig)
    cs.store(group="topology", name="base_sequoia", node=SequoiaTopologyConfig)
    cs.store(group="proposer", name="base_heads", node=HeadsConfig)
    cs.store(group="proposer", name="base_early_exit", node=EarlyExitConfig)
    cs.store(group="proposer", name="base_eagle", node=EagleConfig)
    cs.store(group="proposer", name="base_layer_skip", node=LayerSkipConfig)
    cs.store(group="topology", name="base_cartesian", node=CartesianTopologyConfig)

    OmegaConf.register_new_resolver(
        "cartesian_rows", lambda widths: cartesian_rows([int(w) for w in widths]), replace=True
    )
    cs.store(group="verifier", name="base_verifier", node=VerifierConfig)
    cs.store(group="workload", name="base_workload", node=WorkloadConfig)
    cs.store(group="tracking", name="base_tracking", node=TrackingConfig)


register_configs()


def compose(overrides: list[str] = (), *, return_hydra_config: bool = False) -> DictConfig:
    """The `harness run` config composed with ``overrides`` (Hydra's compose API, no run)."""

    GlobalHydra.instance().clear()  # an in-process run or sweep leaves Hydra initialised
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=return_hydra_config)
