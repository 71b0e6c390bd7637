"""One job, in stages: plan -> load -> prepare -> gate -> measure -> summarise -> write.

Each stage is a function of typed values; :func:`run_job` reads as the list of them. Nothing is
written unless every stage before ``write`` succeeded: a refused plan, a failed gate or a greedy
divergence raises, and the job leaves no record. From the first model work on, the job holds its
folder's lock (a second run there is refused). A record or outputs already in the folder are
moved aside with a warning (:mod:`harness.tracking.job_folder`) and put back when the job is
refused while loading or preparing (a prompt over the context limit, a datastore or artifact that
does not fit); a job that then fails its gates or breaks leaves no record there, not even an
earlier one. With ``tracking=wandb`` the W&B run opens once the job is past its refusals (loaded
and prepared: a refused configuration or input, or a load or preparation that fails, logs
nothing), so its system monitor covers the gates and the measurement; a later stage that raises
finishes it as failed (tagged ``refused`` for a gate or contract refusal), and a finished job logs
its record there. The autoregressive baseline and the speculative arm run on the same prompts with
the same seeds, batch by batch (a batch of one at ``generation.batch_size=1``), interleaved,
through the same round loop and clock.

The workload is read at plan (a bad file is refused before any model is loaded) and tokenized at
load, where every prompt is checked against the context limit (``workload.truncate``: refuse, or
cut from the left and record). A conversation's later turns are built during measure from each
arm's own answers (:class:`~harness.workloads.conversations.PromptEncoder`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from harness.contracts import Budget, ConfigError, ContractError
from harness.engine.arms import ARMS, METRIC_NOTES, Arms, ArmsResult, merged_proposer_extras
from harness.engine.build import BuildContext, Plan, build_proposer, plan, proposer_options
from harness.engine.checks import check_output_dir, check_selected_names, models_in_use
from harness.engine.decode import RoundConfig, check_temp_kv_budget
from harness.files import artifact_lock
from harness.gates.drift import heuristic_drift
from harness.gates.greedy import greedy_equality, output_turns
from harness.gates.stages import (
    announce_disabled,
    disabled_gates,
    found_no_prefix,
    run_gates,
    statistical_gate_on_run,
)
from harness.gates.statistical import GATE_PROMPTS
from harness.gates.status import GateError
from harness.heads.eagle_formats import published_draft_vocab
from harness.heads.published import inspect as inspect_published
from harness.heads.recipes import heads_inert_options
from harness.manifest import (
    RECORD_SCHEMA_VERSION,
    TRAINING_OPTIONS,
    checkpoint_decides,
    draft_model_config,
    freeze_manifest,
    job_manifest_hash,
    manifest_extras,
    manifest_hash,
)
from harness.measure.hardware import hardware_card, manifest_versions, peak_rss_bytes, threads_in_effect, usable_cpus
from harness.measure.memory import JobHostMemory
from harness.prepare import prepare
from harness.prepare.calibrate import CalibrationError, calibration_items, check_disjoint
from harness.prepare.sequoia import (
    check_calibration_config,
    check_profile_config,
    cost_model_error,
    slower_than_ar_note,
)
from harness.proposers.base import NullProposer, Proposer
from harness.proposers.merged import MergedProposer
from harness.proposers.registry import PROPOSERS, proposer_class
from harness.proposers.rest import datastore_sources, forget_datastore_builds, path_inert_options
from harness.random_source import TorchRandomSource
from harness.record_schema import is_gated
from harness.target.backend import CausalLMBackend
from harness.target.fused_layers import apply_fused_layers, decoder_layers, fusable, fused_stack_of
from harness.target.loading import (
    DERIVED,
    CheckpointError,
    LoadedModel,
    cache_layer_problem,
    checkpoint_ref_problem,
    config_position_limit,
    derive_draft,
    eos_ids,
    load_model,
    load_tokenizer_of,
    model_attention_window,
    model_geometry,
    model_kv_bytes_per_token,
    model_position_limit,
    model_rope_switch,
    position_bias_problem,
    resolve_dtype,
    tokenizer_difference,
    tokenizer_id_difference,
)
from harness.target.native import code_paths as native_code_paths
from harness.target.options import (
    CompileWatch,
    apply_cudnn_attention,
    apply_linear_kernel,
    apply_static_cache,
    compile_model,
    compile_problem,
    cudnn_attention_problem,
    fused_layers_problem,
    linear_kernel_of,
    linear_kernel_problem,
    pack_weights,
    resolve_cudnn_attention,
    resolve_static_cache,
    resolved_fused_layers,
)
from harness.target.timing import matmul_peak, profile_roofline, read_bandwidth_gbs, weight_stream_floor_ms
from harness.topology.budgets import unreached_level, verified_rows
from harness.tracking.compare import run_speedups
from harness.tracking.job_folder import (
    JobWriteError,
    clear_for_run,
    foreign_entries,
    inspect_job,
    job_lock,
    restore_aside,
    write_job,
)
from harness.tracking.record import write_json_atomic
from harness.tracking.run_notes import (
    TIMING_OUTLIER_FACTOR,
    batched_history_note,
    past_rounds_speedup_note,
    timing_outlier_note,
)
from harness.tracking.store import PREVIOUS_DIR, RECORD_FILENAME, ROUNDS_FILENAME, record_below
from harness.tracking.wandb_tracker import (
    NullTracker,
    Tracker,
    TrackingError,
    discard_offline_run,
    discard_offline_runs,
    environment_notes,
    open_run,
    tracking_problem,
    wandb_group,
)
from harness.verifiers.base import NegotiationError, get_verifier
from harness.workloads.conversations import (
    TRUNCATE_REFUSE,
    ContextLimit,
    PromptEncoder,
    TurnPrompt,
    chat_template_of,
    context_limit,
    set_chat_template,
    truncate_rule,
)
from harness.workloads.datastore import MANIFEST_FILE, SA_FILE, TOKENS_FILE
from harness.workloads.prompts import (
    Prompt,
    WorkloadError,
    load_configured,
    per_category_shortfall,
    per_category_task,
)


@dataclass(frozen=True)
class Planned:
    """What the config alone decides, before any model work."""

    plan: Plan
    manifest: dict
    manifest_hash: str
    run_id: str  # the manifest hash and the job's start time
    round_cfg: RoundConfig
    kv_bytes_per_token: int
    temp_kv_budget_formula_bytes: int
    run_dir: Path
    prompts: list[Prompt]  # the workload, read (not yet tokenized)
    context: ContextLimit  # what every turn's prompt must fit


@dataclass(frozen=True)
class Loaded:
    target: LoadedModel
    draft: LoadedModel | None
    backend: CausalLMBackend
    draft_backend: CausalLMBackend | None
    items: list  # [(Prompt, first-turn token ids)] (cut from the left under workload.truncate=left)
    eos: frozenset[int]
    encoder: PromptEncoder  # builds every later turn's prompt
    first_turns: list[TurnPrompt]  # each prompt's first turn (ids and length before any cut)


@dataclass(frozen=True)
class Prepared:
    plan: Plan  # after the topology preparers (e.g. a Sequoia tree budget)
    context: BuildContext
    proposers: list  # one per batch slot (proposers keep per-request state)
    null_proposers: list  # the autoregressive arm's slots


@dataclass(frozen=True)
class Measured:
    arms: ArmsResult
    per_prompt: list[dict]
    outputs: list[dict]
    greedy: dict | None  # the greedy-equality evidence (temperature 0), else None
    rounds: list[dict]  # the speculative arm's per-round series (rounds.jsonl)
    learned_at_start: dict | None = None  # per arm, each slot's proposer's learning before the job's rounds


#: exceptions that mean "this configuration was refused" rather than "the job broke"
REFUSALS: tuple[type[BaseException], ...] = (GateError, NegotiationError, ContractError, TrackingError)


class HeldInterrupts:
    """SIGINT, SIGTERM and SIGHUP held back from its creation to :meth:`release` (in the main thread;
    elsewhere nothing is held): one that comes in between is handed to the handler it would have
    met then, at :meth:`release` (where a Ctrl-C raises KeyboardInterrupt), so the code between
    runs whole: files moved aside are all aside, and ``release`` inside a ``try`` lets its handler
    put them back."""

    SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")

    def __init__(self) -> None:
        self.previous: dict[int, Any] = {}
        self.pending: list[int] = []
        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.SIGNALS:
            signum = getattr(signal, name, None)
            if signum is not None:
                before = signal.signal(signum, self._hold)
                self.previous[signum] = signal.SIG_DFL if before is None else before

    def _hold(self, signum: int, frame) -> None:
        self.pending.append(signum)

    def release(self) -> None:
        """The earlier handlers back, then each signal held meanwhile handed to its handler."""
        previous, self.previous = self.previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        # a Ctrl-C's handler raises, which ends the loop: a termination held beside it is handed on first
        for signum in sorted(dict.fromkeys(self.pending), key=lambda held: held == signal.SIGINT):
            handler = previous.get(signum)
            if callable(handler):
                handler(signum, None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)
        self.pending = []


def run_job(
    cfg: DictConfig,
    *,
    run_dir: Path | None = None,
    aside: Path | None = None,
    restore_other_manifest: bool = True,
    restore_earlier: bool = True,
    held: HeldInterrupts | None = None,
) -> dict:
    """One job: everything `harness run` does. Returns the record (also written to run_dir).
    ``aside``: where the caller (a sweep) already moved the folder's earlier files; they go back
    as the job's own would (a refusal before measuring, an interrupt before the write), unless
    ``restore_other_manifest`` is false and they hold a record of another manifest (a sweep's store
    and report show no record of a manifest other than its job's), or ``restore_earlier`` is false
    (they are not this job's for another reason: a record of its manifest checked otherwise).
    ``held``: the signals the caller held while it set the files aside, released here, where an
    interrupt they hand on puts the files back."""
    t_job = time.perf_counter()
    threads = threads_in_effect(cfg.threads)
    torch.set_num_threads(threads)  # set or not: a job never runs with the count an earlier job of its process set
    try:
        if held is not None:
            held.release()
        planned = plan_job(cfg, run_dir)
    except BaseException as exc:  # refused or interrupted before anything ran: files set aside go back
        forget_datastore_builds()
        if aside is not None and restore_earlier:
            put_back_unplanned(cfg, run_dir, aside, exc, restore_other_manifest=restore_other_manifest)
        raise
    inert = inert_options(cfg)
    if inert:  # accepted (a sweep may cross them with a setting that ignores them), never silently
        print(f"harness: note: option(s) with no effect here: {'; '.join(inert)}", file=sys.stderr)
    partial = partial_batch_note(len(planned.prompts), int(cfg.generation.batch_size))
    if partial:
        print(f"harness: note: {partial}", file=sys.stderr)
    notes = (
        templated_text_note(cfg, planned.prompts),
        training_text_note(cfg),
        whole_target_draft_note(cfg),
        oversubscribed_threads_note(cfg.threads, threads),
    )
    for note in (*notes, *compiled_panels_notes(cfg)):
        if note is not None:
            print(f"harness: note: {note}", file=sys.stderr)
    for note in environment_notes(str(cfg.tracking.mode)) if cfg.tracking.name == "wandb" else []:
        print(f"harness: note: {note}", file=sys.stderr)
    with job_lock(planned.run_dir):  # one run per folder, from the first model work to the record
        # an interrupt while the earlier files move waits until they are all aside, then puts them back
        held = HeldInterrupts()
        try:
            earlier = inspect_job(planned.run_dir, manifest_hash=planned.manifest_hash, manifest=planned.manifest)
            moved, moved_note = clear_for_run(
                planned.run_dir, earlier, what=str(planned.run_dir), action="harness run: overwriting"
            )
            aside = moved or aside
            host_memory = JobHostMemory().start()  # this job's peak RSS, even when jobs share a process
            compile_watch = CompileWatch().start()  # what torch.compile did in this job, when a model is compiled
        except BaseException:
            held.release()
            raise

        def announce_move() -> None:  # once the job is past its refusals, or where the files stay aside
            nonlocal moved_note
            if moved_note:
                logging.getLogger("harness.jobs").warning("%s", moved_note)
                moved_note = None

        tracker: Tracker | NullTracker = NullTracker()  # W&B's run opens once the job is past its refusals
        stage = "load"
        try:
            held.release()  # an interrupt held back while the files moved raises here
            loaded = load(cfg, planned)
            stage = "prepare"
            prepared = prepare_job(cfg, planned, loaded)
            stage = "tracking_start"
            tracker = start_tracker(cfg, planned)
            announce_move()
            stage = "gate"
            gates = gate(cfg, planned, loaded, prepared)
            stage = "measure"
            measured = measure(cfg, planned, loaded, prepared)
            stage = "gate_measured"
            gates = gate_measured(cfg, loaded, prepared, gates, measured)
            stage = "summarise"
            record = summarise(
                cfg,
                planned,
                loaded,
                prepared,
                gates,
                measured,
                job_seconds=time.perf_counter() - t_job,
                host_memory=host_memory.stop(),
                compile_report=compile_watch.stop(),
            )
            stage = "write"
            writing = HeldInterrupts()  # the job's files are written whole, or not at all, before an interrupt
            try:
                record = write(record, measured, planned.run_dir)
                stage = "tracking"
            finally:
                writing.release()
            try:  # the record names its W&B run once the run holds it (tracked)
                tracker.log_record(record, planned.run_dir)
                record = tracked(record, tracker, planned.run_dir)
            except Exception as exc:  # the record stands; a later launch logs it
                record = untracked(record, tracker, exc, planned.run_dir)
            except KeyboardInterrupt as exc:  # the same: the record stands, and the next launch logs it
                untracked(record, tracker, exc, planned.run_dir)
                raise
        except BaseException as exc:
            forget_datastore_builds()
            # a failed write is the machine's (a full disk), never a refusal of the job's input
            refused = stage != "write" and isinstance(exc, (ValueError, OSError, *REFUSALS))
            # measure: greedy equality; gate_measured: the statistical gate at the measured run's prefixes
            failed_gate = isinstance(exc, GateError) and stage in ("gate", "measure", "gate_measured")
            # until its record is written, the folder holds none of this job's files (write_job removes
            # its own when the record's write fails), and the earlier files may go back
            restores = stage != "tracking" and not failed_gate
            restores = restores and restore_earlier
            restores = restores and (restore_other_manifest or _aside_manifest(aside) in (None, planned.manifest_hash))
            stopped = None  # a signal that cut W&B's close short
            try:  # W&B failing here (its service gone) must not replace the job's error nor skip the put-back
                tracker.fail(
                    stage=stage,
                    error=exc,
                    refused=refused,
                    earlier_set_aside=aside is not None and stage != "tracking" and not restores,
                )
            except Exception as track_exc:
                first = (str(track_exc).strip().splitlines() or [""])[0][:300]
                print(
                    f"harness: warning: W&B could not close the failed job's run ({type(track_exc).__name__}: "
                    f"{first}); the job's own error follows",
                    file=sys.stderr,
                )
            except BaseException as stop:  # a Ctrl-C while an online close waits on the network: the close
                stopped = stop  # is abandoned, never the put-back below
                print("harness: W&B's close of the failed job's run was interrupted", file=sys.stderr)
            # a signal while the files go back waits until they are back (file work only: no network call)
            cleanup = HeldInterrupts()
            try:
                host_memory.stop()  # a sampling thread, where there is one, ends with the job
                compile_watch.stop()
                if stage == "tracking_start" and isinstance(tracker, NullTracker) and cfg.tracking.name == "wandb":
                    try:  # stopped while W&B's run opened: the half-made offline run is no run of the arm's
                        discard_offline_runs(planned.run_dir, planned.run_id)
                    except OSError:
                        pass
                if stage != "tracking" and not failed_gate:
                    # refused (a prompt too long, leakage), failed (out of memory, a full disk as the record
                    # was written) or interrupted before this job's record was written: that refutes nothing,
                    # and the earlier files go back. Not after a failed gate (before measuring, or greedy
                    # equality over the measured outputs), whose evidence refutes an earlier record of the round
                    interrupted = isinstance(exc, KeyboardInterrupt)
                    if interrupted and aside is not None and (aside / RECORD_FILENAME).is_file():
                        discard_offline_run(tracker)  # the earlier record's W&B run is the arm's
                    if interrupted:
                        why = "interrupted"
                    elif refused:
                        why = "refused"
                    elif stage == "write":
                        why = "unable to write its record"
                    else:
                        why = "failed before its record was written"
                    if restores:
                        restore_aside(planned.run_dir, aside, why=f"the job was {why}", quiet=moved_note is not None)
                    else:
                        announce_move()  # a record of another manifest stays in .previous/
                else:
                    announce_move()  # the earlier files stay in .previous/
            finally:
                cleanup.release()  # a signal held meanwhile ends the run now
            if stopped is not None and not isinstance(exc, KeyboardInterrupt):
                raise stopped from exc  # asked to stop: the job's own error is its cause
            if stage == "write" and isinstance(exc, OSError):  # reported as an error, not as a refused input
                back = ""
                if aside is not None:
                    kept = (aside / RECORD_FILENAME).exists() or not restores
                    back = f"; {aside} keeps the earlier files" if kept else "; the folder's earlier files are back"
                raise JobWriteError(
                    f"the job ran, but its files could not be written in {planned.run_dir} ({exc}): no record of "
                    f"it is kept{back}"
                ) from exc
            raise
    return record


def user_output_dir_problem(path: str | os.PathLike, key: str = "output_dir") -> str | None:
    """Why ``output_dir=path`` (or the option ``key`` names it by, e.g. ``hydra.run.dir``) would put
    the run's files among others' (None when it would not):

    * ``path`` or a folder above it is a sweep's (it holds ``multirun.yaml``) or a datastore's or
      trained artifact's (``manifest.json``; above ``path``, a datastore's beside its index files);
    * a folder above ``path`` is a run's (it holds ``record.json``): ``harness compare`` and the
      store would count the new run with it;
    * a folder below ``path`` holds a record: the new record would sit above other runs';
    * ``path`` holds files that are no run's (its own record, outputs, ``.hydra/``, log, lock and
      ``.previous/`` are a run's: the same folder given again runs there again)."""
    given = Path(path).expanduser()
    where = f"{key}={path}"
    if (given / "multirun.yaml").is_file():
        return (
            f"{where} is a sweep's folder (it holds multirun.yaml): a single run's record there would be "
            "counted with the sweep's jobs; give the run a folder of its own"
        )
    if (given / MANIFEST_FILE).is_file():
        return (
            f"{where} holds {MANIFEST_FILE}, a datastore's or a trained artifact's: the run's files would "
            "sit among its files; give the run a folder of its own"
        )
    for above in given.resolve().parents:
        if (above / "multirun.yaml").is_file():
            return (
                f"{where} is inside the sweep folder {above} (it holds multirun.yaml): a single run's record "
                "there would be counted with the sweep's jobs; give the run a folder of its own"
            )
        if (above / RECORD_FILENAME).is_file():
            return (
                f"{where} is inside the run folder {above} (it holds {RECORD_FILENAME}): harness compare and "
                "the store would count the new run with that one; give the run a folder of its own"
            )
        if (above / MANIFEST_FILE).is_file() and any((above / name).is_file() for name in (TOKENS_FILE, SA_FILE)):
            return (
                f"{where} is inside the datastore {above} (it holds {MANIFEST_FILE} and its index): the run's "
                "files would sit among its files; give the run a folder of its own"
            )
    if not given.is_dir():
        return None
    below = record_below(given)
    if below is not None:
        return (
            f"{where} holds other runs' records below it ({below.relative_to(given)}): harness compare and the "
            "store would count the new run with them; give the run a folder of its own"
        )
    foreign = foreign_entries(given)
    if foreign:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        return (
            f"{where} holds files that are no run's ({shown}): give an empty or new folder (a run's own folder "
            "may be given again)"
        )
    return None


def put_back_unplanned(
    cfg: DictConfig, run_dir: Path | None, aside: Path, exc: BaseException, *, restore_other_manifest: bool
) -> None:
    """The earlier files a caller (a sweep) set aside in ``aside`` put back into ``run_dir`` for a
    job that stopped (``exc``) before its plan was made: as a job stopped later, in loading, puts
    them back, except a record of another manifest than the job's where ``restore_other_manifest``
    is false (the manifest computed again here; one that cannot be computed holds no record)."""
    if run_dir is None:
        return
    if not restore_other_manifest:
        held = _aside_manifest(aside)
        if held is not None:
            try:
                own = job_manifest_hash(cfg)
            except Exception:
                return
            if held != own:
                return
    why = "interrupted" if isinstance(exc, KeyboardInterrupt) else "refused"
    restore_aside(run_dir, aside, why=f"the job was {why}")


def _aside_manifest(aside: Path | None) -> str | None:
    """The manifest hash of the record among files set aside (None: no readable record)."""
    if aside is None:
        return None
    try:
        return json.loads((aside / RECORD_FILENAME).read_text(encoding="utf-8")).get("manifest_hash")
    except (OSError, ValueError, AttributeError):
        return None


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Checked:
    """Every refusal the config alone decides, before any model, tokenizer or datastore is opened."""

    plan: Plan
    prompts: list[Prompt]  # the workload's prompts, read and checked (not yet tokenized)
    context: ContextLimit  # what every turn's prompt must fit
    kv_bytes_per_token: int
    temp_kv_budget_formula_bytes: int
    run_dir: Path


def check_budget_fits_vocabulary(cfg: DictConfig, budget) -> None:
    """A topology that asks for more children of one node than the target has tokens (a choice
    list's rank, an expansion or Cartesian width, a dynamic tree's top-k) is refused naming the
    option, before any model work."""
    wants = []
    if budget.ranks:
        wants.append(
            (
                "topology.choices" if cfg.topology.get("choices") is not None else "topology.choices_file",
                max(budget.ranks) + 1,
                f"rank {max(budget.ranks)}",
            )
        )
    if budget.widths:  # topology=set keeps its width as max_nodes
        key = "topology.max_nodes" if cfg.topology.name == "set" else "topology.widths"
        wants.append((key, max(budget.widths), "its widest level"))
    if budget.topk:
        wants.append(("topology.topk", int(budget.topk), "its top-k"))
    if not wants:
        return
    vocab = int(model_geometry(cfg.model)["vocab_size"])
    draft_vocab = published_draft_vocab(cfg.proposer) if cfg.proposer.name == "eagle" else None
    for key, need, what in wants:
        if need > vocab:
            raise ConfigError(
                f"{key} asks for {need} children of one node ({what}) but the target's vocabulary has {vocab} "
                f"tokens (model={model_label(cfg.model)})"
            )
        if draft_vocab is not None and need > draft_vocab:
            raise ConfigError(
                f"{key} asks for {need} children of one node ({what}) but the EAGLE-3 draft at "
                f"proposer.artifact={cfg.proposer.artifact} proposes from its {draft_vocab}-token vocabulary "
                "(draft_vocab_size): the rows past it would not be the draft's proposals"
            )


def check_verify_cost(cfg: DictConfig, budget) -> None:
    """A ``proposer.verify_cost`` given to prompt lookup's adaptive budget prices every row count a
    round can verify, t(1) to t(rows + 1) (:func:`verified_rows`); the proposer refused a shorter
    one only once the models had loaded. Prompt lookup as a ``proposer=merged`` source
    (``proposer.prompt_lookup.verify_cost``) is held to its sub-budget's rows alike."""
    prop = cfg.proposer
    if prop.name == "merged" and "prompt_lookup" in (prop.get("sources") or []):
        entries = MergedProposer._source_entries(proposer_options(cfg), budget)
        options, budget = next((sub, sub_b) for name, _, sub, sub_b in entries if name == "prompt_lookup")
        key = "proposer.prompt_lookup.verify_cost"
    elif prop.name == "prompt_lookup":
        options, key = prop, "proposer.verify_cost"
    else:
        return
    if options.get("budget_policy") != "adaptive" or not options.get("verify_cost"):
        return
    rows, capped_by = verified_rows(budget)
    given = list(options["verify_cost"])
    if len(given) < rows + 1:
        why = f" ({capped_by})" if capped_by else ""
        raise ConfigError(
            f"{key}={_text(given)} prices {len(given)} row count(s): a round verifies up to {rows} "
            f"candidate rows{why}, so the adaptive budget needs t(1..{rows + 1}) ({rows + 1} values), or none "
            "(the run measures it)",
            suggestions=[(f"{key}=null",)],
        )


def check_job(cfg: DictConfig, run_dir: Path | None) -> Checked:
    """Values, negotiation, budgets, the output folder (when one is named), the workload's prompts
    and chat template file, the context limit and the temporary-KV budget."""
    check_selected_names(cfg)  # before anything reads the proposer's options by its name
    check_models(cfg)
    plan_ = plan(cfg)
    check_cache_layers(cfg)
    check_budget_fits_vocabulary(cfg, plan_.budget)
    check_verify_cost(cfg, plan_.budget)
    if cfg.tracking.name == "wandb":
        problem = tracking_problem(cfg.tracking.project, cfg.tracking.get("entity"))
        if problem:
            raise ConfigError(problem)
    if run_dir is not None or cfg.output_dir:
        check_output_dir(
            "output_dir" if cfg.output_dir else "the run folder",
            run_dir or cfg.output_dir,
            user_folder_problem=user_output_dir_problem,
        )
    bpt = model_kv_bytes_per_token(cfg.model)
    rows, capped_by = verified_rows(plan_.budget)  # what a round can verify, not an unreachable max_nodes
    try:
        formula = check_temp_kv_budget(
            max_nodes=rows,
            bytes_per_token=bpt,
            budget_bytes=cfg.generation.temp_kv_budget_bytes,
            batch_size=int(cfg.generation.batch_size),
        )
    except ContractError:
        if capped_by is None:
            raise
        raise ContractError(  # named by what caps the rows: lowering topology.max_nodes would change nothing
            f"{rows} candidate rows ({capped_by}) x generation.batch_size={cfg.generation.batch_size} need "
            f"{int(cfg.generation.batch_size) * rows * bpt} bytes of temporary KV ({bpt} bytes per candidate row), "
            f"over generation.temp_kv_budget_bytes={cfg.generation.temp_kv_budget_bytes}"
        ) from None
    prompts = load_configured(cfg.workload)
    chat_template_of(cfg.workload.get("chat_template"))  # a file that cannot be read, before any note on the option
    batch = int(cfg.generation.batch_size)
    if batch > len(prompts):  # every batch would be partial: the record's batch axis would not be what ran
        raise ConfigError(
            f"generation.batch_size={batch} exceeds the workload's {len(prompts)} prompt(s): no batch would be full",
            suggestions=[(f"generation.batch_size={len(prompts)}",)],
        )
    context = plan_context(cfg, rows)
    check_profile_fits(cfg, context)
    check_training_fits(cfg, context)
    check_calibration_config(cfg)
    check_profile_config(cfg)
    check_calibration_prompts(cfg, prompts)
    if cfg.model.name != "tiny" and not cfg.workload.chat:
        multi = next((p for p in prompts if p.n_turns > 1), None)
        if multi is not None:
            raise WorkloadError(
                f"prompt {multi.prompt_id!r} has {multi.n_turns} turns: conversations go through the chat "
                "template; set workload.chat=true"
            )
    return Checked(
        plan=plan_,
        prompts=prompts,
        context=context,
        kv_bytes_per_token=bpt,
        temp_kv_budget_formula_bytes=formula,
        run_dir=Path(run_dir or cfg.output_dir or os.getcwd()),
    )


def check_calibration_prompts(cfg: DictConfig, prompts: list[Prompt]) -> None:
    """``topology=sequoia`` reads the workload's calibration split (with or without
    ``topology.calibration_artifact``) and refuses, once the models have loaded, a calibration prompt
    that is also an evaluated one (:func:`~harness.prepare.calibrate.check_disjoint`): both refused
    here, before any model work, the split read without a tokenizer and the prompts compared by id and
    by content (:attr:`~harness.workloads.prompts.Prompt.fingerprint`). A file without ``"split"``
    fields holds every line in every split."""
    if cfg.topology.name != "sequoia":
        return
    w = cfg.workload
    source = f"workload.path={w.path}" if w.name in ("jsonl", "spec_bench") else f"workload={w.name}"
    where = f"topology=sequoia calibrates on split 'calibration' of {source}"
    try:
        calibration = calibration_items(cfg, None)
        check_disjoint([(p, (p.fingerprint,)) for p, _ in calibration], [(p, (p.fingerprint,)) for p in prompts])
    except (CalibrationError, WorkloadError) as exc:
        raise WorkloadError(f"{where} and evaluates split {w.split!r}: {exc}") from None


def check_profile_fits(cfg: DictConfig, context) -> None:
    """A Sequoia hardware profile times verify forwards of up to ``topology.max_nodes`` rows and the
    root over a ``topology.profile.prefix_len``-token prefix: they must fit the models' positions."""
    t = cfg.topology
    if t.name != "sequoia" or context.positions is None:
        return
    need = int(t.profile.prefix_len) + int(t.max_nodes) + 1
    if need > context.positions:
        room = context.positions - int(t.max_nodes) - 1
        raise ConfigError(
            f"topology.profile.prefix_len={t.profile.prefix_len} + {int(t.max_nodes) + 1} rows (topology.max_nodes "
            f"and the root) exceed the {context.positions:,} positions of {context.limited_by}",
            # a prefix the budget accepts: the draft's pass over the deepest searched tree fits after it
            suggestions=[(f"topology.profile.prefix_len={room}",)]
            if room >= min(int(t.max_depth), int(t.max_nodes)) + 2
            else [],
        )


def check_training_fits(cfg: DictConfig, context) -> None:
    """An artifact trained or searched for this run (no ``proposer.artifact`` given; for layer skip,
    no ``proposer.skip`` either) runs the target over its training documents (``proposer.data.max_len``
    tokens each) or its search prompts and continuations: they must fit the models' positions as the
    run's prompts do."""
    p = cfg.proposer
    if context.positions is None or p.get("artifact"):
        return
    data, search = p.get("data"), p.get("search")
    if data is not None and data.get("max_len") is not None and int(data.max_len) > context.positions:
        raise ConfigError(
            f"proposer.data.max_len={int(data.max_len)} tokens per training document exceed the "
            f"{context.positions:,} positions of {context.limited_by}: training the artifact would run the target "
            "past them",
            suggestions=[(f"proposer.data.max_len={context.positions}",)],
        )
    if search is not None and search.get("max_prompt_tokens") is not None and p.get("skip") is None:
        prompt = int(search.max_prompt_tokens)
        need = prompt + int(search.max_new_tokens) + int(search.depth) + 1
        if need > context.positions:
            fits = context.positions - need + prompt  # the prompt tokens that would fit
            raise ConfigError(
                f"proposer.search.max_prompt_tokens={prompt} + max_new_tokens={int(search.max_new_tokens)} + "
                f"depth={int(search.depth)} + 1 = {need} exceed the {context.positions:,} positions of "
                f"{context.limited_by}: the skip search would run the target past them",
                suggestions=[(f"proposer.search.max_prompt_tokens={fits}",)] if fits >= 1 else [],
            )


#: the budget a proposer's ``check_plan`` is given for `harness train`, which drafts nothing: the
#: checks that read a budget are those of a published checkpoint, which train refuses
TRAINING_BUDGET = Budget(shape="sequence", max_nodes=1, max_depth=1)


def check_training_job(cfg: DictConfig) -> None:
    """What `harness train` refuses before any model work, as `harness run` refuses it for the same
    proposer and target (after :func:`~harness.engine.checks.validate_config`): the target's options
    (:func:`check_models`), the proposer's checks against the target's shape (``check_plan``: an
    early-exit layer inside the target) and its training documents or search turns against the
    target's positions (:func:`check_training_fits`). The generation, topology, verifier and
    workload options, which training does not read, are not held to a run's checks."""
    check_selected_names(cfg)
    check_models(cfg)
    check = getattr(proposer_class(cfg.proposer.name), "check_plan", None)
    if check is not None:
        check(proposer_options(cfg), TRAINING_BUDGET, lambda: model_geometry(cfg.model))
    positions = context_limit(limits=position_limits(cfg), max_new_tokens=0, tree_rows=0, rule=TRUNCATE_REFUSE)
    check_training_fits(cfg, positions)


def plan_job(cfg: DictConfig, run_dir: Path | None) -> Planned:
    """:func:`check_job`, then the frozen manifest (which opens, or builds on first use, a retrieval
    proposer's datastore): every refusal that needs no model."""
    with checkpoint_options(cfg):
        checked = check_job(cfg, run_dir)
        limit = cfg.workload.get("limit")
        if limit is not None and len(checked.prompts) < int(limit):  # a cap, said rather than implied
            print(
                f"harness: note: workload.limit={limit} asks for more prompts than the workload gives "
                f"({len(checked.prompts)}): all {len(checked.prompts)} run",
                file=sys.stderr,
            )
        per_category = cfg.workload.get("per_category")
        if per_category is not None and (limit is None or len(checked.prompts) < int(limit)):
            task_of = per_category_task(cfg.workload.name, list(cfg.workload.get("categories") or ()))
            short = per_category_shortfall(checked.prompts, int(per_category), task_of=task_of)
            if short:  # an unbalanced sample, said rather than implied
                print(
                    f"harness: note: workload.per_category={per_category} asks for more prompts than "
                    + ", ".join(f"{t!r} gives ({k})" for t, k in sorted(short.items()))
                    + ": all of those run",
                    file=sys.stderr,
                )
        manifest = freeze_manifest(cfg, versions=manifest_versions(), extra=manifest_extras(cfg))
    mhash = manifest_hash(manifest)
    budget = checked.plan.budget
    return Planned(
        plan=checked.plan,
        manifest=manifest,
        manifest_hash=mhash,
        run_id=f"{mhash}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}",  # unique within a second too
        round_cfg=RoundConfig(  # the rows a round can verify: what every request's cache reserves past its tokens
            max_nodes=verified_rows(budget)[0],
            max_depth=budget.max_depth,
            temp_kv_budget_bytes=cfg.generation.temp_kv_budget_bytes,
        ),
        kv_bytes_per_token=checked.kv_bytes_per_token,
        temp_kv_budget_formula_bytes=checked.temp_kv_budget_formula_bytes,
        run_dir=checked.run_dir,
        prompts=checked.prompts,
        context=checked.context,
    )


#: why a longrope model's turns stay below original_max_position_embeddings
LONGROPE = (
    ": past original_max_position_embeddings transformers rotates every position by other factors and "
    "generate rebuilds its cache, which a round-by-round cache cannot follow"
)


def plan_context(cfg: DictConfig, tree_rows: int) -> ContextLimit:
    """The positions every turn must fit: the target's and a separate draft model's (config alone)."""
    limit = context_limit(
        limits=position_limits(cfg),
        max_new_tokens=int(cfg.generation.max_new_tokens),
        tree_rows=int(tree_rows),
        rule=truncate_rule(cfg.workload.truncate),
    )
    limit.check_config()
    return limit


def position_limits(cfg: DictConfig) -> list[tuple[str, int | None]]:
    """(which model, its position limit or None) of the target and a separate draft model: their
    positions, sliding attention windows and longrope switches (config alone)."""
    limits = [(f"the target (model={cfg.model.name})", model_position_limit(cfg.model))]
    window = model_attention_window(cfg.model)
    if window is not None:
        limits.append((f"the target's sliding attention window (model={cfg.model.name})", window))
    switch = model_rope_switch(cfg.model)
    if switch is not None:
        limits.append((f"the target's longrope switch to its long factors (model={cfg.model.name}){LONGROPE}", switch))
    d = draft_model_config(cfg)
    if d is not None and d.name != DERIVED:  # a derived draft is cut from the target: its positions
        limits.append((f"the draft model (model={d.name})", model_position_limit(d)))
        window = model_attention_window(d)
        if window is not None:
            limits.append((f"the draft model's sliding attention window (model={d.name})", window))
        switch = model_rope_switch(d)
        if switch is not None:
            limits.append((f"the draft model's longrope switch (model={d.name}){LONGROPE}", switch))
    return limits


# --------------------------------------------------------------------------- load


def load(cfg: DictConfig, planned: Planned) -> Loaded:
    """The target (and a separate draft model when the proposer needs one) and the workload. The
    prompts are encoded and checked against the context limit with the tokenizer alone, before any
    weights are read: a prompt that does not fit is refused without loading a large checkpoint."""

    def check_prompts(tokenizer) -> None:
        vocab = int(model_geometry(cfg.model)["vocab_size"])
        PromptEncoder(tokenizer, chat=bool(cfg.workload.chat), vocab_size=vocab, limit=planned.context).check(
            planned.prompts
        )

    # a hub id read at the commit its manifest bound: another commit's files are never loaded under it
    revisions = {k: (planned.manifest.get(f"{k}_checkpoint") or {}).get("revision") for k in ("target", "draft")}
    pinned = {"revisions": revisions} if any(revisions.values()) else {}
    target, draft = load_models(cfg, before_weights=check_prompts, **pinned)
    device = torch.device(cfg.model.device)
    backend = CausalLMBackend(target.model, device=device)
    if backend.bytes_per_token != planned.kv_bytes_per_token:
        raise GateError(f"KV bytes per token {backend.bytes_per_token} != config-derived {planned.kv_bytes_per_token}")
    for model, model_cfg in ((target, cfg.model), (draft, draft_model_config(cfg))):
        if model is None or model_cfg.name == DERIVED:
            continue
        loaded_limit, planned_limit = config_position_limit(model.model.config), model_position_limit(model_cfg)
        if loaded_limit != planned_limit:
            raise GateError(f"model {model.name}: {loaded_limit} positions loaded != config-derived {planned_limit}")
    eos = eos_ids(target.model, target.tokenizer)
    encoder = PromptEncoder(
        target.tokenizer,
        chat=bool(cfg.workload.chat),
        vocab_size=int(target.model.config.vocab_size),
        eos=eos,
        limit=planned.context,
    )
    first = [encoder.turn(p) for p in planned.prompts]
    return Loaded(
        target=target,
        draft=draft,
        backend=backend,
        draft_backend=(
            CausalLMBackend(draft.model, device=torch.device(draft_model_config(cfg).device))
            if draft is not None
            else None
        ),
        items=[(p, t.ids) for p, t in zip(planned.prompts, first, strict=True)],
        eos=eos,
        encoder=encoder,
        first_turns=first,
    )


def load_models(
    cfg: DictConfig, *, before_weights=None, revisions: dict | None = None
) -> tuple[LoadedModel, LoadedModel | None]:
    """:func:`load_models_of` with a refused checkpoint named by its option (:func:`checkpoint_options`)."""
    with checkpoint_options(cfg):
        return load_models_of(cfg, before_weights=before_weights, revisions=revisions)


def load_models_of(
    cfg: DictConfig, *, before_weights=None, revisions: dict | None = None
) -> tuple[LoadedModel, LoadedModel | None]:
    """The target, and the draft model when the proposer needs a separate one (a hub id at the commit
    ``revisions`` gives for ``target`` or ``draft``: the one its manifest bound).

    A draft checkpoint's tokenizer is read and compared with the target's before any weights are
    read (a mismatch is refused naming the first difference), and ``before_weights(tokenizer)``
    runs then (the target's tokenizer; None for the tiny model); a derived draft is cut from the
    loaded target. Both load whole, each with its own dtype, device and attention implementation
    (the draft's default to the target's)."""
    d = draft_model_config(cfg)
    revisions = revisions or {}
    target_tokenizer = load_tokenizer_of(cfg.model, revision=revisions.get("target"))
    set_chat_template(target_tokenizer, cfg.workload.get("chat_template"))  # the prompts' format, when given
    draft_tokenizer = tokenizer_note = None
    if d is not None and d.name != DERIVED:
        draft_tokenizer = load_tokenizer_of(d, revision=revisions.get("draft"))
        tokenizer_note = check_same_tokenizer(target_tokenizer, draft_tokenizer, draft_ref=d.name_or_path or d.name)
    if before_weights is not None:
        before_weights(target_tokenizer)
    target = _load(cfg.model, tokenizer=target_tokenizer, revision=revisions.get("target"))
    check_reads_the_vocabulary(
        target, target_tokenizer, what=f"the target {cfg.model.name_or_path or cfg.model.name!r}"
    )
    if d is None:
        return target, None
    if d.name == DERIVED:
        draft = derive_draft(
            target,
            num_layers=int(d.num_layers),
            dtype=d.dtype,
            device=d.device,
            attn_implementation=d.attn_implementation,
        )
        apply_model_options(draft, d, key=draft_model_key(cfg))
    else:
        draft = _load(d, tokenizer=draft_tokenizer, key=draft_model_key(cfg), revision=revisions.get("draft"))
        if tokenizer_note is not None:
            draft.load_report["tokenizer_differs"] = tokenizer_note
        check_reads_the_vocabulary(
            draft, target_tokenizer, what=f"the draft {d.name_or_path or d.name!r}", shared=" it shares with the target"
        )
        if tokenizer_note is not None:  # once the draft is taken: a refusal of it is the only line
            print(f"harness: note: {tokenizer_note}", file=sys.stderr)
    return target, draft


@contextmanager
def checkpoint_options(cfg: DictConfig):
    """A refusal of a checkpoint the target or draft config names (``checkpoint '<path>': ...``) named
    by the option that gave it instead (``model.name_or_path=<path>: ...``, the draft's key for a draft)."""
    try:
        yield
    except CheckpointError as exc:
        text = str(exc)
        d = draft_model_config(cfg)
        for key, m in (("model", cfg.model), (draft_model_key(cfg), d)):
            source = m.get("name_or_path") if m is not None else None
            prefix = f"checkpoint {str(source)!r}"
            if source and text.startswith(prefix):
                raise CheckpointError(f"{key}.name_or_path={source}{text[len(prefix) :]}") from exc.__cause__
        raise


def check_reads_the_vocabulary(model: LoadedModel, tokenizer, *, what: str, shared: str = "") -> None:
    """A model must embed every id its tokenizer produces: a smaller embedding matrix than the
    tokenizer's length cannot read prompts or answers holding the ids past it (it failed with an
    index error in the first forward). A larger one, or a target padded differently from its draft,
    is fine: proposals keep to the range all share."""
    if tokenizer is None:
        return
    rows = int(model.model.get_input_embeddings().weight.shape[0])
    if rows < len(tokenizer):
        raise CheckpointError(
            f"{what} embeds {rows} token ids but the tokenizer{shared} has {len(tokenizer)}: prompts and answers "
            "can hold ids it cannot read; use a checkpoint whose vocabulary covers its tokenizer"
        )


def _load(m: DictConfig, *, tokenizer=None, key: str = "model", revision: str | None = None) -> LoadedModel:
    try:
        loaded = load_model(
            name=m.name,
            name_or_path=m.name_or_path,
            dtype=m.dtype,
            device=m.device,
            seed=m.seed,
            num_layers=m.num_layers,
            attn_implementation=m.attn_implementation,
            tiny=OmegaConf.to_container(m.tiny, resolve=True),
            trust_remote_code=m.trust_remote_code,
            tokenizer=tokenizer,
            revision=revision,
        )
    except CheckpointError as exc:
        lacking = re.search(r"(\w+) does not support an attention implementation", str(exc))
        if lacking is None or m.attn_implementation == "eager":
            raise
        raise CheckpointError(
            f"{key}.attn_implementation={m.attn_implementation}: {m.name_or_path or m.name}'s {lacking.group(1)} has "
            f"no such attention in this transformers version; set {key}.attn_implementation=eager (its tree masks "
            "are checked by the equivalence gate as any other)"
        ) from exc
    return apply_model_options(loaded, m, key=key)


def draft_model_key(cfg: DictConfig) -> str:
    """The config key of the draft model, for messages."""
    return "proposer.draft_model.model" if cfg.proposer.name == "merged" else "proposer.model"


def check_models(cfg: DictConfig) -> None:
    """Refuse a draft model configuration before any model work: truncation asked of a
    checkpoint (or of the target), a derived draft without a valid layer count, a checkpoint draft
    without a path; target options (``model.linear_kernel``, ``model.compile``,
    ``model.static_cache``, ``model.cudnn_attention``) this machine cannot honour; a target and draft
    that ask for different values of the process-wide cuDNN attention switch."""
    check_model_options(cfg.model, "model")
    if cfg.model.num_layers is not None:
        raise CheckpointError(
            f"model.num_layers={cfg.model.num_layers}: the target loads whole; layer truncation applies only to "
            "a derived draft (proposer.model.name=derived proposer.model.num_layers=k)"
        )
    d = draft_model_config(cfg)
    if d is None:
        return
    key = draft_model_key(cfg)
    check_model_options(d, key)
    ours = resolve_cudnn_attention(cfg.model.get("cudnn_attention"), cfg.model.device)
    theirs = resolve_cudnn_attention(d.get("cudnn_attention"), d.device)
    if None not in (ours, theirs) and ours != theirs:
        raise ConfigError(
            f"model.cudnn_attention={str(ours).lower()} and {key}.cudnn_attention={str(theirs).lower()}: "
            "PyTorch's switch for cuDNN attention is process-wide, so the target and its draft share one value; "
            "set them alike"
        )
    if d.name == DERIVED:
        if d.num_layers is None:
            raise CheckpointError(f"{key}.name=derived needs {key}.num_layers=<k>: the target's first k layers")
        total = model_geometry(cfg.model)["num_hidden_layers"]
        if not 1 <= int(d.num_layers) <= total:
            fit = max(1, round(total / 5)) if int(d.num_layers) > total else 1  # the default's share of SmolLM2's 30
            raise ConfigError(
                f"{key}.num_layers must be in [1, {total}] for this {total}-layer target; got {d.num_layers}"
                + (" (the derived draft's default, for SmolLM2's 30 layers)" if int(d.num_layers) == 6 else "")
                + (
                    f"; about a fifth of the target's layers, as the default is of SmolLM2's, is {fit}, and {total} "
                    "is the whole target (it proposes its own tokens at its own cost)"
                    if int(d.num_layers) > total
                    else ""
                ),
                suggestions=[(f"{key}.num_layers={fit}",)],
            )
        own = {k: v for k, v in d.tiny.items() if v != cfg.model.tiny.get(k)}  # they follow the target's unless set
        if own:
            first = sorted(own)[0]
            raise CheckpointError(
                f"{key}.tiny.{first}={own[first]} does not apply to {key}.name=derived, which is cut from "
                f"the target (model.tiny.{first}={cfg.model.tiny.get(first)}); use {key}.name=tiny for a "
                "separate tiny draft"
            )
        return
    if d.num_layers is not None:
        raise CheckpointError(
            f"{key}.num_layers={d.num_layers} applies only to {key}.name=derived (the target's first k layers); "
            f"a draft given by name or path loads whole: drop {key}.num_layers"
        )
    if d.name not in ("tiny", "smollm2") or d.name_or_path:
        if d.name == "hf" and not d.name_or_path:
            raise CheckpointError(f"{key}.name=hf needs {key}.name_or_path=<a checkpoint folder or a hub id>")
        problem = checkpoint_ref_problem(d.name_or_path or d.name, f"{key}.name_or_path")
        if problem:
            raise CheckpointError(problem)


def check_cache_layers(cfg: DictConfig) -> None:
    """Refuse a target or draft checkpoint whose cache layers cannot be rolled back to the accepted
    path, or whose attention reads positions from cache slots (read from its config, once the paths
    are checked)."""
    models = [(cfg.model, "model")]
    d = draft_model_config(cfg)
    if d is not None:
        models.append((d, draft_model_key(cfg)))
    for m, key in models:
        named = f"{key}.name_or_path" if m.get("name_or_path") else f"{key}.name"
        problem = cache_layer_problem(m, named) or position_bias_problem(m, named)
        if problem:
            raise CheckpointError(problem)


def _keyed(problem: str, key: str) -> str:
    """A model option's refusal with every ``model.`` option named at ``key`` (a draft's own)."""
    return re.sub(r"(?<![\w.])model\.", f"{key}.", problem)


#: the attention implementations a candidate tree's mask reaches (a boolean or additive mask per
#: query row); flash kernels take no such mask, and flex attention's block masks crashed the verify forward
TREE_ATTENTION = ("sdpa", "harness_sdpa", "eager")


def known_attention() -> set[str]:
    """The attention implementations transformers registers (flash, flex, paged, sdpa; eager is built in)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return {"eager", *(part for name in ALL_ATTENTION_FUNCTIONS.keys() for part in name.split("|"))}


def check_model_options(m: DictConfig, key: str, *, here: bool = True) -> None:
    """Refuse a model option this machine cannot honour, before any model work (one line each).
    ``here=False``: the job runs on another machine (a cluster's), so only what its device rules
    out wherever it runs is refused (a CPU kernel on a GPU); what needs this machine is the job's."""
    attention = str(m.get("attn_implementation", "sdpa"))
    if attention not in TREE_ATTENTION and attention not in known_attention():
        raise ConfigError(
            f"{key}.attn_implementation={attention} is no attention implementation transformers knows; a run "
            f"takes {', '.join(TREE_ATTENTION)}",
            suggestions=[(f"{key}.attn_implementation=sdpa",)],
        )
    if attention not in TREE_ATTENTION:
        raise ConfigError(
            f"{key}.attn_implementation={attention}: a verify forward gives each candidate row its own attention "
            f"mask, which only {', '.join(TREE_ATTENTION)} take",
            suggestions=[(f"{key}.attn_implementation=sdpa",)],
        )
    if not here and torch.device(str(m.device)).type == "cpu":  # the kernels are probed on the machine that runs them
        return
    problem = linear_kernel_problem(m.get("linear_kernel", "auto"), resolve_dtype(m.dtype), m.device)
    if problem:
        raise ConfigError(_keyed(problem, key), suggestions=[(f"{key}.linear_kernel=default",)])
    if m.get("compile") and here:
        problem = compile_problem(m.device)
        if problem:
            raise ConfigError(_keyed(problem, key), suggestions=[(f"{key}.compile=false",)])
    if m.get("fused_layers"):
        static = resolve_static_cache(m.get("static_cache"), bool(m.get("compile")))
        problem = fused_layers_problem(
            resolve_dtype(m.dtype),
            m.device,
            compiled=bool(m.get("compile")),
            static_cache=static,
            attn_implementation=str(m.get("attn_implementation", "sdpa")),
        )
        if problem:
            raise ConfigError(_keyed(problem, key), suggestions=[(f"{key}.fused_layers=false",)])
    if not here:
        return
    problem = cudnn_attention_problem(m.get("cudnn_attention"), m.device)
    if problem:
        raise ConfigError(_keyed(problem, key), suggestions=[(f"{key}.cudnn_attention=null",)])


def apply_model_options(loaded: LoadedModel, m: DictConfig, *, key: str = "model") -> LoadedModel:
    """The configured linear kernel, cache layout, fused layers, cuDNN attention (on CUDA; a process-wide
    switch), then ``torch.compile``, applied to a loaded model in place (``m`` at config key ``key``,
    for messages); the load report records how many decoder layers run fused, which of the native
    kernels' code paths this machine's build takes where they run (``native_code_paths``) and, where
    the linear kernel is ``streaming_panels``, the bytes of the packed copies it made at once (refused
    in one line where they would not fit in the memory available)."""
    apply_linear_kernel(loaded.model, m.get("linear_kernel", "auto"), compiled=bool(m.get("compile")))
    if linear_kernel_of(loaded.model) == {"streaming_panels"}:  # the copies made now, refused if they cannot fit
        loaded.load_report["packed_weight_bytes"] = pack_weights(
            loaded.model, key=key, kernel=str(m.get("linear_kernel", "auto"))
        )
    apply_static_cache(loaded.model, resolve_static_cache(m.get("static_cache"), bool(m.get("compile"))))
    loaded.load_report["fused_layers"] = fused = apply_fused_layers(loaded.model, resolved_fused_layers(m))
    if m.get("fused_layers") is True and fused < len(decoder_layers(loaded.model)):  # asked, not done
        why = next((r for r in map(fusable, decoder_layers(loaded.model)) if r is not None), "no decoder layers")
        raise CheckpointError(
            f"{key}.fused_layers=true, but {fused} of {len(decoder_layers(loaded.model))} decoder layers of "
            f"{loaded.source!r} can run as the native layer ({why}): set {key}.fused_layers=false (or leave it unset)"
        )
    loaded.load_report["fused_stack"] = fused_stack_of(loaded.model)
    if fused or linear_kernel_of(loaded.model) & {"streaming", "streaming_panels"}:  # the native kernels run
        loaded.load_report["native_code_paths"] = native_code_paths()
    apply_cudnn_attention(resolve_cudnn_attention(m.get("cudnn_attention"), m.device))
    if m.get("compile"):
        compile_model(loaded.model)
    return loaded


def partial_batch_note(prompts: int, batch_size: int) -> str | None:
    """The line saying the last batch runs fewer requests than ``batch_size``, or None."""
    if batch_size > 1 and prompts > batch_size and prompts % batch_size:
        return (
            f"{prompts} prompts at generation.batch_size={batch_size}: the last batch holds {prompts % batch_size} "
            "request(s), and its rounds are timed with the others (metrics.batch_requests)"
        )
    return None


def oversubscribed_threads_note(configured: int | None, threads: int, cpus: int | None = None) -> str | None:
    """The line saying the job's ``threads`` exceed the CPUs this process may run on (``cpus``:
    :func:`~harness.measure.hardware.usable_cpus`), or None. A note, not a refusal: the machine
    that composes a job (a cluster's login node) need not be the one that runs it."""
    cpus = usable_cpus() if cpus is None else int(cpus)
    if threads <= cpus:
        return None
    asked = f"threads={configured}" if configured else f"torch's default of {threads} threads (threads=null)"
    return (
        f"{asked} exceeds the {cpus} CPU(s) this process may run on: the threads take turns on them, and every "
        f"time recorded counts their waits (threads={cpus} runs one per CPU)"
    )


def templated_text_note(cfg: DictConfig, prompts: Sequence[Prompt]) -> str | None:
    """A JSONL file's ``"prompt"`` lines go through the chat template (``workload.chat``, true by
    default) as one user message: said once, since a completion prompt (code to continue) would
    otherwise be answered as a request without a word."""
    if cfg.workload.name != "jsonl" or not cfg.workload.chat or cfg.model.name == "tiny":
        return None
    texts = sum(1 for p in prompts if p.text is not None and p.messages is None and p.turns is None)
    if not texts:
        return None
    return (
        f'{texts} "prompt" line(s) of {cfg.workload.path} go to the model as a user message through its chat '
        "template (workload.chat=true); workload.chat=false gives their text as it is, to be continued"
    )


#: proposers whose trained artifact learns from ShareGPT text formatted by ``proposer.data.chat``
_TRAINED_ON_TEXT = ("medusa", "hydra", "clover", "eagle", "early_exit")


def training_text_note(cfg: DictConfig) -> str | None:
    """A proposer trained here (heads, an EAGLE draft, an early-exit adapter) on text formatted
    otherwise than the workload's prompts (``proposer.data.chat`` against ``workload.chat``), or a
    skip vector searched on another workload or formatting than the one measured: said once, since
    its acceptance then measures the transfer as much as the method. A proposer given an artifact
    (``proposer.artifact``) or explicit layers (``proposer.skip``) is not trained here."""
    p, w = cfg.proposer, cfg.workload
    if cfg.model.name == "tiny" or p.get("artifact"):  # no chat template; or trained elsewhere
        return None
    raw = {True: "through the chat template", False: "as plain text"}
    if p.name in _TRAINED_ON_TEXT and "data" in p and bool(p.data.chat) != bool(w.chat):
        return (
            f"proposer={p.name} trains on {p.data.source} text {raw[bool(p.data.chat)]} "
            f"(proposer.data.chat={str(bool(p.data.chat)).lower()}) and measures prompts {raw[bool(w.chat)]} "
            f"(workload.chat={str(bool(w.chat)).lower()}); proposer.data.chat={str(bool(w.chat)).lower()} "
            "trains on text formatted as the prompts"
        )
    if p.name == "layer_skip" and p.get("skip") is None:
        s = p.search
        if s.workload != w.name or bool(s.chat) != bool(w.chat):
            return (
                f"proposer=layer_skip searches its skip vector on {s.workload} prompts {raw[bool(s.chat)]} "
                f"(proposer.search.workload={s.workload}, proposer.search.chat={str(bool(s.chat)).lower()}) and "
                f"measures {w.name} prompts {raw[bool(w.chat)]}"
                + (
                    f"; proposer.search.workload={w.name} proposer.search.chat={str(bool(w.chat)).lower()} "
                    "searches on the measured kind of prompt"
                    if w.name in ("humaneval", "sharegpt")
                    else ""
                )
            )
    return None


def whole_target_draft_note(cfg: DictConfig) -> str | None:
    """A derived draft of every layer of the target (the tiny target's default) is the target itself:
    said once, since its acceptance and speedup then measure the machinery, not a draft."""
    d = draft_model_config(cfg)
    if d is None or d.name != DERIVED or d.num_layers is None:
        return None
    total = int(model_geometry(cfg.model)["num_hidden_layers"])
    if int(d.num_layers) < total:
        return None
    return (
        f"{draft_model_key(cfg)}.num_layers={d.num_layers}: the derived draft is the whole {total}-layer target, "
        "proposing the target's own tokens at the target's cost (a check of the machinery, not a draft's speedup)"
    )


def compiled_panels_notes(cfg: DictConfig) -> list[str]:
    """A compiled forward with ``linear_kernel=streaming_panels`` named explicitly (``auto`` never picks
    it for a compiled forward): the check that a weight's packed copy is current runs outside the
    graph, so every linear layer breaks it; said once per model, since the compiled forward then
    measures the breaks as much as the kernel."""
    models = [("model", cfg.model)]
    if (draft := draft_model_config(cfg)) is not None:
        models.append((draft_model_key(cfg), draft))
    return [
        f"{key}.linear_kernel=streaming_panels with {key}.compile=true: the packed weights are checked outside "
        "the compiled graph, a graph break at every linear layer (the compiled forward runs in pieces; "
        f"{key}.linear_kernel=auto picks streaming when compiled)"
        for key, m in models
        if m.get("compile") and m.get("linear_kernel") == "streaming_panels"
    ]


def _compiled(loaded: Loaded) -> bool:
    """Whether the target or the draft runs a ``torch.compile``d forward."""
    models = [loaded.target] + ([loaded.draft] if loaded.draft is not None else [])
    return any(getattr(m.model, "_harness_compiled", False) for m in models)


#: the topology options each topology reads (beyond max_nodes and max_depth)
_TOPOLOGY_READERS = {"widths": ("expansion", "cartesian"), "topk": ("dynamic",), "tree_artifact": ("sequoia",)}


def inert_options(cfg: DictConfig) -> list[str]:
    """The options set away from their defaults that change nothing in this combination, each as
    ``key=value: why`` (the runner notes them at start and the record lists them under
    ``inert_options``): a sweep may cross them with a setting that ignores them, so they are not
    refused, but no record claims an effect that did not happen."""
    out: list[str] = []
    gen, topo, prop = cfg.generation, cfg.topology, cfg.proposer
    if float(gen.temperature) == 0.0:
        greedy = "temperature 0 decodes the argmax"
        if float(gen.top_p) < 1.0:  # 1: no nucleus truncation
            out.append(f"generation.top_p={gen.top_p}: {greedy}")
        if int(gen.top_k) > 0:  # 0: no top-k truncation
            out.append(f"generation.top_k={gen.top_k}: {greedy}")
        if cfg.gates.get("skip_statistical") and cfg.gates.get("enabled", True):
            out.append("gates.skip_statistical=true: the statistical gate tests sampled rounds (temperature > 0)")
        if not cfg.gates.get("statistical", True) and cfg.gates.get("enabled", True):
            out.append("gates.statistical=false: the statistical gate tests sampled rounds (temperature > 0)")
        if cfg.gates.get("enabled", True):
            out += [
                f"gates.{k}={_text(v)}: the statistical gate tests sampled rounds (temperature > 0)"
                for k, v in _changed(cfg.gates)
                if k in STATISTICAL_GATE_OPTIONS
            ]
    else:
        near_tie = dict(_changed(cfg.gates)).get("near_tie_max_fraction")
        if int(gen.top_k) != 1 and near_tie is not None and cfg.gates.get("enabled", True):
            out.append(
                f"gates.near_tie_max_fraction={near_tie}: the greedy-equality gate compares deterministic outputs "
                "(temperature 0, or generation.top_k=1)"
            )
        if int(gen.top_k) == 1:
            out.append(f"generation.temperature={gen.temperature}: top_k=1 keeps the argmax at any temperature")
            if float(gen.top_p) < 1.0:
                out.append(f"generation.top_p={gen.top_p}: top_k=1 keeps the argmax, which every nucleus holds")
        vocab = int(model_geometry(cfg.model)["vocab_size"])
        if int(gen.top_k) >= vocab:
            out.append(f"generation.top_k={gen.top_k}: the vocabulary has {vocab} ids, so top-k truncates nothing")
    if not cfg.gates.get("enabled", True):
        out += [
            f"gates.{k}={_text(v)}: gates.enabled=false runs no gate" for k, v in _changed(cfg.gates) if k != "enabled"
        ]
    if not gen.get("exact", True) and get_verifier(str(cfg.verifier.name)).exact:
        out.append(
            f"generation.exact=false: verifier={cfg.verifier.name} is exact (the option admits a heuristic verifier)"
        )
    warmup = dict(_changed(gen)).get("warmup_tokens")
    if warmup is not None and int(warmup) > int(gen.max_new_tokens):
        out.append(
            f"generation.warmup_tokens={warmup}: the warm-up generates at most generation.max_new_tokens="
            f"{gen.max_new_tokens} tokens (a measured turn's length)"
        )
    for key, m in models_in_use(cfg):
        out += _model_inert_options(key, m, target=None if key == "model" else cfg.model)
    if cfg.tracking.name == "none":
        out += [
            f"tracking.{k}={_text(v)}: tracking=none logs nothing" for k, v in _changed(cfg.tracking) if k != "name"
        ]
    elif not cfg.tracking.get("system_metrics", True):
        interval = dict(_changed(cfg.tracking)).get("system_metrics_interval_s")
        if interval is not None:
            out.append(
                f"tracking.system_metrics_interval_s={interval}: tracking.system_metrics=false samples no system "
                "metrics"
            )
    if cfg.get("allow_leakage"):
        unchecked = leakage_unchecked(cfg)
        if unchecked is not None:
            out.append(f"allow_leakage=true: {unchecked}, so no leakage check runs")
    w = cfg.workload
    if w.get("path") is not None and w.name not in ("jsonl", "spec_bench"):
        out.append(
            f"workload.path={w.path}: workload={w.name} reads its own prompts (jsonl and spec_bench read a file)"
        )
    if w.name == "sharegpt" and not w.get("chat", True):
        out.append("workload.chat=false: ShareGPT prompts are chat messages, always put through the chat template")
    if w.get("chat_template") is not None and not w.get("chat", True) and w.name == "humaneval":  # text prompts
        out.append(f"workload.chat_template={w.chat_template}: workload.chat=false tokenizes the prompts as they are")
    if w.get("chat_template") is not None and cfg.model.name == "tiny":
        out.append(f"workload.chat_template={w.chat_template}: model=tiny has no tokenizer (prompts are token ids)")
    workload_set = dict(_changed_from_packaged(w, "workload"))
    if "chat" in workload_set and w.chat and cfg.model.name == "tiny":
        out.append("workload.chat=true: model=tiny has no tokenizer (prompts are token ids)")
    for key in ("rest_corpus", "rest_exclude"):
        if key in workload_set:
            unread = _unread_workload_datastore_option(cfg, key)
            if unread is not None:
                out.append(f"workload.{key}={w[key]}: {unread}")
    if topo.get("sources"):
        out.append(
            f"topology.sources={_text(topo.sources)}: no topology reads it (proposer=merged takes proposer.sources)"
        )
    if topo.name == "sequoia" and topo.get("tree_artifact") and not topo.get("reuse", True):
        out.append("topology.reuse=false: topology.tree_artifact names the tree, nothing is measured or searched")
    decided = checkpoint_decides(prop)
    if prop.name in ("medusa", "hydra", "clover") and topo.name == "sequence" and "max_depth" in dict(_changed(topo)):
        heads = inspect_published(str(prop.artifact), prop.name).num_heads if decided else int(prop.num_heads)
        if int(topo.max_depth) > heads:
            out.append(
                f"topology.max_depth={topo.max_depth}: the {prop.name} bank has {heads} heads, one per depth, so the "
                f"chain drafts {min(heads, int(topo.max_nodes))} deep"
            )
    if topo.name == "expansion" and prop.get("sampling") != "iid":  # distinct siblings fill levels in order
        unreached = unreached_level([int(w) for w in topo.widths], int(topo.max_nodes))
        if unreached is not None:
            out.append(
                f"topology.widths={_text(topo.widths)}: topology.max_nodes={topo.max_nodes} candidate rows are "
                f"filled before depth {unreached}, so its levels from there are never drafted"
            )
    topology_set = dict(_changed_from_packaged(topo, "topology"))
    widths = tuple(int(w) for w in topo.widths)
    shaped = None  # a budget whose shape may hold fewer rows than topology.max_nodes
    if topo.name == "sequence":
        shaped = Budget("sequence", int(topo.max_nodes), int(topo.max_depth))
    elif topo.name == "expansion" and widths:
        shaped = Budget("expansion", int(topo.max_nodes), len(widths), widths=widths)
    if shaped is not None and "max_nodes" in topology_set:
        rows, capped_by = verified_rows(shaped)
        if capped_by is not None:
            out.append(f"topology.max_nodes={topo.max_nodes}: {capped_by} (a round verifies at most {rows} rows)")
    if (
        "max_depth" in topology_set
        and topo.name in ("expansion", "cartesian")
        and 0 < len(widths) < int(topo.max_depth)
    ):
        out.append(  # their budgets are len(widths) deep
            f"topology.max_depth={topo.max_depth}: topology={topo.name} drafts the {len(widths)} levels of "
            f"topology.widths={_text(topo.widths)}"
        )
    if topo.name == "set" and int(topo.max_depth) != 1:
        out.append(f"topology.max_depth={topo.max_depth}: topology=set drafts one level of siblings (depth 1)")
    if prop.name == "prompt_lookup" and topo.name == "sequence" and "max_matches" in dict(_changed(prop)):
        out.append(f"proposer.max_matches={prop.max_matches}: topology=sequence takes one match (one chain)")
    if decided:
        why = f"proposer.artifact={prop.artifact} is a published checkpoint, read as its authors ship it"
        for key, value in _changed(prop):
            if key not in decided:
                continue
            if OmegaConf.is_config(value):  # data, train: each option set in them
                out += [f"proposer.{key}.{k}={_text(v)}: {why} (nothing is trained)" for k, v in _changed(value)]
            elif key in TRAINING_OPTIONS:
                out.append(f"proposer.{key}={_text(value)}: {why} (nothing is trained)")
            else:
                out.append(f"proposer.{key}={_text(value)}: {why} (its shape is read from its files)")
    if prop.name in ("medusa", "hydra", "clover") and not decided:
        inert = heads_inert_options(str(prop.name), OmegaConf.to_container(prop, resolve=True))
        out += [f"proposer.{k}={_text(v)}: {inert[k]}" for k, v in _changed_from_packaged(prop) if k in inert]
    for key, readers in _TOPOLOGY_READERS.items():
        value = topo.get(key)
        if value not in (None, 0, []) and topo.name not in readers and not (key == "widths" and not list(value)):
            out.append(
                f"topology.{key}={_text(value)}: topology={topo.name} does not read it (only {', '.join(readers)})"
            )
    if prop.name == "layer_skip" and prop.get("skip") is not None and prop.get("search") is not None:
        for key, value in _changed(prop.search):
            out.append(f"proposer.search.{key}={_text(value)}: proposer.skip names the layers, no search runs")
    threshold = prop.get("threshold") if prop.name == "layer_skip" else None
    if threshold is not None and not threshold.get("adaptive", True):
        for key, value in _changed(threshold):
            if key not in ("gamma", "adaptive"):  # the EMA's settings: a fixed gamma follows nothing
                out.append(
                    f"proposer.threshold.{key}={_text(value)}: proposer.threshold.adaptive=false keeps gamma fixed"
                )
    if prop.name == "rest" or (prop.name == "prompt_lookup" and prop.get("datastore") is not None):
        out += path_inert_options(prop.datastore, "proposer.datastore")
    elif prop.name == "merged":
        sources = list(prop.get("sources") or [])
        if "rest" in sources:
            out += path_inert_options(prop.rest.datastore, "proposer.rest.datastore")
        if "prompt_lookup" in sources and prop.prompt_lookup.get("datastore") is not None:
            out += path_inert_options(prop.prompt_lookup.datastore, "proposer.prompt_lookup.datastore")
        default_depths = OmegaConf.get_type(prop)().depths
        for src in sources:
            depth = prop.depths.get(src)
            if depth is not None and depth != default_depths.get(src) and int(depth) > int(topo.max_depth):
                out.append(f"proposer.depths.{src}={depth}: topology.max_depth={topo.max_depth} caps every source")
        left_out = f"proposer.sources={_text(sources)} leaves it out"
        for src in MERGED_SUB_CONFIGS:
            if src not in sources:
                out += [f"proposer.{src}.{k}={_text(v)}: {left_out}" for k, v in _changed_from_packaged(prop[src])]
                depth = prop.depths.get(src)
                if depth is not None and depth != OmegaConf.get_type(prop)().depths.get(src):
                    out.append(f"proposer.depths.{src}={depth}: {left_out}")
    lookups = [(prop, "proposer.")] if prop.name == "prompt_lookup" else []
    if prop.name == "merged" and "prompt_lookup" in (prop.get("sources") or []):
        lookups.append((prop.prompt_lookup, "proposer.prompt_lookup."))
    for lookup, at in lookups:
        if lookup.get("verify_cost") and lookup.get("budget_policy", "fixed") != "adaptive":
            out.append(
                f"{at}verify_cost={_text(lookup.verify_cost)}: the fixed budget prices no rows "
                f"({at}budget_policy=adaptive reads it)"
            )
    return out


def leakage_unchecked(cfg: DictConfig) -> str | None:
    """Why no workload-leakage check (the gate ``allow_leakage=true`` lets a leak through) can run
    for the configured proposer, known from the config: its class has none (it reads no datastore
    and runs no artifact trained here), prompt lookup searches no datastore, or a published
    checkpoint runs (no training text here to look prompts up in); None where a check runs, or may
    (an artifact trained here: whether its training text can be had is known once it loads, and
    :func:`gate_inert_options` says so then). A merged tree checks its sources."""

    def why_not(name: str, node: DictConfig | None) -> str | None:
        if node is None or name not in PROPOSERS:
            return None
        if proposer_class(name).check_workload is Proposer.check_workload:
            return f"proposer={name} reads no datastore and runs no artifact trained here"
        if name == "prompt_lookup" and node.get("datastore") is None:
            return "proposer=prompt_lookup searches no datastore"
        if checkpoint_decides(node):
            return f"proposer.artifact={node.artifact} is a published checkpoint, trained on no text held here"
        return None

    prop = cfg.proposer
    if prop.name != "merged":
        return why_not(str(prop.name), prop)
    sources = [str(s) for s in prop.get("sources") or []]
    reasons = [why_not(s, prop.get(s)) for s in sources]
    if sources and all(r is not None for r in reasons):
        return f"no source of proposer.sources={_text(sources)} has one ({'; '.join(reasons)})"
    return None


def gate_inert_options(cfg: DictConfig, gates: dict) -> list[str]:
    """The options the gates found inert that the config alone could not tell (:func:`inert_options`
    lists the others): ``allow_leakage=true`` where the workload-governance gate did not apply (an
    artifact whose training text cannot be had)."""
    entry = gates.get("workload_governance") or {}
    if not cfg.get("allow_leakage") or entry.get("status") != "not_applicable" or leakage_unchecked(cfg):
        return []
    return [f"allow_leakage=true: the leakage check does not apply ({entry.get('why', 'not applicable')})"]


#: the gates' options that only the statistical gate (temperature > 0) reads
STATISTICAL_GATE_OPTIONS = ("chi2_samples", "chi2_top_m", "chi2_alpha")


def _changed(node) -> list[tuple[str, Any]]:
    """The ``(key, value)`` pairs of a structured config node set away from its schema's defaults
    (none for a node without a dataclass schema)."""
    kind = OmegaConf.get_type(node) if node is not None else None
    if not dataclasses.is_dataclass(kind):
        return []
    defaults = kind()
    return [(k, node[k]) for k in node if node[k] != getattr(defaults, k, node[k])]


#: the proposers whose options ``proposer=merged`` carries as sub-configs (read when one is a source)
MERGED_SUB_CONFIGS = ("rest", "prompt_lookup", "draft_model")


def _changed_from_packaged(node: DictConfig, group: str = "proposer") -> list[tuple[str, Any]]:
    """The ``(dotted key, value)`` pairs of a config node of ``group`` (``proposer``, ``topology``,
    ``workload``) set away from what its packaged option composes to (``conf/<group>/<name>.yaml``
    over its schema's defaults), compared as written (interpolations unresolved)."""
    kind = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(kind):
        return []
    packaged = OmegaConf.load(Path(__file__).parent / "conf" / group / f"{node.name}.yaml")
    packaged.pop("defaults", None)
    reference = _leaves(OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(kind), packaged), resolve=False))
    missing = object()
    return [
        (k, v)
        for k, v in _leaves(OmegaConf.to_container(node, resolve=False)).items()
        if reference.get(k, missing) != v
    ]


