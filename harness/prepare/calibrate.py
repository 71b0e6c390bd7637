"""Sequoia calibration: positional acceptance measured with the run's own code, kept as a versioned
artifact (acceptance statistics depend on model pair, sampler, workload and hardware).

On prompts of the workload's ``calibration`` split (checked disjoint from the evaluation prompts),
the configured proposer drafts ``B = topology.calibration.branches`` children below each parent
node (a ``set`` budget, the configured sampling relation: without replacement for Sequoia, or
i.i.d.), the target verifies them in one forward and the configured verifier selects, exactly as
in a run (:func:`harness.engine.decode.decode`). Each round is one reached parent node; the
verifier's choice gives the *rank* of the accepted sibling (1..B, the draw order), or 0 when none
is accepted and the residual supplies the token. The path then continues with the committed
tokens, so parents are visited along target-distributed paths.

From the ranks: ``tested_j`` = parents whose siblings ``1..j-1`` were all rejected,
``accepted_j`` = parents that accepted rank ``j``; the conditional sibling rates
``h_j = accepted_j / tested_j`` and the selected-child probabilities
``p_j = h_j prod_{i<j} (1 - h_i) = accepted_j / parents``, each with a Wilson interval.
``p`` is validated (finite, in [0, 1], sibling mass <= 1) before it is stored.

Under i.i.d. sampling a token drawn twice is one row; only its first draw can be accepted (after
its rejection the residual has no mass on it), so the rank is the first draw's position.

`harness calibrate [overrides]` composes the same config as `harness run`, writes the
calibration (measured again) and tree artifacts for it, with the hardware profile (reused where
one matches, unless ``topology.reuse=false``), and prints their paths.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from collections.abc import Sequence

from omegaconf import OmegaConf
from tqdm import tqdm

from harness.contracts import Budget
from harness.engine.build import proposer_options, sampling_policy
from harness.engine.decode import RoundConfig, decode
from harness.gates.keys import code_hash
from harness.gates.status import GateError
from harness.measure.hardware import library_versions
from harness.prepare.profile import StaleArtifactError, check_provenance, checkpoints
from harness.proposers.registry import proposer_class
from harness.random_source import TorchRandomSource
from harness.target.loading import eos_ids, tokenizer_fingerprint
from harness.topology.sequoia import (
    selected_child_probabilities,
    validate_selected_child_probabilities,
    wilson_interval,
)
from harness.verifiers import get_verifier
from harness.workloads.conversations import encode_workload

CALIBRATION_FORMAT = 2
#: how parent nodes are counted (in the provenance and the cache key: a calibration counted by an
#: earlier rule is measured again): only rounds that drafted the full set of siblings below the
#: frontier are parent nodes (a prompt's last round, with one token left, drafts none)
CALIBRATION_METHOD = "parents: rounds with the full sibling set"

#: provenance fields that must equal the run's for a calibration to be used
CALIBRATION_MATCH_FIELDS = (
    "target",
    "proposer",
    "checkpoints",
    "code",
    "tokenizer",
    "sampling_policy",
    "verifier",
    "method",
    "calibration_data",
    "settings",
    "library_versions",
    "seed",
)


class CalibrationError(GateError):
    """The calibration stage failed (too few parent nodes, overlap with evaluation prompts, ...)."""


# ---------------------------------------------------------------- statistics (pure)


def accepted_rank(tree, selection) -> int:
    """Rank (1-based draw position below the frontier) of the accepted first-level child, 0 if none."""
    if not selection.accepted_rows:
        return 0
    row = selection.accepted_rows[0]
    for i, draw in enumerate(tree.draws[0]):
        if draw.row == row:
            return i + 1
    raise AssertionError(f"accepted row {row} is not a child of the frontier")


def acceptance_statistics(ranks: Sequence[int], *, branches: int, z: float = 1.96) -> dict:
    """Conditional sibling rates h_j and selected-child probabilities p_j from accepted ranks.

    ``ranks[i]`` is the rank accepted at parent ``i`` (``0``: none of the ``branches`` siblings).
    Returns counts, ``h``, ``acceptance`` (= p), their Wilson intervals at quantile ``z``, the
    sibling mass and the number of parents. ``p`` is validated before it is returned.
    """

    if isinstance(branches, bool) or not isinstance(branches, int) or branches < 1:
        raise ValueError(f"branches must be an integer >= 1; got {branches!r}")
    ranks = [int(r) for r in ranks]
    if not ranks:
        raise ValueError("no parent nodes measured")
    bad = [r for r in ranks if not 0 <= r <= branches]
    if bad:
        raise ValueError(f"ranks must be in [0, {branches}]; got {bad[:5]}")
    parents = len(ranks)
    accepted = [sum(1 for r in ranks if r == j) for j in range(1, branches + 1)]  # [B]
    tested = [parents - sum(accepted[:j]) for j in range(branches)]  # [B]
    h = [accepted[j] / tested[j] if tested[j] else 0.0 for j in range(branches)]
    p = validate_selected_child_probabilities(selected_child_probabilities(h))
    direct = [a / parents for a in accepted]
    for j, (a, b) in enumerate(zip(p, direct)):
        if abs(a - b) > 1e-9:
            raise AssertionError(f"p_{j + 1} from h ({a}) != accepted/parents ({b})")
    h_ci = [list(wilson_interval(accepted[j], tested[j], z)) if tested[j] else None for j in range(branches)]
    p_ci = [list(wilson_interval(accepted[j], parents, z)) for j in range(branches)]
    for name, vec in (("h", h), ("acceptance", p)):
        if not all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in vec):
            raise ValueError(f"{name} must be finite and in [0, 1]; got {vec}")
    return {
        "parents": parents,
        "branches": branches,
        "accepted": accepted,
        "tested": tested,
        "none_accepted": parents - sum(accepted),
        "h": h,
        "h_wilson": h_ci,
        "acceptance": p,
        "acceptance_wilson": p_ci,
        "sibling_mass": math.fsum(p),
        "wilson_z": z,
    }


# ---------------------------------------------------------------- calibration prompts


def calibration_config(cfg):
    """``cfg`` with the workload switched to its calibration split (limit: calibration.prompts)."""

    c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    c.workload.split = "calibration"
    c.workload.limit = cfg.topology.calibration.prompts
    return c


def calibration_items(cfg, tokenizer) -> list:
    """[(Prompt, ids)] of the calibration split of the configured workload."""

    if cfg.workload.split == "calibration":
        raise CalibrationError(
            "workload.split=calibration: the evaluation prompts would be the calibration "
            "prompts; evaluate on eval or dev"
        )
    return encode_workload(calibration_config(cfg), tokenizer)


def check_disjoint(calibration: list, evaluation: list) -> None:
    """Refuse calibration prompts that are also evaluation prompts (same id or same token ids)."""
    eval_ids = {p.prompt_id for p, _ in evaluation}
    eval_tokens = {tuple(ids) for _, ids in evaluation}
    for p, ids in calibration:
        if p.prompt_id in eval_ids or tuple(ids) in eval_tokens:
            raise CalibrationError(
                f"calibration prompt {p.prompt_id!r} is also an evaluation prompt: the calibration split must be "
                f'disjoint from the evaluated one (a jsonl workload needs a "split" field per line)'
            )


def data_hash(items: list) -> str:
    h = hashlib.sha256()
    for p, ids in items:
        h.update(json.dumps([p.prompt_id, list(ids)]).encode())
    return h.hexdigest()[:16]


#: the code a calibration's acceptance depends on: the round (the verify forward, the verifier), this
#: module's counting, and the configured proposer's module (added by :func:`calibration_provenance`)
CALIBRATION_CODE = (("harness.engine.decode", "harness.verifiers"), ("harness.prepare.calibrate",))

#: the provenance fields the config alone decides (checked before any model work)
CONFIG_MATCH_FIELDS = ("target", "proposer", "sampling_policy", "verifier", "settings", "seed")


def config_provenance(cfg) -> dict:
    """The fields of :func:`calibration_provenance` the config alone gives (:data:`CONFIG_MATCH_FIELDS`)."""
    c = OmegaConf.to_container(cfg, resolve=True)
    cal = c["topology"]["calibration"]
    return {
        "target": {k: v for k, v in c["model"].items() if k not in ("device", "attn_implementation")},
        "proposer": c["proposer"],
        "sampling_policy": {
            **{k: c["generation"][k] for k in ("temperature", "top_p", "top_k")},
            "relation": c["proposer"].get("sampling", "iid"),
        },
        "verifier": c["verifier"]["name"],
        "settings": {
            "parents": int(cal["parents"]),
            "branches": int(cal["branches"]),
            "max_new_tokens": int(cal["max_new_tokens"]),
            "wilson_z": float(cal["z"]),
        },
        # the calibration rounds draw from generators seeded by it (:func:`measure_ranks`): each seed
        # measures its own acceptance vector, so a seed sweep sees the spread the calibration adds
        "seed": int(c["seed"]),
    }


def calibration_provenance(cfg, *, tokenizer, items: list) -> dict:
    """The provenance a calibration must carry to be used by a run of ``cfg``."""

    c = OmegaConf.to_container(cfg, resolve=True)
    if tokenizer is None:
        tok = "none (model=tiny: synthetic ids from prompt bytes)"
    else:
        tok = tokenizer_fingerprint(tokenizer)
    known = config_provenance(cfg)
    draft = c["proposer"].get("model") if isinstance(c["proposer"].get("model"), dict) else None
    entries, own = CALIBRATION_CODE
    return {
        "target": known["target"],
        "proposer": known["proposer"],
        "checkpoints": checkpoints(c["model"], draft),
        "code": code_hash([*entries, proposer_class(c["proposer"]["name"]).__module__], own=own)[:16],
        "tokenizer": tok,
        "sampling_policy": known["sampling_policy"],
        "verifier": known["verifier"],
        "method": CALIBRATION_METHOD,
        "calibration_data": {
            "workload": c["workload"]["name"],
            "path": c["workload"].get("path"),
            "split": "calibration",
            "chat": c["workload"].get("chat"),
            "prompts": len(items),
            "hash": data_hash(items),
        },
        "settings": known["settings"],
        "library_versions": library_versions(),
        "seed": known["seed"],
    }


# ---------------------------------------------------------------- the stage


def _eos_ids(context) -> frozenset[int]:

    return eos_ids(context.target_backend.model, context.tokenizer)


def measure_ranks(cfg, context, *, items: list, progress: bool = True) -> tuple[list[int], int]:
    """Run the calibration rounds; return (accepted rank per parent node, prompts used). A round
    counts as a parent node only when its proposal drafted the full set of ``branches`` siblings
    below the frontier: a prompt's last round (one token left) drafts none, and counting it would
    read as every sibling rejected."""

    cal = cfg.topology.calibration
    need, branches = int(cal.parents), int(cal.branches)
    if need < 1 or branches < 1 or int(cal.max_new_tokens) < 1:
        raise ValueError(f"topology.calibration needs parents, branches, max_new_tokens >= 1; got {dict(cal)}")
    if branches > context.target_backend.vocab_size:
        raise ValueError(
            f"topology.calibration.branches={branches} exceeds the vocabulary ({context.target_backend.vocab_size})"
        )
    check_calibration_fits(cfg, items=items, branches=branches)
    policy = sampling_policy(cfg)
    budget = Budget(shape="set", max_nodes=branches, max_depth=1, widths=(branches,))
    proposer = proposer_class(cfg.proposer.name).from_config(
        options=proposer_options(cfg),
        budget=budget,
        manifest_hash="sequoia-calibration",
        policy=policy,
        context=context,
    )
    verifier = get_verifier(cfg.verifier.name)
    eos = _eos_ids(context)
    ranks: list[int] = []
    bar = tqdm(
        total=need, desc="calibration: parent nodes", unit="node", file=sys.stderr, disable=not progress, leave=False
    )

    def on_round(*, trees, selections, **_):
        for tree, selection in zip(trees, selections):
            if len(tree.draws[0]) < branches:  # no full set to rank (the last token: none drafted)
                continue
            ranks.append(accepted_rank(tree, selection))
            if bar.n < need:  # the last prompt decodes to its end: the bar stops at the count needed
                bar.update(1)

    used = 0
    try:
        for i, (_, ids) in enumerate(items):
            if len(ranks) >= need:
                break
            decode(
                target=context.target_backend,
                proposer=proposer,
                verifier=verifier,
                policy=policy,
                prompt_ids=list(ids),
                max_new_tokens=int(cal.max_new_tokens),
                eos_token_ids=eos,
                rng=TorchRandomSource(int(cfg.seed) * 1_000_003 + 500_009 + i),
                round_cfg=RoundConfig(max_nodes=branches, max_depth=1),
                on_round=on_round,
            )
            used += 1
    finally:
        bar.close()
    return ranks, used


def check_calibration_fits(cfg, *, items: list, branches: int) -> None:
    """Refuse, before any decoding, calibration prompts that cannot hold
    ``topology.calibration.max_new_tokens`` and a round's ``branches`` candidate rows inside the
    positions (and sliding attention windows) of the target and a separate draft model, read from
    their configs as a run's context limit reads them and held to its rule: past them the rounds
    decoded at positions the models never saw. The suggested length fits the longest prompt."""
    from harness.engine.checks import models_in_use
    from harness.target.loading import DERIVED, model_attention_window, model_position_limit, model_rope_switch

    known = []
    for key, m in models_in_use(cfg):
        if m.name == DERIVED:  # cut from the target: its positions
            continue
        who = "the target" if key == "model" else "the draft model"
        for n, what in (
            (model_position_limit(m), who),
            (model_attention_window(m), f"{who}'s sliding attention window"),
            (model_rope_switch(m), f"{who}'s longrope switch to its long factors"),
        ):
            if n is not None:
                known.append((n, what))
    if not known:
        return
    positions, who = min(known, key=lambda k: k[0])  # the target named first on a tie
    new = int(cfg.topology.calibration.max_new_tokens)
    over = [(len(ids), prompt) for prompt, ids in items if len(ids) + new + branches > positions]
    if not over:
        return
    n, prompt = max(over, key=lambda o: o[0])
    room = positions - n - branches
    fix = (
        f"topology.calibration.max_new_tokens={room}"
        if room >= 1
        else "calibration prompts that fit (a workload with shorter prompts)"
    )
    raise ValueError(
        f"calibration prompt {prompt.prompt_id!r}{f' (and {len(over) - 1} more)' if len(over) > 1 else ''}: {n} "
        f"prompt tokens + topology.calibration.max_new_tokens={new} + {branches} candidate rows "
        f"(topology.calibration.branches) = {n + new + branches} > the {positions:,} positions of {who}; use {fix}"
    )


def run_calibration(cfg, context, *, items: list, provenance: dict, progress: bool = True) -> dict:
    """The gated calibration stage: measure, check the count, compute and validate; the artifact
    dict (unhashed). Raises :class:`CalibrationError` with fewer than the configured parents."""
    cal = cfg.topology.calibration
    t0 = time.perf_counter()
    ranks, used = measure_ranks(cfg, context, items=items, progress=progress)
    need = int(cal.parents)
    if len(ranks) < need:
        raise CalibrationError(
            f"calibration measured {len(ranks)} parent nodes on all {used} calibration prompts; "
            f"topology.calibration.parents={need} are required. Raise topology.calibration.max_new_tokens "
            f"or topology.calibration.prompts (a split with more prompts), or lower the requirement explicitly"
        )
    stats = acceptance_statistics(ranks, branches=int(cal.branches), z=float(cal.z))
    return {
        "kind": "sequoia_calibration",
        "format": CALIBRATION_FORMAT,
        **stats,
        "prompts_used": used,
        "seconds": time.perf_counter() - t0,
        "notes": {
            "acceptance": "selected-child probabilities p_j = h_j prod_{i<j}(1-h_i) (sum <= 1)",
            "h": "conditional sibling rates: P(rank j accepted | ranks < j rejected)",
            "parents": "reached parent nodes (one per calibration round, frontier of a set of branches draws)",
            "method": "the configured proposer, verifier and decode loop on the calibration split",
        },
        "provenance": {**provenance, "seed": int(cfg.seed)},
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def check_calibration(artifact: dict, expected: dict, *, path: str) -> None:
    """Refuse a calibration whose provenance differs from the run's; re-validate its vector."""

    check_provenance(
        artifact.get("provenance", {}), expected, fields=CALIBRATION_MATCH_FIELDS, kind="calibration", path=path
    )
    try:
        validate_selected_child_probabilities(artifact["acceptance"])
    except (KeyError, ValueError) as exc:
        raise StaleArtifactError(f"calibration {path!r} has no valid acceptance vector: {exc}") from exc
