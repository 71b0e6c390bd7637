"""`topology=sequoia`: the tree artifact and the TOPOLOGY preparer.

A tree artifact binds one calibration artifact (positional acceptance p_j, measured by
:mod:`harness.prepare.calibrate`) and one hardware profile (t(n), c0, c, measured by
:mod:`harness.prepare.profile`) by their content hashes, and stores what
:func:`~harness.topology.sequoia.optimize_tree` and
:func:`~harness.topology.sequoia.select_hardware_aware` chose from them: the tree minimising
``(t(n) + draft time) / G`` over the trees that search covers (the draft time of each candidate
tree counted as the draft model drafts it: its pass over the last round's committed tokens, then
one forward per level; ``searched`` says whether that is every tree within the bounds or, where
the profile's draft costs vary with what they feed, a stated family), its parent array and
sibling ranks, the candidate-row parents a proposer samples, the predicted time per committed
token (normalised and in ms), and the verify costs t(1..N) it was priced with.
``harness run`` never uses synthetic (hand-entered) costs.

Negotiation, before any model work, sees ``topology="tree"`` through :func:`placeholder_budget`;
an explicit ``topology.calibration_artifact`` or ``topology.profile_artifact`` is checked then too,
in the fields the config decides (:func:`check_calibration_config`, :func:`check_profile_config`).
After the models are loaded :func:`prepare_sequoia` resolves the artifacts:

* ``topology.tree_artifact=PATH``: that tree, its calibration and profile (or the explicit
  ``topology.calibration_artifact`` / ``topology.profile_artifact``); every provenance field is
  checked against the run and a stale artifact is refused (:class:`StaleArtifactError`). A cached
  calibration or profile measured again since the tree was built is read from the copy kept beside
  it under the content hash the tree binds (:func:`bound_file`), when that copy is there.
* otherwise artifacts under ``$HARNESS_CACHE/sequoia`` keyed by the run's provenance
  (``topology.reuse=true``), provenance re-checked on load; missing ones are measured first, as
  gated stages (calibration on the calibration split, then the profile), with progress bars. A
  cached profile timed beside more sweep jobs than the run shares the machine with (its
  ``concurrent_jobs``), or one that records no count where the run is alone, is measured again in
  its place (:func:`~harness.prepare.profile.contention_problem`); a named one is refused. A
  cached calibration or profile that reads and is measured again (`harness calibrate`,
  ``topology.reuse=false``, a contended profile) is kept beside the new one, named by its content
  hash, with a note: trees pinned for other configurations bind it.

Conventions: ``topology.max_nodes`` counts candidate rows, the DP's ``n`` counts the root
(``n = rows + 1``); depth counts edges in both.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from harness.contracts import Budget
from harness.files import artifact_lock, atomic_write_bytes
from harness.measure.hardware import threads_in_effect
from harness.prepare.calibrate import (
    CALIBRATION_MATCH_FIELDS,
    CONFIG_MATCH_FIELDS,
    calibration_items,
    calibration_provenance,
    check_calibration,
    check_disjoint,
    config_provenance,
    run_calibration,
)
from harness.prepare.profile import (
    CONCURRENCY_FIELD,
    PROFILE_MATCH_FIELDS,
    PROFILE_PLAN_FIELDS,
    StaleArtifactError,
    check_profile,
    check_provenance,
    contention_problem,
    cycle_prefix,
    key_hash,
    measure_profile,
    plot_profile,
    profile_provenance,
    read_artifact,
    searched_depth,
    unmeasured_problem,
    write_artifact,
)
from harness.target.loading import cache_root
from harness.topology.sequoia import optimize_tree, select_hardware_aware, tree_to_budget_parents

log = logging.getLogger("harness.sequoia")

TREE_FORMAT = 1
TREE_KIND = "sequoia_tree"
CALIBRATION_KIND = "sequoia_calibration"
PROFILE_KIND = "sequoia_hardware_profile"

#: how the refusal of a stale ``topology.profile_artifact`` ends: the user named that file, and
#: `harness calibrate` writes to the cache, never to it
NAMED_PROFILE_REMEDY = (
    "drop topology.profile_artifact (the run measures one) or give one measured for this configuration"
)

#: how the refusal of a tree that no longer matches what the run resolved ends
STALE_TREE_REMEDY = (
    "drop topology.tree_artifact (the run builds a tree from the current calibration and profile), or run "
    "`harness calibrate` with the run's overrides and pin the tree it writes"
)

__all__ = [
    "StaleArtifactError",
    "SequoiaArtifacts",
    "placeholder_budget",
    "search_bounds",
    "build_tree_artifact",
    "check_tree",
    "ensure_tree_artifact",
    "prepare_sequoia",
    "cost_model_error",
]


def placeholder_budget(t) -> Budget:
    """TOPOLOGIES entry: the search bounds as a tree budget, for negotiation before model work."""
    return Budget(shape="tree", max_nodes=int(t.max_nodes), max_depth=int(t.max_depth))


def search_bounds(t) -> dict:
    """The DP's search bounds from ``topology`` config (``max_nodes`` root included). ``max_depth`` is
    the depth the search reaches (:func:`searched_depth`), so bounds that search the same trees
    (``max_depth=30`` or ``4`` at ``max_nodes=4``) key one tree artifact."""
    rows, depth, min_nodes = int(t.max_nodes), int(t.max_depth), int(t.get("min_nodes", 2))
    if rows < 1 or depth < 1:
        raise ValueError(f"topology=sequoia needs max_nodes >= 1 and max_depth >= 1; got {rows}, {depth}")
    return {"max_rows": rows, "max_nodes": rows + 1, "max_depth": searched_depth(rows, depth), "min_nodes": min_nodes}


def _as_searched(search) -> object:
    """A tree artifact's recorded search bounds with ``max_depth`` read as the depth searched (an
    artifact written before the bounds recorded it may hold a deeper, equivalent bound)."""
    if not isinstance(search, dict) or not {"max_rows", "max_depth"} <= search.keys():
        return search
    try:
        return {**search, "max_depth": searched_depth(search["max_rows"], search["max_depth"])}
    except (TypeError, ValueError):
        return search


# ---------------------------------------------------------------- the tree artifact (pure)


def build_tree_artifact(
    *, calibration: dict, profile: dict, search: dict, calibration_path: str = "", profile_path: str = ""
) -> dict:
    """Choose the hardware-aware tree from a calibration and a measured profile (unhashed dict)."""
    problem = unmeasured_problem(profile)
    if problem:
        raise StaleArtifactError(f"a tree artifact for `harness run` needs a measured profile; this one {problem}")
    for name, art in (("calibration", calibration), ("profile", profile)):
        if not art.get("hash"):
            raise ValueError(f"the {name} artifact must be written (hashed) before a tree binds it")
    n_max, d_max = int(search["max_nodes"]), int(search["max_depth"])
    table = optimize_tree(acceptance=list(calibration["acceptance"]), max_nodes=n_max, max_depth=d_max)
    choice = select_hardware_aware(
        table,
        verify_cost=list(profile["verify_cost"][:n_max]),
        draft_cost=float(profile["draft_cost"]),
        draft_base_cost=float(profile["draft_base_cost"]),
        feed_cost=profile.get("draft_feed_cost"),
        level_cost=profile.get("draft_level_cost"),
        min_nodes=int(search["min_nodes"]),
    )
    if choice.n < 2:
        raise ValueError(
            "the hardware-aware choice is plain autoregressive decoding (n = 1): speculation does "
            "not pay on this profile; nothing to build (topology.min_nodes=2 forces a tree)"
        )
    widest = table.widest(d_max)
    t1 = float(profile["t1_ms"])
    return {
        "kind": TREE_KIND,
        "format": TREE_FORMAT,
        "synthetic": False,
        "calibration_hash": calibration["hash"],
        "profile_hash": profile["hash"],
        "calibration_path": str(calibration_path),
        "profile_path": str(profile_path),
        "search": dict(search),
        "acceptance": list(table.acceptance),
        "verify_cost": [float(v) for v in profile["verify_cost"][:n_max]],
        "searched": choice.searched,
        "chosen": {
            "n": choice.n,
            "d": choice.d,
            "candidate_rows": choice.candidate_rows,
            "expected_tokens": choice.expected_tokens,
            "time_per_token": choice.time_per_token,
            "time_per_token_ms": choice.time_per_token * t1,
            "verify_time": float(profile["verify_cost"][choice.n - 1]),
            "draft_time": choice.draft_time,
            "parents": list(choice.parents),
            "ranks": list(choice.ranks),
            "budget_parents": list(tree_to_budget_parents(choice.parents)),
        },
        "max_expected_tokens_tree": {
            "n": widest.nodes,
            "d": widest.depth,
            "expected_tokens": widest.expected_tokens,
            "parents": list(widest.parents),
        },
        "time_unit": "time_per_token: one autoregressive target step t(1); time_per_token_ms = that x t(1) in ms",
        "expected_tokens_table": table.expected_tokens_table(),
        "provenance": {"calibration": calibration.get("provenance"), "profile": profile.get("provenance")},
    }


def check_tree(tree: dict, *, calibration: dict, profile: dict, search: dict, path: str) -> None:
    """Refuse a tree that does not bind these artifacts, was searched under other bounds, or whose
    choice the optimiser no longer reproduces."""
    if tree.get("calibration_hash") != calibration.get("hash"):
        raise StaleArtifactError(
            f"stale tree artifact {path!r}: it binds calibration {tree.get('calibration_hash')!r}, "
            f"the run resolved calibration {calibration.get('hash')!r}; {STALE_TREE_REMEDY}"
        )
    if tree.get("profile_hash") != profile.get("hash"):
        raise StaleArtifactError(
            f"stale tree artifact {path!r}: it binds profile {tree.get('profile_hash')!r}, "
            f"the run resolved profile {profile.get('hash')!r}; {STALE_TREE_REMEDY}"
        )
    if _as_searched(tree.get("search")) != search:
        raise StaleArtifactError(
            f"stale tree artifact {path!r}: searched under {tree.get('search')}, this run's topology asks {search}; "
            f"{STALE_TREE_REMEDY}"
        )
    again = build_tree_artifact(calibration=calibration, profile=profile, search=search)
    if again["chosen"]["parents"] != tree.get("chosen", {}).get("parents"):
        raise StaleArtifactError(
            f"stale tree artifact {path!r}: the optimiser now chooses "
            f"{again['chosen']['parents']} from the same inputs, the artifact holds "
            f"{tree.get('chosen', {}).get('parents')}; {STALE_TREE_REMEDY}"
        )
    # every figure of the choice, the budget a run builds from it included (budget_parents, ranks)
    differs = sorted(k for k, v in again["chosen"].items() if json.loads(json.dumps(v)) != tree["chosen"].get(k))
    if differs:
        raise StaleArtifactError(
            f"stale tree artifact {path!r}: its chosen {differs[0]} is {tree['chosen'].get(differs[0])}, the tree "
            f"{again['chosen']['parents']} gives {again['chosen'][differs[0]]}; {STALE_TREE_REMEDY}"
        )


def kept_path(path, digest) -> Path | None:
    """Where the cached calibration or profile at ``path`` whose content hash is ``digest`` is kept once a
    new measurement replaces it: beside it, ``<name>-<key>.<digest>.json``; None where ``digest`` is no
    content hash."""
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{16}", digest):
        return None
    path = Path(path)
    return path.with_name(f"{path.stem}.{digest}{path.suffix}")


def bound_file(path, digest) -> Path:
    """The file holding the calibration or profile a tree binds, by its recorded ``path`` and content hash
    ``digest``: the copy kept beside ``path`` under that hash where the file there was measured again
    since, else ``path`` (loaded and checked against the run and the tree as any other)."""
    kept = kept_path(path, digest)
    return kept if kept is not None and kept.is_file() else Path(path)


# ---------------------------------------------------------------- resolution for a run


@dataclass
class SequoiaArtifacts:
    tree: dict
    tree_path: Path
    calibration: dict
    calibration_path: Path
    profile: dict
    profile_path: Path
    plot_path: Path
    stages: dict = field(default_factory=dict)  # how each artifact was obtained

    def budget(self) -> Budget:
        c = self.tree["chosen"]
        return Budget(
            shape="tree",
            max_nodes=int(c["candidate_rows"]),
            max_depth=max(int(c["d"]), 1),
            parents=tuple(int(p) for p in c["budget_parents"]),
        )

    def paths(self) -> dict:
        """Where each artifact is (an absolute path: a record is read from other folders than the one
        its run started in), and the content hash of the one this run used (a later `harness
        calibrate` rewrites the cached files in place: the hash says which was run)."""
        return {
            "sequoia_tree": str(absolute(self.tree_path)),
            "sequoia_calibration": str(absolute(self.calibration_path)),
            "sequoia_profile": str(absolute(self.profile_path)),
            "sequoia_profile_plot": str(absolute(self.plot_path)),
            "sequoia_tree_hash": self.tree.get("hash"),
            "sequoia_calibration_hash": self.calibration.get("hash"),
            "sequoia_profile_hash": self.profile.get("hash"),
        }

    def metrics(self) -> dict:
        c = self.tree["chosen"]
        return {
            "sequoia_predicted_time_per_token_ms": c["time_per_token_ms"],
            "sequoia_predicted_time_per_token_normalised": c["time_per_token"],
            "sequoia_predicted_expected_tokens": c["expected_tokens"],
            "sequoia_tree_nodes": c["n"],
            "sequoia_tree_candidate_rows": c["candidate_rows"],
            "sequoia_tree_depth": c["d"],
            "sequoia_profile_t1_ms": self.profile["t1_ms"],
            "sequoia_calibration_parents": self.calibration["parents"],
            "sequoia_acceptance": list(self.calibration["acceptance"]),
            "sequoia_stages": dict(self.stages),
            # how many jobs shared the machine while the profile that chose the tree was timed (None: not recorded)
            "sequoia_profile_concurrent_jobs": self.profile_concurrency(),
        }

    def profile_concurrency(self) -> int | None:
        """How many jobs shared the machine while the profile was timed (its provenance's
        ``concurrent_jobs``), or None where the profile does not say."""
        return (self.profile.get("provenance") or {}).get(CONCURRENCY_FIELD)

    def summary(self) -> dict:
        c = self.tree["chosen"]
        return {
            **self.paths(),
            "stages": dict(self.stages),
            "profile_concurrent_jobs": self.profile_concurrency(),
            "acceptance": list(self.calibration["acceptance"]),
            "h": list(self.calibration["h"]),
            "parents_measured": self.calibration["parents"],
            "verify_cost": list(self.profile["verify_cost"]),
            "draft_cost": self.profile["draft_cost"],
            "draft_base_cost": self.profile["draft_base_cost"],
            "t1_ms": self.profile["t1_ms"],
            "chosen": {
                k: c[k]
                for k in (
                    "n",
                    "d",
                    "candidate_rows",
                    "expected_tokens",
                    "time_per_token",
                    "time_per_token_ms",
                    "parents",
                    "budget_parents",
                )
            },
        }


def sequoia_dir() -> Path:
    """The cached Sequoia artifacts' folder, absolute (a relative ``$HARNESS_CACHE`` read from the
    working directory)."""
    return absolute(cache_root() / "sequoia")


def absolute(path) -> Path:
    """``path`` made absolute against the working directory (symbolic links kept): the artifact paths a
    record holds name the same files from any folder, the run folder included."""
    return Path(os.path.abspath(path))


def _match(provenance: dict, fields) -> dict:
    return {k: provenance.get(k) for k in fields}


def check_calibration_config(cfg) -> None:
    """An explicit ``topology.calibration_artifact`` whose provenance differs from the run's config
    (another temperature, proposer, verifier or calibration setting) refused before any model work:
    it was refused after the models had loaded. The fields that need the tokenizer and the
    calibration prompts are checked when the artifact is loaded."""
    t = cfg.topology
    if t.name != "sequoia" or not t.get("calibration_artifact"):
        return
    path = str(t.calibration_artifact)
    art = read_artifact(Path(path), kind=CALIBRATION_KIND)
    check_provenance(
        art.get("provenance", {}), config_provenance(cfg), fields=CONFIG_MATCH_FIELDS, kind="calibration", path=path
    )


def check_profile_config(cfg) -> None:
    """An explicit ``topology.profile_artifact`` measured for another configuration (other threads,
    model, dtype, device, batch size, attention implementation, checkpoint files, library versions
    or profile settings), or too short for the search, refused before any model work: the run's
    provenance (:func:`~harness.prepare.profile.profile_provenance`, at the thread count the run
    will set) compared as the load compares it, but for the source of the timed code, which the
    load only says."""
    t = cfg.topology
    if t.name != "sequoia" or not t.get("profile_artifact"):
        return
    path = absolute(t.profile_artifact)
    art = read_artifact(path, kind=PROFILE_KIND)
    check_profile(
        art,
        profile_provenance(cfg, threads=threads_in_effect(cfg.get("threads"))),
        path=str(path),
        max_nodes=search_bounds(t)["max_nodes"],
        fields=PROFILE_PLAN_FIELDS,
        remedy=NAMED_PROFILE_REMEDY,
    )


def ensure_tree_artifact(cfg, context, *, force: bool = False, progress: bool = True) -> SequoiaArtifacts:
    """Resolve (load and check, or measure and write) the calibration, profile and tree for a run
    of ``cfg`` with loaded models (``context``: :class:`harness.engine.build.BuildContext`).
    ``force`` re-measures the calibration even where a matching cached one exists (`harness
    calibrate`); the hardware profile, which other configurations' trees bind, is measured again
    only where none matches, ``topology.reuse=false``, or the cached one was timed beside more jobs
    than this run shares the machine with (``concurrent_jobs``:
    :func:`~harness.prepare.profile.contention_problem`)."""

    t = cfg.topology
    search = search_bounds(t)
    reuse = bool(t.get("reuse", True))
    cal_items = calibration_items(cfg, context.tokenizer)
    check_disjoint(cal_items, context.items)
    cal_expected = calibration_provenance(cfg, tokenizer=context.tokenizer, items=cal_items)
    prof_expected = profile_provenance(cfg)
    cal_key = key_hash(_match(cal_expected, CALIBRATION_MATCH_FIELDS))
    prof_key = key_hash(_match(prof_expected, PROFILE_MATCH_FIELDS))
    root = sequoia_dir()
    stages: dict[str, str] = {}
    replaced: dict[Path, bytes | None] = {}  # files a stage re-measured: their earlier bytes (None: absent)
    superseded: dict[Path, tuple[str, bytes]] = {}  # readable artifacts a stage re-measured: (purpose, bytes)

    def load_calibration(path) -> dict:
        art = read_artifact(path, kind=CALIBRATION_KIND)
        check_calibration(art, cal_expected, path=str(path))
        return art

    def load_profile(path) -> dict:
        art = read_artifact(path, kind=PROFILE_KIND)
        given = t.get("profile_artifact") and Path(path) == absolute(t.profile_artifact)
        remedy = {"remedy": NAMED_PROFILE_REMEDY} if given else {}
        check_profile(art, prof_expected, path=str(path), max_nodes=search["max_nodes"], **remedy)
        return art

    def contended_profile(path: Path) -> str | None:
        """Why the cached profile at ``path`` does not price this run: it was timed beside more jobs than
        this run shares the machine with (:func:`~harness.prepare.profile.contention_problem`); None
        where it may, or where it does not read (measured again for that reason)."""
        try:
            art = read_artifact(path, kind=PROFILE_KIND)
        except StaleArtifactError:
            return None
        return contention_problem(
            (art.get("provenance") or {}).get(CONCURRENCY_FIELD), prof_expected[CONCURRENCY_FIELD]
        )

    def plot_for(profile: dict, path: Path) -> Path:
        """The plot of ``profile`` (read from ``path``), drawn where absent: beside a cached profile, and in
        the cache folder under its content hash for one kept elsewhere (nothing is written beside a file
        the user named)."""
        path = absolute(path)
        png = path.with_suffix(".png") if path.parent == root else root / f"profile-plot-{profile['hash']}.png"
        if not png.exists():
            plot_profile(profile, png)
        return png

    named: dict[str, dict] = {}  # artifacts a topology.<name>_artifact names, loaded and checked
    if t.get("profile_artifact") and not t.get("tree_artifact"):  # before the calibration is measured (minutes)
        named["profile"] = load_profile(absolute(t.profile_artifact))

    def unreadable(path: Path, kind: str) -> str | None:
        """Why the cached file at ``path`` cannot be used at all (it does not parse, is not a ``kind``
        artifact, or its content hash does not verify: cut short or edited), else None."""
        try:
            read_artifact(path, kind=kind)
        except StaleArtifactError as exc:
            return str(exc)
        return None

    def gated(
        name: str, key: str, kind: str, load, measure, purpose: str, *, fresh: bool = False, outdated=None
    ) -> tuple[dict, Path]:
        """A gated stage's artifact and its path: the one ``topology.<name>_artifact`` names, else
        the cached ``<name>-<key>.json`` (when ``reuse``, not ``fresh``, the file reads as a ``kind``
        artifact whose hash verifies, and not ``outdated(path)``: a reason to measure it again, such as
        timings taken beside more jobs), else ``measure(path)`` (which writes it there), holding the
        artifact's lock so that concurrent jobs measure it once. A named artifact that does not read
        is refused: the user chose that file."""
        explicit = t.get(f"{name}_artifact")
        if explicit:
            art = named[name] if name in named else load(absolute(explicit))
            stages[name] = f"loaded (topology.{name}_artifact)"
            return art, absolute(explicit)
        path = root / f"{name}-{key}.json"
        with artifact_lock(path, purpose=purpose):
            broken = why = None
            if reuse and not fresh and path.exists():
                broken = unreadable(path, kind)
                why = broken or (outdated(path) if outdated is not None else None)
            if why:
                print(f"harness: note: measuring the cached {purpose} {str(path)!r} again: {why}", file=sys.stderr)
            if reuse and not fresh and path.exists() and not why:
                art = load(path)
                stages[name] = "loaded (cache)"
            else:
                for earlier in (path, path.with_suffix(".png")):  # put back if a later stage refuses
                    replaced[earlier] = earlier.read_bytes() if earlier.is_file() else None
                if broken:  # a file that does not read is never put back: the new measurement stays
                    replaced[path] = None
                readable = replaced[path] is not None and not unreadable(path, kind)
                art = measure(path)
                if readable and json.loads(replaced[path])["hash"] != art["hash"]:
                    superseded[path] = (purpose, replaced[path])
                stages[name] = "measured"
        return art, path

    def calibrate(path: Path) -> dict:
        log.info("sequoia: calibrating on %d calibration prompts", len(cal_items))
        art = run_calibration(cfg, context, items=cal_items, provenance=cal_expected, progress=progress)
        return write_artifact(art, path)

    def profile_hardware(path: Path) -> dict:
        prefix = cycle_prefix([tok for _, ids in cal_items for tok in ids], int(t.profile.prefix_len))
        art = measure_profile(
            target_backend=context.target_backend,
            draft_backend=context.draft_backend,
            prefix_ids=prefix,
            max_nodes=search["max_nodes"],
            warmup=int(t.profile.warmup),
            repeats=int(t.profile.repeats),
            provenance=prof_expected,
            progress=progress,
            batch_size=int(cfg.generation.batch_size),
            max_depth=searched_depth(t.max_nodes, t.max_depth),
        )
        profile = write_artifact(art, path)
        check_profile(profile, prof_expected, path=str(path), max_nodes=search["max_nodes"])
        plot_profile(profile, path.with_suffix(".png"))
        return profile

    def keep_superseded() -> None:
        """Keep each artifact a stage measured again beside its replacement, under its content hash
        (:func:`kept_path`): trees pinned for other configurations bind it (:func:`bound_file`)."""
        for path, (purpose, earlier) in superseded.items():
            kept = kept_path(path, json.loads(earlier)["hash"])
            if kept is None:
                continue
            if not kept.exists():
                atomic_write_bytes(kept, earlier)
            print(
                f"harness: note: the {purpose} {str(path)!r} was measured again; the one it replaced, which trees "
                f"given by topology.tree_artifact may bind, is kept as {str(kept)!r}",
                file=sys.stderr,
            )

    if t.get("tree_artifact"):  # explicit tree: everything it binds must match this run
        tree_path = absolute(t.tree_artifact)
        tree = read_artifact(tree_path, kind=TREE_KIND)
        cal_path = absolute(
            t.get("calibration_artifact") or bound_file(tree["calibration_path"], tree.get("calibration_hash"))
        )
        prof_path = absolute(t.get("profile_artifact") or bound_file(tree["profile_path"], tree.get("profile_hash")))
        calibration, profile = load_calibration(cal_path), load_profile(prof_path)
        check_tree(tree, calibration=calibration, profile=profile, search=search, path=str(tree_path))
        stages = {"calibration": "loaded", "profile": "loaded", "tree": "loaded (topology.tree_artifact)"}
        plot_path = plot_for(profile, prof_path)
    else:  # each stage loaded from the cache when it matches, else measured (or built) and written
        try:
            calibration, cal_path = gated(
                "calibration",
                cal_key,
                CALIBRATION_KIND,
                load_calibration,
                calibrate,
                "Sequoia calibration",
                fresh=force,
            )
            # one job profiles at a time: the others wait (their timing would disturb it), then load it
            profile, prof_path = gated(
                "profile",
                prof_key,
                PROFILE_KIND,
                load_profile,
                profile_hardware,
                "Sequoia hardware profile",
                outdated=contended_profile,
            )
            plot_path = plot_for(profile, prof_path)

            # 3. the tree
            # keyed by the contents it is built from: a named calibration or profile, or one measured
            # again, gets a tree file of its own, and never replaces the tree other runs (and records) bind
            tree_path = root / f"tree-{key_hash([calibration['hash'], profile['hash'], search])}.json"
            tree = None
            with artifact_lock(tree_path, purpose="Sequoia tree"):
                if (
                    reuse
                    and tree_path.exists()
                    and stages["calibration"] != "measured"
                    and stages["profile"] != "measured"
                ):
                    try:
                        tree = read_artifact(tree_path, kind=TREE_KIND)
                        check_tree(tree, calibration=calibration, profile=profile, search=search, path=str(tree_path))
                        stages["tree"] = "loaded (cache)"
                    except StaleArtifactError as exc:  # a cached tree over replaced inputs: rebuilt, never used
                        log.info("sequoia: rebuilding the cached tree: %s", exc)
                        tree = None
                if tree is None:
                    tree = write_artifact(
                        build_tree_artifact(
                            calibration=calibration,
                            profile=profile,
                            search=search,
                            calibration_path=str(cal_path),
                            profile_path=str(prof_path),
                        ),
                        tree_path,
                    )
                    stages["tree"] = "built"
        except BaseException:  # a refused tree (speculation does not pay), an interrupt: none replaced
            for path, earlier in replaced.items():  # (a first measurement stays: it is valid, and costly)
                if earlier is not None:
                    atomic_write_bytes(path, earlier)  # the earlier file whole or the new one, never a part
            raise
        keep_superseded()
    return SequoiaArtifacts(
        tree=tree,
        tree_path=tree_path,
        calibration=calibration,
        calibration_path=cal_path,
        profile=profile,
        profile_path=prof_path,
        plot_path=plot_path,
        stages=stages,
    )


def slower_than_ar_note(chosen: dict) -> str | None:
    """One line when the chosen tree's predicted time per token (in AR steps) is above one: the
    search had to build a tree (``topology.min_nodes`` >= 2) although plain decoding is predicted
    faster on this profile; None otherwise."""
    t = float(chosen["time_per_token"])
    if t <= 1.0:
        return None
    return (
        f"the Sequoia tree of {chosen['n']} nodes is predicted at {t:.2f}x an autoregressive step per token on this "
        "profile: slower than plain decoding; it is built because topology.min_nodes forces a tree "
        "(min_nodes=1 lets the search choose plain decoding, and the run is then refused)"
    )


def idle_nodes_note(tree: dict) -> str | None:
    """One line when a tree of fewer nodes and no deeper than the chosen one expects as many tokens
    (the chosen tree's extra nodes are worth nothing under the calibration), saying what chose the
    larger: the profile pricing its verify forward no dearer than the smaller one's (a measured
    profile's noise, or a kernel's faster path at more rows), else its drafting, cheaper than that
    tree's by at least the verify forwards' difference (the search chose it over that tree); None
    otherwise. A tree dict without ``verify_cost`` says no reason; one without the chosen ``d`` is
    compared at the search's depth bound."""
    table = tree.get("expected_tokens_table") or []
    chosen = tree["chosen"]
    # the table stores depths up to the deepest a tree of its sizes reaches (below a larger bound)
    depth = min(int(chosen.get("d", tree["search"]["max_depth"])), max((int(d) for _, d, _ in table), default=0))
    n, g = int(chosen["n"]), float(chosen["expected_tokens"])
    smallest = int(tree["search"].get("min_nodes", 1))
    verify = tree.get("verify_cost")
    for m, d, value in table:
        if int(d) != depth or not smallest <= int(m) < n or value is None or float(value) < g - 1e-9:
            continue
        m = int(m)
        note = (
            f"the chosen Sequoia tree of {n} nodes expects no more tokens per round ({g:.3g}) than the best of {m}: "
            f"its extra nodes are worth nothing under the calibration"
        )
        if verify is None:
            return note
        t_n, t_m = float(verify[n - 1]), float(verify[m - 1])
        if t_m >= t_n:
            return (
                f"{note}, and the hardware profile prices its verify forward no dearer than the smaller one's "
                f"(t({n}) = {t_n:.3g}, t({m}) = {t_m:.3g}: a measured profile's noise, or a kernel's faster path at "
                "more rows)"
            )
        return (
            f"{note}; its drafting chose it, cheaper on this profile than that tree's by at least its dearer verify "
            f"forward (t({n}) - t({m}) = {t_n:.3g} - {t_m:.3g})"
        )
    return None