def _unread_workload_datastore_option(cfg: DictConfig, key: str) -> str | None:
    """Why ``workload.<key>`` (``rest_corpus``, ``rest_exclude``: the datastore of the workload's
    domain, for a datastore option that reads it as ``${workload.<key>}``) changes nothing here, or
    None where a datastore the proposer searches reads it."""
    sources = datastore_sources(cfg)
    if not sources:
        return f"proposer={cfg.proposer.name} searches no datastore"
    reference = f"workload.{key}"
    for node, _, _ in sources.values():
        written = _leaves(OmegaConf.to_container(node, resolve=False))
        if any(isinstance(v, str) and reference in v for v in written.values()):
            return None
    return f"no datastore the proposer searches reads it (one does where its corpus or exclude is ${{{reference}}})"


def _leaves(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested dict's leaves by dotted key (an empty dict is a leaf)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _model_inert_options(key: str, m: DictConfig, *, target: DictConfig | None = None) -> list[str]:
    """The options of a model config (at ``key``) that its model ignores: the tiny model's seed and
    shape for a checkpoint, remote code for the built-in models, cuDNN attention off CUDA. A draft's
    (``target``: the target's config) is not noted where it only follows the target's, noted there."""
    out = []

    def own(name: str, value: Any) -> bool:  # set on this model, not only followed from the target's
        if target is None:
            return True
        theirs = (
            target.get("tiny", {}).get(name.removeprefix("tiny.")) if name.startswith("tiny.") else target.get(name)
        )
        return value != theirs

    if m.name not in ("tiny", "derived"):  # a derived draft's fields follow the target's (refused when set apart)
        why = f"{key}.name={m.name} loads its weights; the tiny model's options shape only {key}.name=tiny"
        if int(m.get("seed", 0)) != 0 and own("seed", m.get("seed")):
            out.append(f"{key}.seed={m.seed}: {why}")
        out += [
            f"{key}.tiny.{name}={_text(value)}: {why}"
            for name, value in _changed(m.get("tiny"))
            if own(f"tiny.{name}", value)
        ]
    if m.get("trust_remote_code") and m.name in ("tiny", "smollm2", "derived") and not m.get("name_or_path"):
        out.append(f"{key}.trust_remote_code=true: {key}.name={m.name} runs no code from a checkpoint")
    if m.name == DERIVED and target is not None and int(m.get("seed", 0)) != int(target.get("seed", 0)):
        out.append(f"{key}.seed={m.seed}: a derived draft copies the target's first layers, weights included")
    followed = target is not None and m.get("cudnn_attention") == target.get("cudnn_attention")
    if m.get("cudnn_attention") is not None and torch.device(str(m.device)).type != "cuda" and not followed:
        out.append(f"{key}.cudnn_attention={_text(m.cudnn_attention)}: cuDNN attention is a CUDA kernel")
    return out


def _text(value: Any) -> str:
    """A config value as an override spells it."""
    if isinstance(value, (list, tuple)) or OmegaConf.is_list(value):
        return "[" + ",".join(_text(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_same_tokenizer(target_tokenizer, draft_tokenizer, *, draft_ref: str = "the draft") -> str | None:
    """A parametric draft reads the target's token ids, so every id both tokenizers hold must name
    the same token (compared by content, not by ``config.vocab_size``: embedding matrices of one
    family are often padded to different sizes); refused otherwise. Returns a note where the ids
    agree but the tokenizers would turn text into ids differently (special tokens such as a base
    model's EOS beside its instruct model's, normalisation, pre-tokenisation, merges): the draft
    never tokenizes text, so the run stays exact, but it was trained on its own tokenizer's ids."""
    if target_tokenizer is None and draft_tokenizer is None:
        return None  # tiny models: both use the synthetic id space
    if target_tokenizer is None or draft_tokenizer is None:
        which = "target" if target_tokenizer is None else "draft"
        raise CheckpointError(
            f"the {which} has no tokenizer (model=tiny) and the other has one: "
            "a draft must share the target's tokenizer"
        )
    diff = tokenizer_id_difference(target_tokenizer, draft_tokenizer)
    if diff is not None:
        raise CheckpointError(
            f"the draft {draft_ref!r} reads token ids differently from the target: {diff}; "
            "a draft model must share the target's vocabulary"
        )
    diff = tokenizer_difference(target_tokenizer, draft_tokenizer)
    if diff is None:
        return None
    return (
        f"the draft {draft_ref!r} shares the target's token ids but its tokenizer differs ({diff}): it reads "
        "the target's ids, so the run is exact, and its acceptance may be lower than with the target's tokenizer"
    )


# --------------------------------------------------------------------------- prepare


def build_context(cfg: DictConfig, loaded: Loaded) -> BuildContext:
    """What preparers and proposers are built from once the models are loaded."""
    return BuildContext(
        cfg=cfg,
        target_backend=loaded.backend,
        tokenizer=loaded.target.tokenizer,
        draft_backend=loaded.draft_backend,
        items=loaded.items,
        model_source=loaded.target.source,
    )


def prepare_job(cfg: DictConfig, planned: Planned, loaded: Loaded) -> Prepared:
    """Artifacts that need the models (e.g. a Sequoia tree), then one proposer per batch slot."""
    context = build_context(cfg, loaded)
    plan_ = prepare(cfg, planned.plan, context)
    batch = int(cfg.generation.batch_size)
    proposers = [build_proposer(cfg, plan_, manifest_hash=planned.manifest_hash, context=context) for _ in range(batch)]
    for slot in proposers[1:]:  # what a proposer remembers of earlier requests is the job's, not one slot's
        slot.join(proposers[0])
    null_budget = Budget(shape="sequence", max_nodes=1, max_depth=1)
    nulls = [NullProposer(budget=null_budget, manifest_hash=planned.manifest_hash) for _ in range(batch)]
    return Prepared(plan=plan_, context=context, proposers=proposers, null_proposers=nulls)


# --------------------------------------------------------------------------- gate


def gate(cfg: DictConfig, planned: Planned, loaded: Loaded, prepared: Prepared) -> dict:
    """The gates that run before anything is measured (a failure raises GateError), the proposer's
    workload governance (e.g. datastore leakage) among them. Gates an override switched off are
    announced first, one line on stderr (the record says so too)."""
    announce_disabled(cfg, prepared.plan)
    proposer = prepared.proposers[0]
    # the gates run the measured proposer on the workload's first prompts: it leaves them with what it
    # learned, remembered and counted before, as a run whose gates come from the cache starts
    learned = proposer.snapshot_learning()
    try:
        gates = run_gates(
            cfg,
            plan_=prepared.plan,
            backend=loaded.backend,
            proposer=proposer,
            items=loaded.items,
            model_source=loaded.target.source,
            model_identity=gate_model_identity(planned.manifest),
            positions=planned.context.positions,
        )
        inert = gate_inert_options(cfg, gates)
        if inert:
            print(f"harness: note: option(s) with no effect here: {'; '.join(inert)}", file=sys.stderr)
        return gates
    finally:
        proposer.forget_requests()
        proposer.restore_learning(learned)
        proposer.reset_counters()


def gate_measured(cfg: DictConfig, loaded: Loaded, prepared: Prepared, gates: dict, measured: Measured) -> dict:
    """The gates once the run is measured. Where the statistical gate found no proposing prefix in
    the workload's first prompts but the measured run proposed, it is run at the contexts the run's
    first proposing rounds drafted from (:func:`measured_prefixes`); a failure raises GateError."""
    probe = gates.get("statistical")
    if not found_no_prefix(probe):
        return gates
    prefixes = measured_prefixes(measured)
    if not prefixes:
        return gates
    entry = statistical_gate_on_run(
        cfg, plan_=prepared.plan, backend=loaded.backend, proposer=prepared.proposers[0], prefixes=prefixes, probe=probe
    )
    return {**gates, "statistical": entry}


def measured_prefixes(measured: Measured, limit: int = GATE_PROMPTS) -> list[list[int]]:
    """The contexts (prompt and the tokens committed before the round) from which the speculative
    arm's first proposing rounds drafted, one per request turn, in the order the prompts ran, at most
    ``limit``."""
    by_id = {o["prompt_id"]: o for o in measured.outputs}
    committed: dict[tuple[int, int], int] = {}
    taken: set[tuple[int, int]] = set()
    out: list[list[int]] = []
    for row in sorted(measured.rounds, key=lambda r: (r["prompt_index"], r["turn"], r["round"])):
        key = (int(row["prompt_index"]), int(row["turn"]))
        before = committed.get(key, 0)
        committed[key] = before + int(row["committed"])
        if int(row.get("candidate_rows") or 0) <= 0 or key in taken or len(out) >= limit:
            continue
        turn = output_turns(by_id[row["prompt_id"]])[key[1] - 1]
        out.append(list(turn["spec_prompt_token_ids"]) + list(turn["spec_token_ids"][:before]))
        taken.add(key)
    return out


def gate_model_identity(manifest: dict) -> dict:
    """What a cached gate must have checked besides the model's source, dtype and device: the
    forward's resolved options (cache layout, kernels, fused layers, compile) and the files of a
    target or draft loaded by path (new weights at the same path are another model)."""
    return {
        "backend": manifest.get("backend"),
        "target_checkpoint": manifest.get("target_checkpoint"),
        "draft_checkpoint": manifest.get("draft_checkpoint"),
    }


# --------------------------------------------------------------------------- measure


def measure(cfg: DictConfig, planned: Planned, loaded: Loaded, prepared: Prepared) -> Measured:
    """Warm-up (excluded), then both arms batch by batch, a conversation's turns in order (each arm's
    later turns built from its own answers); at temperature 0 every turn's two outputs must agree up
    to recorded near-ties."""
    plan_ = prepared.plan
    encoder = loaded.encoder
    prompts = [p for p, _ in loaded.items]
    turn_prompts: dict[tuple[str, int, int], TurnPrompt] = {}
    for i, first in enumerate(loaded.first_turns):
        for arm in ARMS:
            turn_prompts[(arm, i, 0)] = first

    def follow_up(i: int, turn: int, arm: str, answers: list[list[int]]) -> list[int]:
        tp = encoder.turn(prompts[i], answers)
        turn_prompts[(arm, i, turn)] = tp
        return tp.ids

    arms = Arms(
        target=loaded.backend,
        spec_proposers=prepared.proposers,
        null_proposers=prepared.null_proposers,
        spec_verifier=plan_.verifier,
        ar_verifier=plan_.baseline_verifier,
        policy=plan_.policy,
        prompts=[ids for _, ids in loaded.items],
        seed=int(cfg.seed),
        batch_size=int(cfg.generation.batch_size),
        max_new_tokens=int(cfg.generation.max_new_tokens),
        eos_token_ids=loaded.eos,
        round_cfg=planned.round_cfg,
        rng_factory=TorchRandomSource,
        turns=[p.n_turns for p in prompts],
        follow_up=follow_up,
    )
    # at most the measured turns' tokens: the context limit every prompt was checked against
    arms.warmup(min(int(cfg.generation.warmup_tokens), int(cfg.generation.max_new_tokens)))
    tokenizer = loaded.target.tokenizer
    per_prompt, outputs = [], []
    n_turns = sum(p.n_turns for p in prompts)
    # closed on every way out: a run stopped here reports why on a line of its own, after the bar
    with tqdm(total=n_turns, desc="turns" if n_turns > len(prompts) else "prompts", file=sys.stderr) as bar:
        for i in arms.run():
            prompt = prompts[i]
            bar.update(prompt.n_turns)
            fields = arms.result.prompt_fields(i)
            turns_out = []
            for t, tf in enumerate(fields["turns"]):
                ar, spec = arms.result.request("ar", i, t), arms.result.request("spec", i, t)
                ar_prompt, spec_prompt = turn_prompts[("ar", i, t)], turn_prompts[("spec", i, t)]
                ar_answer, ar_answer_cut = encoder.answer(ar.tokens)
                spec_answer, spec_answer_cut = encoder.answer(spec.tokens)
                tf.update(
                    {
                        "spec_prompt_tokens": len(spec_prompt.ids),
                        "ar_prompt_tokens": len(ar_prompt.ids),
                        "spec_cut_tokens": spec_prompt.cut_tokens,
                        "ar_cut_tokens": ar_prompt.cut_tokens,
                        # the baseline's tokens as Spec-Bench's speed.py recounts them from the exported text
                        "ar_speed_py_tokens": speed_py_tokens(tokenizer, ar_answer),
                    }
                )
                turns_out.append(
                    {
                        "turn": t + 1,
                        "spec_prompt_token_ids": spec_prompt.ids,
                        "ar_prompt_token_ids": ar_prompt.ids,
                        "ar_token_ids": ar.tokens,
                        "spec_token_ids": spec.tokens,
                        "ar_text": tokenizer.decode(ar.tokens) if tokenizer else None,
                        "spec_text": tokenizer.decode(spec.tokens) if tokenizer else None,
                        "ar_answer": ar_answer,
                        "spec_answer": spec_answer,
                        # whether the chat template's stop string cut the answer (vicuna's "</s>", as Spec-Bench)
                        "ar_answer_cut": ar_answer_cut,
                        "spec_answer_cut": spec_answer_cut,
                        "ar_round_tokens": ar.round_tokens,
                        "spec_round_tokens": spec.round_tokens,
                        "spec_cut_tokens": spec_prompt.cut_tokens,
                        "ar_cut_tokens": ar_prompt.cut_tokens,
                    }
                )
            per_prompt.append(
                {
                    "prompt_id": prompt.prompt_id,
                    "prompt_sha256": prompt.fingerprint,
                    "category": prompt.category,
                    # each arm's (a later turn's prompt holds that arm's own answers): counted once, not summed
                    "cut_tokens": sum(tf["spec_cut_tokens"] for tf in fields["turns"]),
                    "ar_cut_tokens": sum(tf["ar_cut_tokens"] for tf in fields["turns"]),
                    **fields,
                }
            )
            first = turns_out[0]
            outputs.append(
                {
                    "prompt_id": prompt.prompt_id,
                    "question_id": prompt.source_id,
                    "category": prompt.category,
                    # the first turn's (every turn under "turns"; n_turns says how many there are)
                    "n_turns": len(turns_out),
                    "prompt_token_ids": first["spec_prompt_token_ids"],
                    "ar_token_ids": first["ar_token_ids"],
                    "spec_token_ids": first["spec_token_ids"],
                    "ar_text": first["ar_text"],
                    "spec_text": first["spec_text"],
                    "turns": turns_out,
                }
            )
    greedy = None
    if plan_.policy.deterministic and "greedy_equality" not in disabled_gates(cfg):
        greedy = greedy_equality(loaded.backend.model, outputs, max_fraction=float(cfg.gates.near_tie_max_fraction))
    rounds = [
        {"prompt_id": loaded.items[row["prompt_index"]][0].prompt_id, **row} for row in arms.result.round_series("spec")
    ]
    return Measured(
        arms=arms.result,
        per_prompt=per_prompt,
        outputs=outputs,
        greedy=greedy,
        rounds=rounds,
        learned_at_start=arms.learned_at_start,
    )


# --------------------------------------------------------------------------- summarise


def summarise(
    cfg: DictConfig,
    planned: Planned,
    loaded: Loaded,
    prepared: Prepared,
    gates: dict,
    measured: Measured,
    *,
    job_seconds: float,
    host_memory: dict | None = None,
    compile_report: dict | None = None,
) -> dict:
    """The run record: decode metrics (defined once in :mod:`harness.engine.arms`), proposal-side
    state, the gates, the resolved config, the manifest and the hardware card."""
    plan_, proposer, backend = prepared.plan, prepared.proposers[0], loaded.backend
    slots = prepared.proposers
    metrics: dict[str, Any] = measured.arms.metrics()
    # the AR step's floor, measured in this process after the arms ran: streamed weight bytes / read
    # bandwidth (ar_step_vs_floor: how many floors one AR step takes; a step of a batch of B emits B
    # tokens, so the step is the decode time over the batch rounds, not over the tokens)
    try:  # after the arms: a device without memory to spare leaves the floor out, never the record
        bandwidth = read_bandwidth_gbs(backend.device)
    except (RuntimeError, ValueError) as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
        print(f"harness: note: the record has no weight-streaming floor: {str(exc).splitlines()[0]}", file=sys.stderr)
        bandwidth = None
    floor_ms = weight_stream_floor_ms(backend.model, bandwidth) if bandwidth else None
    ar_tpt, ar_tokens, ar_steps = (metrics.get(k) for k in ("ar_time_per_token_ms", "ar_tokens", "ar_batch_rounds"))
    ar_step_ms = ar_tpt * ar_tokens / ar_steps if ar_tpt and ar_tokens and ar_steps else None
    metrics.update(
        {
            "read_bandwidth_gbs": bandwidth,
            "weight_stream_floor_ms": floor_ms,
            "ar_step_vs_floor": ar_step_ms / floor_ms if ar_step_ms and floor_ms else None,
        }
    )
    metrics.update(
        {
            "kv_bytes_per_token": backend.bytes_per_token,
            # B (R - 1) rows x bytes per token, from the forwards' row counts (the peak is the cache's growth)
            "temp_kv_bytes_formula": metrics["temp_kv_bytes_padded_peak"],
            "temp_kv_bytes_budget_formula": planned.temp_kv_budget_formula_bytes,
            "proposal_state_bytes": sum(p.state_bytes() for p in slots),
            "retrieval": merged_proposer_extras(slots),
            "greedy_identical": (  # every turn of every conversation
                all(t["ar_token_ids"] == t["spec_token_ids"] for o in measured.outputs for t in output_turns(o))
                if plan_.policy.deterministic
                else None
            ),
            "greedy_near_ties": measured.greedy["near_ties"] if measured.greedy is not None else None,
            # this job's peak host RSS (peak_rss_method: how), not the process lifetime's
            **(host_memory or {"peak_rss_bytes": peak_rss_bytes(), "peak_rss_method": "process_lifetime"}),
            "concurrent_jobs": int(cfg.concurrent_jobs),
            "torch_threads": torch.get_num_threads(),
            # artifacts trained on this CPU's token budget (heads, adapters, skip vectors) are labelled
            "cpu_budget_artifact": bool(getattr(proposer, "cpu_budget_artifact", False)),
            "job_seconds": job_seconds,
            "context": context_metrics(planned.context, measured.per_prompt),
            "spec_bench_speed_py_speedup": speed_py_speedup(measured.per_prompt),
            **speedup_intervals(measured.per_prompt, batch_size=int(cfg.generation.batch_size)),
            "timing_outliers": timing_outliers(measured.per_prompt),
        }
    )
    if compile_report is not None and compile_report["recompile_limit_hits"] and _compiled(loaded):
        print(
            "harness: warning: torch.compile reached its recompile limit, so these functions ran eagerly for "
            f"part of the run (load_report.compile): {'; '.join(compile_report['recompile_limit_hits'])}",
            file=sys.stderr,
        )
    if metrics.get("fallback_rate") == 1.0 and metrics.get("rounds"):
        print(
            f"harness: warning: the proposer offered no candidate in any of {metrics['rounds']} rounds "
            "(metrics.fallback_rate 1.0): the speculative arm decoded as plain AR plus the proposer's cost, so its "
            "speedup measures overhead only",
            file=sys.stderr,
        )
    if not plan_.verifier.exact:
        # the drift's rounds start where the measurement started: no earlier request remembered (prompt
        # lookup's history of the job's outputs), nothing learned past the job's start
        proposer.forget_requests()
        if measured.learned_at_start is not None:
            proposer.restore_learning(measured.learned_at_start["spec"][0])
        metrics["drift"] = heuristic_drift(cfg, plan_=plan_, backend=backend, proposer=proposer, items=loaded.items)
    metrics.update(plan_.extras.get("metrics", {}))
    if measured.greedy is not None:
        gates = {**gates, "greedy_equality": measured.greedy}
    stat = gates.get("statistical") or {}
    fallback = metrics.get("fallback_rate")
    if stat.get("status") == "not_applicable" and "proposed nothing" in str(stat.get("why")) and fallback is not None:
        if fallback < 1.0:  # the probe's prompts drew no proposal; the measured ones did: say the test never ran
            where = " (nor at the contexts the run's proposing rounds drafted from)" if "prefixes_from" in stat else ""
            untested = (
                f"the statistical gate found no proposing prefix to test{where}, yet the measured run proposed in "
                f"{1.0 - fallback:.0%} of its rounds: those rounds' verification was not tested by sampling "
                "(the enumeration oracles cover the verifier's code)"
            )
            gates = {**gates, "statistical": {**stat, "measured_proposal_rate": 1.0 - fallback, "note": untested}}
            print(f"harness: note: {untested}", file=sys.stderr)
    mhash = planned.manifest_hash
    record = {
        "schema_version": RECORD_SCHEMA_VERSION,
        "run_id": planned.run_id,
        "experiment": cfg.experiment,
        "sweep": cfg.sweep,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "exact": plan_.verifier.exact,
        "gated": is_gated(gates),
        "gates": gates,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "manifest": planned.manifest,
        "manifest_hash": mhash,
        "axes": axes_of(cfg),
        "metrics": metrics,
        "metric_notes": METRIC_NOTES,
        "per_prompt": measured.per_prompt,
        "inert_options": inert_options(cfg) + gate_inert_options(cfg, gates),  # set, but changing nothing here
        "hardware": hardware_card(
            cfg.model.device, draft_device=str(loaded.draft.model.device) if loaded.draft is not None else None
        ),
        "model_source": loaded.target.source,
        "draft_source": loaded.draft.source if loaded.draft is not None else None,
        "load_report": {
            "target": loaded.target.load_report,
            **({"draft": loaded.draft.load_report} if loaded.draft is not None else {}),
            **({"compile": compile_report} if compile_report is not None and _compiled(loaded) else {}),
        },
        "artifacts": {
            **plan_.extras.get("artifacts", {}),
            **(
                {"proposer_artifact": proposer.artifact_manifest}
                if getattr(proposer, "artifact_manifest", None)
                else {}
            ),
        },
    }
    # write_job binds the file by its SHA-256 as it writes it
    record["round_series"] = {"file": ROUNDS_FILENAME, "rows": len(measured.rounds), "arm": "spec"}
    t_profile = plan_.extras.get("t_profile")
    if t_profile:
        record["t_profile"] = profile_with_floors(backend, t_profile, bandwidth) if bandwidth else t_profile
    if "sequoia_predicted_time_per_token_ms" in metrics:
        metrics["sequoia_cost_model_error"] = cost_model_error(record)
    return record


def profile_with_floors(backend, t_profile: dict, bandwidth_gbs: float) -> dict:
    """The verify time t(n) (ms) a run used, each point against its roofline floor: the weights read
    once at the bandwidth the record measured, the forward's arithmetic at the rate of this device's
    large matrix product in the target's dtype. Measured after the arms, so a product that cannot
    run here (a device without the memory for it) leaves the profile without floors, with a note,
    and never costs the run its record."""
    try:
        peak = matmul_peak(backend.device, next(backend.model.parameters()).dtype, repeats=3)
    except (RuntimeError, ValueError) as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
        print(f"harness: note: t(n) recorded without its roofline floors: {str(exc).splitlines()[0]}", file=sys.stderr)
        return t_profile
    return profile_roofline(
        backend.model, t_profile, bandwidth_gbs=bandwidth_gbs, peak_gflops=peak["gflops"], peak_size=peak["size"]
    )


def speedup_intervals(per_prompt: list[dict], *, batch_size: int = 1) -> dict:
    """95% paired-bootstrap intervals over prompts of the decode and end-to-end speedups: how far
    another draw of prompts could move them, resampling the per-prompt times the record's own
    speedups divide (each prompt's batch of one), so each point lies in its interval. None with
    fewer than two prompts, and at batch > 1, where requests share their batch's time."""
    if batch_size > 1:
        return {"decode_speedup_ci95": None, "speedup_ci95": None}
    decode, e2e = run_speedups(per_prompt)

    def interval(e) -> list[float] | None:
        return None if e.ci_low is None or e.ci_high is None else [e.ci_low, e.ci_high]

    return {"decode_speedup_ci95": interval(decode), "speedup_ci95": interval(e2e)}


def timing_outliers(per_prompt: list[dict], *, factor: float = TIMING_OUTLIER_FACTOR) -> list[dict]:
    """Prompts whose decode time per round, in either arm, is ``factor`` or more times that arm's
    median over the run's prompts (at least three prompts with rounds): a stall (another process,
    a page fault storm, a throttled clock) inflates one prompt's time, and with it the speedup or
    slowdown that prompt reports and the run's ratio of summed times, which carries it without a trace.
    A round's cost varies with the rows it verifies and the context it reads, within a small factor
    on the machines measured, so a threefold round is not the method's."""
    out: list[dict] = []
    for arm in ("ar", "spec"):
        per_round = {
            i: row[f"{arm}_decode_ms"] / row[f"{arm}_rounds"]
            for i, row in enumerate(per_prompt)
            if row[f"{arm}_rounds"]
        }
        if len(per_round) < 3:
            continue
        median = statistics.median(per_round.values())
        for i, ms in per_round.items():
            if median > 0 and ms >= factor * median:
                out.append(
                    {
                        "prompt_id": per_prompt[i]["prompt_id"],
                        "arm": arm,
                        "ms_per_round": ms,
                        "median_ms_per_round": median,
                        "ratio": ms / median,
                    }
                )
    return out


def speed_py_tokens(tokenizer, answer: str) -> int | None:
    """A baseline answer's tokens as Spec-Bench's evaluation/speed.py counts them: its text through the
    tokenizer, minus one for the BOS it assumes (None without a tokenizer: ``model=tiny``)."""
    if tokenizer is None:
        return None
    return len(tokenizer(answer).input_ids) - 1


def speed_py_speedup(per_prompt: list[dict]) -> float | None:
    """What Spec-Bench's speed.py prints for a run's exported answer files: ``spec_bench_speedup``
    with the baseline's tokens recounted from its text (:func:`speed_py_tokens`) rather than the
    tokens it generated. The two differ where the tokenizer adds no BOS (the minus one then drops a
    real token) or an answer's text re-tokenizes otherwise (EOS and special tokens are not in it)."""
    rates: dict[str, list[float]] = {"spec": [], "ar": []}
    for row in per_prompt:
        turns = row.get("turns") or []
        if not turns or any(t.get("ar_speed_py_tokens") is None for t in turns):
            return None
        for arm, tokens in (("spec", "spec_tokens"), ("ar", "ar_speed_py_tokens")):
            wall_s = sum(t[f"{arm}_prefill_ms"] + t[f"{arm}_decode_ms"] for t in turns) / 1e3
            if wall_s <= 0:
                return None
            rates[arm].append(sum(t[tokens] for t in turns) / wall_s)
    if not rates["spec"] or sum(rates["ar"]) <= 0:
        return None
    return (sum(rates["spec"]) / len(rates["spec"])) / (sum(rates["ar"]) / len(rates["ar"]))


def run_notes(record: dict) -> list[str]:
    """What a finished run says on stderr about its figures: a heuristic verifier, prompts timed through a stall
    (:func:`timing_outlier_note`), a speedup past its tokens per round (:func:`past_rounds_speedup_note`),
    a Sequoia tree predicted slower than plain decoding, prompts the context limit cut
    (:func:`truncation_note`) and prompt lookup's history at a batch above one (:func:`batched_history_note`)."""
    m = record["metrics"]
    notes = [timing_outlier_note(m["timing_outliers"])] if m.get("timing_outliers") else []
    if record.get("exact") is False:
        verifier = (record.get("axes") or {}).get("verifier")
        notes.append(
            f"verifier={verifier} is heuristic (exact: false): its outputs do not follow the target's law; compare, "
            "the report and the dashboards keep the run apart from exact ones (metrics.drift says how far)"
        )
    past_rounds = past_rounds_speedup_note(m)
    predicted = m.get("sequoia_predicted_time_per_token_normalised")
    slower = None
    if predicted is not None:
        slower = slower_than_ar_note({"n": m.get("sequoia_tree_nodes"), "time_per_token": predicted})
    cut = truncation_note(m.get("context") or {}, len(record["per_prompt"]))
    history = batched_history_note(record.get("config") or {})
    return notes + [n for n in (past_rounds, slower, cut, history) if n]


def truncation_note(context: dict, n_prompts: int) -> str | None:
    """One line saying how many prompts ``workload.truncate=left`` cut (a record's
    ``metrics.context``), for the console; None when it cut none."""
    cut = int(context.get("truncated_prompts") or 0)
    if not cut:
        return None
    tokens = max(int(context.get("cut_tokens") or 0), int(context.get("ar_cut_tokens") or 0))
    if context.get("rule") == TRUNCATE_REFUSE:  # checked before the run with answers at max_new_tokens each
        return (
            f"{cut} of {n_prompts} prompts had a later turn cut to fit {context['max_prompt_tokens']:,} tokens: "
            "their earlier answers, fed back as text, tokenized longer than the tokens generated (past the bound "
            f"workload.truncate=false checked them against); {tokens:,} tokens in all, cut from the oldest text "
            "(per prompt: cut_tokens in the record)"
        )
    return (
        f"{cut} of {n_prompts} prompts had their oldest text cut to fit {context['max_prompt_tokens']:,} tokens "
        f"(the {context['positions']:,} positions of {context['limited_by']}, less generation.max_new_tokens and "
        f"the candidate rows): {tokens:,} tokens in all; the figures are for the cut prompts (per prompt: "
        "cut_tokens in the record; workload.truncate=false refuses them instead)"
    )


def context_metrics(limit: ContextLimit, per_prompt: list[dict]) -> dict:
    """The context limit the prompts were held to, and what the left truncation cut: turns cut in
    either arm, and the tokens cut from each arm's prompts (``cut_tokens``: the speculative arm's)."""
    cut_turns = [t for p in per_prompt for t in p["turns"] if t["spec_cut_tokens"] or t["ar_cut_tokens"]]
    return {
        **limit.summary(),
        "truncated_prompts": sum(1 for p in per_prompt if p["cut_tokens"] or p["ar_cut_tokens"]),
        "truncated_turns": len(cut_turns),
        "cut_tokens": sum(p["cut_tokens"] for p in per_prompt),
        "ar_cut_tokens": sum(p["ar_cut_tokens"] for p in per_prompt),
    }


# --------------------------------------------------------------------------- write


def write(record: dict, measured: Measured, run_dir: Path) -> dict:
    """``rounds.jsonl`` and ``outputs.jsonl``, then ``record.json`` binding both by row count and hash
    (one unit: a failed record write removes the others). Returns the record as written."""
    return write_job(run_dir, record, measured.outputs, extra={ROUNDS_FILENAME: measured.rounds})


# --------------------------------------------------------------------------- trackers


def model_label(m: DictConfig) -> str:
    """The ``model`` axis of a target: what tells two targets apart in the store, compare and
    exports. A built-in name (``smollm2``, ``tiny``) or a hub id as given, a local checkpoint by its
    folder's name, then ``@<dtype>`` unless the weights run in float32."""
    ref = str(m.name_or_path or m.name)
    label = Path(ref).expanduser().resolve().name if (m.name_or_path and Path(ref).expanduser().exists()) else ref
    dtype = str(m.dtype)
    return label if dtype == "float32" else f"{label}@{dtype}"


def axes_of(cfg: DictConfig) -> dict:
    """The record's axes (the store's columns, W&B's top-level config keys)."""
    return {
        "model": model_label(cfg.model),
        "proposer": cfg.proposer.name,
        "topology": cfg.topology.name,
        "verifier": cfg.verifier.name,
        "temperature": float(cfg.generation.temperature),
        "batch_size": int(cfg.generation.batch_size),
        "workload": cfg.workload.name,
    }


def replaced_runs(run_dir: Path) -> list[str]:
    """The run ids of the earlier records moved aside in ``run_dir`` (its ``.previous/``) that W&B
    logged: the W&B runs a record of this folder replaces. Every one of them, not only the record
    this job moved: one set aside by a launch that failed before its W&B run opened, or by a run
    that was interrupted, or logged after the fact, is superseded all the same (naming a run twice
    is harmless: the tag is set once)."""
    ids = []
    for path in sorted((Path(run_dir) / PREVIOUS_DIR).glob(f"*/{RECORD_FILENAME}")):
        try:
            earlier = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(earlier, dict) and earlier.get("tracking") and earlier.get("run_id"):
            if str(earlier["run_id"]) not in ids:
                ids.append(str(earlier["run_id"]))
    return ids


def start_tracker(cfg: DictConfig, planned: Planned) -> Tracker | NullTracker:
    """:func:`open_tracker` for a job past its refusals; a W&B run that cannot start is a
    :class:`TrackingError` (nothing was measured, and the job's folder goes back as it was)."""
    try:
        return open_tracker(cfg, planned, replaces=replaced_runs(planned.run_dir))
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise TrackingError(
            f"W&B could not start the run ({type(exc).__name__}: {first}); nothing was measured "
            "(tracking=none runs without it)"
        ) from exc


def open_tracker(cfg: DictConfig, planned: Planned, *, replaces: Sequence[str] = ()) -> Tracker | NullTracker:
    """The job's W&B run (``tracking=wandb``), opened once the job is past its refusals (loaded and
    prepared, before its gates); a :class:`NullTracker` for ``tracking=none``. ``replaces``:
    :func:`replaced_runs`."""
    if cfg.tracking.name == "none":
        return NullTracker()
    t = cfg.tracking
    return open_run(
        OmegaConf.to_container(cfg, resolve=True),
        mode=t.mode,
        project=t.project,
        entity=t.entity,
        group=wandb_group(cfg.sweep, cfg.experiment),
        dir=planned.run_dir,
        axes=axes_of(cfg),
        run_id=planned.run_id,
        system_metrics=bool(t.system_metrics),
        system_metrics_interval_s=float(t.system_metrics_interval_s),
        init_timeout_s=float(t.init_timeout_s),
        replaces=replaces,
    )


def tracked(record: dict, tracker: Tracker | NullTracker, run_dir: Path) -> dict:
    """A written record whose W&B run now holds it: written again with where that run is
    (``tracking``), so a later launch does not log it again. Until then the record names no W&B
    run, and a job killed while W&B logs it (out of memory, a Slurm time limit) leaves it untracked,
    for a later launch to log (:func:`track`). Returns that record (as it was with no tracker)."""
    described = tracker.describe()
    if described is None:
        return record
    record = {**record, "tracking": described}
    write_json_atomic(Path(run_dir) / RECORD_FILENAME, record)  # its outputs are untouched: the binding holds
    return record


def untracked(record: dict, tracker: Tracker, error: BaseException, run_dir: Path) -> dict:
    """A record whose W&B logging failed after it was written: a warning says so, the half-logged
    offline run is removed (a later log of the same run id is the only one), and the record is
    written again without its ``tracking`` entry, so a later launch with ``tracking=wandb`` logs it
    (:func:`track`). Returns that record."""
    first = (str(error).strip().splitlines() or [""])[0][:300]
    why = (
        "the interrupt came while W&B logged it"
        if isinstance(error, KeyboardInterrupt)
        else f"W&B could not log it ({type(error).__name__}: {first})"
    )
    print(
        f"harness: warning: the record is written, but {why}; a sweep launched again with tracking=wandb logs "
        "it (its job is complete: skipped, and logged), while `harness run` again measures the job again",
        file=sys.stderr,
    )
    try:
        tracker.fail(stage="tracking", error=error, refused=False)
    except Exception:  # the run is in whatever state the failure left
        pass
    discard_offline_run(tracker)
    record = {k: v for k, v in record.items() if k != "tracking"}
    write_json_atomic(Path(run_dir) / RECORD_FILENAME, record)
    return record


def logged_elsewhere_note(logged: dict, *, project: str, entity: str | None, mode: str) -> str | None:
    """One line where a record's W&B run (``logged``: its ``tracking`` entry) is not where this launch
    asks to log (another project or entity; offline where online is asked): the record is logged
    once, so the asked project does not get it; None where it is where asked."""
    where = f"{logged.get('entity')}/{logged.get('project')}" if logged.get("entity") else str(logged.get("project"))
    if logged.get("project") != project or (entity and logged.get("entity") != entity):
        asked = f"{entity}/{project}" if entity else str(project)
        return (
            f"its record was logged to W&B project {where} (run {logged.get('run_id')}) when it ran; a record is "
            f"logged once, so project {asked} does not get it (a job whose folder is moved aside runs again, and "
            "logs there)"
        )
    if mode == "online" and logged.get("mode") == "offline":
        return (
            f"its record was logged offline to W&B project {where} when it ran; `{logged.get('sync') or 'wandb sync'}` "
            "in the job's folder uploads it"
        )
    return None


def track(cfg: DictConfig, record: dict, run_dir: Path) -> bool:
    """Log a record that no tracker saw (one with no ``tracking`` entry) after the fact, and write
    where its W&B run is into the record (``tracking``), so a later launch does not log it again.
    Returns whether it logged.

    A job run by :func:`run_job` with ``tracking=wandb`` already logged its record into the W&B
    run that watched it, so this does nothing for it. The record's lock is held from reading it to
    writing it back: two jobs of a sweep that find one record (a job and its twin) log it once."""
    if cfg.tracking.name == "none":
        return False
    with artifact_lock(Path(run_dir) / RECORD_FILENAME, purpose="logging a record to W&B"):
        try:  # as it is now: another process may have logged it since it was read
            current = json.loads((Path(run_dir) / RECORD_FILENAME).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            current = None
        if isinstance(current, dict) and current.get("run_id") == record.get("run_id"):
            record = current
        return _track(cfg, record, run_dir)


def _track(cfg: DictConfig, record: dict, run_dir: Path) -> bool:
    t = cfg.tracking
    if record.get("tracking") is not None:
        note = logged_elsewhere_note(record["tracking"], project=t.project, entity=t.entity, mode=t.mode)
        if note:
            print(f"harness: note: {run_dir}: {note}", file=sys.stderr)
        return False
    tracker = None
    try:
        with open_run(
            record,
            mode=t.mode,
            project=t.project,
            group=wandb_group(cfg.sweep, cfg.experiment),
            dir=str(run_dir),
            entity=t.entity,
            system_metrics=False,  # the job is over: nothing to sample
            init_timeout_s=float(t.init_timeout_s),
            replaces=replaced_runs(run_dir),
        ) as tracker:
            tracker.log_record(record, run_dir)
            described = {**tracker.describe(), "logged_after_the_run": True}
    except Exception as exc:  # the record stays untracked: the next launch tries again
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        print(
            f"harness: warning: W&B could not log the record in {run_dir} ({type(exc).__name__}: {first}); "
            "it stays untracked, and the next launch with tracking=wandb tries again",
            file=sys.stderr,
        )
        if tracker is not None:
            discard_offline_run(tracker)
        return False
    # a log of this record a job killed while W&B logged it left: the run just logged is the only one
    discard_offline_runs(run_dir, record["run_id"], keep=tracker.run.settings.sync_dir)
    record["tracking"] = described
    write_json_atomic(Path(run_dir) / RECORD_FILENAME, record)  # its outputs are untouched: the binding holds
    return True