def prepare_sequoia(cfg, plan_, context):
    """TOPOLOGY_PREPARERS entry: resolve the artifacts, then the plan's budget is the chosen tree."""
    arts = ensure_tree_artifact(cfg, context)
    idle = idle_nodes_note(arts.tree)
    if idle:
        print(f"harness: note: {idle}", file=sys.stderr)
    provenance = arts.profile.get("provenance", {})
    t_profile = {
        "n": [v["n"] for v in arts.profile["verify_ms"]],
        "t": [v["median_ms"] for v in arts.profile["verify_ms"]],
        "batch_size": int(provenance.get("batch_size") or 1),
        "prefix_len": int(provenance.get("measurement", {}).get("prefix_len") or 0),
    }
    return plan_.with_budget(arts.budget(), artifacts=arts.paths(), metrics=arts.metrics(), t_profile=t_profile)


def cost_model_error(record: dict) -> dict:
    """Predicted vs measured time per committed token (and expected vs measured tokens per round)
    of a `topology=sequoia` run record: the cost model's error.

    The model predicts one request's time per token: a round of B requests (the profile's t(n) is
    of a batch-B forward) over the tokens one request commits. The record's
    ``time_per_committed_token_ms`` divides a batch's time by every live request's tokens, so at
    batch > 1 the measured figure compared is that times the mean live requests per round (the
    same per-request basis; ``measured_basis`` says which was used)."""
    m = record["metrics"]
    predicted, per_token = m.get("sequoia_predicted_time_per_token_ms"), m.get("time_per_committed_token_ms")
    if predicted is None:
        raise ValueError("the record has no sequoia_predicted_time_per_token_ms (not a topology=sequoia run)")
    g, committed = m.get("sequoia_predicted_expected_tokens"), m.get("mean_committed_per_round")
    live = float(m.get("mean_live_requests") or 1.0)
    measured = None if per_token is None else per_token * live
    return {
        "predicted_time_per_token_ms": predicted,
        "measured_time_per_token_ms": measured,
        "measured_basis": (
            "time_per_committed_token_ms"
            if live == 1.0
            else f"time_per_committed_token_ms x mean_live_requests ({live:.3g}): per request, as predicted"
        ),
        "time_relative_error": None if not measured else (measured - predicted) / predicted,
        "predicted_expected_tokens": g,
        "measured_committed_per_round": committed,
        "tokens_relative_error": None if committed is None else (committed - g) / g,
    }
