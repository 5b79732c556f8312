"""A run survives being killed: checkpoints are whole or absent, resume is exact, signals stop
cleanly, the run folder is locked, a non-finite loss stops the run.

Determinism: fp32 (mixed_precision=no), a seeded sampler (every epoch's order comes from the seed
and the epoch, and a resumed epoch skips the micro batches it had consumed), a loader with its own
generator (starting an iterator must not draw from the RNG that dropout uses), and accelerate's
save_state / load_state restoring every process's RNG states."""

import json
import re
import shutil
import signal
import subprocess
import sys
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_cli
from helpers import (REPO, SideBySide, child_env, finish, free_port, pin, signal_tree, start, stop_at_a_checkpoint,
                     wait_for)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
EXACT = ["mixed_precision=no", "max_steps=6", "save_steps=2", "eval_steps=null", "logging_steps=1", "max_seq_length=64"]


def losses(folder, key="loss"):
    return [h[key] for h in json.loads((folder / "report.json").read_text())["history"]]


def final_weights(folder):
    final = folder / "final"
    name = "adapter_model.safetensors" if (final / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(final / name)


def plain_launch(recipe, folder, *extra, core=None):
    """`accelerate launch --config_file <its shipped CPU config> recipes/sft.py` in its own process group, no
    `memrecipe run` (its config's header says ACCELERATE_USE_CPU for a 2-process CPU run)."""
    config = "single_gpu_lora_cpu1" if recipe == "single-gpu-lora" else f"{recipe.replace('-', '_')}_cpu2"
    line = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(REPO / "accelerate_configs" / f"{config}.yaml"), "--main_process_port", str(free_port()),
            *(["--num_cpu_threads_per_process", "1"] if core is not None else []),  # (it counts all cores)
            str(REPO / "recipes" / "sft.py"), "--recipe", recipe,
            *EXACT, "--output-dir", str(folder), *extra]
    log = open(f"{folder}.log", "w")
    return subprocess.Popen(line, env=child_env(**({"ACCELERATE_USE_CPU": "true"} if config.endswith("cpu2") else {})),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pin(core))


# each checkpoint holds something the others do not: an adapter on a bf16 base, FSDP shards, ZeRO partitions
# with offloaded state, adapters under FSDP, adapters on a 4-bit base, bitsandbytes' 8-bit optimizer state,
# bf16 weights with torchao's 8-bit state in per-parameter optimizers stepped in backward (and stochastic rounding).
# Two of them (1 process, and 2 under FSDP2) are started by plain `accelerate launch` instead of `memrecipe run`:
# their folder gets the resolved recipe and a launch config from the loop, and resumes both through
# `memrecipe run sft --resume` and through its own launch line with --resume.
# "kill": the cut run is SIGKILLed at a checkpoint and resumed with the same max_steps. "extend": the cut run
# finishes at max_steps=2 and is resumed with max_steps=6; its warmup step and peak are the 6-step run's, but
# its cosine ended at 0, the rate its optimizer saved for step 3: the resumed run equals the uninterrupted one
# only if every engine's optimizer trains step 3 at the rebuilt schedule's rate (1 process, DDP, ZeRO-3, the
# per-parameter optimizers; FSDP2 in test_resume_keeps_the_recipe_and_the_process_count).
# single-gpu-lora trains 64 rows a step: about 2 steps an epoch, so its resumed steps cross epoch boundaries.
CASES = [("single-gpu-lora", "accelerate", "kill", ["per_device_train_batch_size=16"]),
         ("fsdp", "accelerate", "kill", []),
         ("fsdp-lora", "memrecipe", "kill", []),
         ("zero3-offload", "memrecipe", "extend", []),
         ("qlora", "memrecipe", "extend", []),
         ("adamw-8bit", "memrecipe", "extend", []),
         ("single-gpu-full", "memrecipe", "extend", [])]
ONE_PROCESS = ("single-gpu-lora", "qlora", "single-gpu-full")  # pinned to their slot's core (1 thread)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every launch of this module, as jobs two at a time (a launch is mostly start-up, one core's work): each
    case's uninterrupted run and its cut run (the cut, the resumes, the exports: one job, in order) are separate
    jobs, so a lone resume or export never leaves a core idle. `runs(name)` waits for one and gives its result."""
    base = tmp_path_factory.mktemp("resume")
    jobs = {}
    for recipe, launched_by, mode, words in CASES:
        jobs[f"{recipe}/cut"] = partial(cut_and_resumed, base / recipe, recipe, launched_by, mode, words)
    jobs["keeps"] = partial(resumed_with_changes, base / "keeps")
    for recipe, launched_by, _, words in CASES:
        jobs[f"{recipe}/whole"] = partial(uninterrupted, base / recipe, recipe, launched_by, words)
    for recipe, _, sig in SIGNALS:
        jobs[f"signal/{recipe}"] = partial(stopped_by_a_signal, base / f"signal-{recipe}", recipe, sig)
    jobs["locked"] = partial(a_locked_folder, base / "locked")
    jobs["nan"] = partial(a_non_finite_loss, base / "nan")
    side = SideBySide(jobs)
    yield side
    side.close()


def case_launch(recipe, launched_by, words, folder, *extra, core):
    one = core if recipe in ONE_PROCESS else None
    if launched_by == "accelerate":
        return plain_launch(recipe, folder, *words, *extra, core=one)
    return start(["--recipe", recipe, *EXACT, *words, *extra], folder, one)  # (a shipped config's precision wins)


def uninterrupted(base, recipe, launched_by, words, core):
    base.mkdir(parents=True, exist_ok=True)
    finish(case_launch(recipe, launched_by, words, base / "whole", core=core))
    return base / "whole"


def cut_and_resumed(base, recipe, launched_by, mode, words, core):
    """The cut run (killed at a checkpoint, or finished early), resumed; then its exports."""
    base.mkdir(parents=True, exist_ok=True)
    one = core if recipe in ONE_PROCESS else None
    cut, out = base / "cut", SimpleNamespace(report=None, refinished=None)
    if mode == "kill":
        out.resumed_at = stop_at_a_checkpoint(case_launch(recipe, launched_by, words, cut, core=core), cut)
        out.final_after_kill = (cut / "final").exists()
    else:
        finish(case_launch(recipe, launched_by, words, cut, "max_steps=2", core=core))
        out.resumed_at, out.final_after_kill = 2, False
    out.files = {p.name for p in cut.iterdir()}
    partial_save = cut / "checkpoints" / ".tmp-step-5"  # a save cut off by a kill: never taken for a checkpoint
    partial_save.mkdir(exist_ok=True)
    (partial_save / "model.safetensors").write_bytes(b"cut off mid-write")
    out.resumed = [base / "moved"]
    if launched_by == "accelerate":  # a copy resumes through its own launch line
        out.resumed.append(base / "twin")
        shutil.copytree(cut, out.resumed[1])
    cut.rename(out.resumed[0])  # a moved run folder still resumes
    procs = [start(["--resume", "max_steps=6"], out.resumed[0], one)]
    if launched_by == "accelerate":
        procs.append(case_launch(recipe, launched_by, words, out.resumed[1], "--resume", core=core))
    finish(*procs)
    if launched_by == "accelerate":
        out.report = run_cli("report", str(out.resumed[1]))
    if recipe == "single-gpu-lora":  # killed after its last checkpoint, in the final save: the resume trains no step
        out.refinished = base / "refinished"
        shutil.copytree(out.resumed[0], out.refinished)
        shutil.rmtree(out.refinished / "final")
        (out.refinished / "report.json").unlink()
        finish(start(["--resume"], out.refinished, one))
    moved = out.resumed[-1]  # the export checks: on the folder resumed by its own launch line when there is one
    if recipe in ("single-gpu-lora", "qlora"):
        out.export = export_here(moved, base / "merged", merge=True)
    elif recipe == "fsdp-lora":
        out.export = export_here(moved, base / "merged", merge=True, checkpoint="step-6")
    elif recipe == "zero3-offload":  # a ZeRO checkpoint gathered by DeepSpeed's zero_to_fp32, through the CLI
        out.export = export(moved, base / "exported", "--checkpoint", "step-6")
    else:
        out.export = export_here(moved, base / "exported", checkpoint="step-6")
    return out


@pytest.mark.parametrize("recipe, launched_by, mode, words", CASES)
def test_killed_and_resumed_equals_uninterrupted(runs, recipe, launched_by, mode, words):
    whole, out = runs(f"{recipe}/whole"), runs(f"{recipe}/cut")
    resumed_at, resumed = out.resumed_at, out.resumed
    assert resumed_at < 6 and not out.final_after_kill
    assert {"recipe.yaml", "accelerate_config.yaml"} <= out.files  # however it was launched
    if launched_by == "accelerate":
        assert out.report.returncode == 0, out.report.stderr[-2000:]
    elif mode == "kill":
        assert "taken over" in open(f"{resumed[0]}.log").read()  # the dead run's lock was stale
    for folder in resumed:
        log = open(f"{folder}.log").read()
        assert re.search(rf"resumed from \S*checkpoints/step-{resumed_at} at step {resumed_at} ", log), log[-2000:]
        assert "step-5" not in log
        if words:  # the resumed steps cross an epoch's end (the next epoch: a new shuffle, the remainder left out)
            per_epoch = int(re.search(r"6 steps \((\d+) per epoch\)", log).group(1))
            assert any(end >= resumed_at for end in range(per_epoch, 6, per_epoch)), (per_epoch, resumed_at)
        assert losses(folder) == pytest.approx(losses(whole), abs=1e-5)
        assert losses(folder, "lr") == pytest.approx(losses(whole, "lr"), rel=1e-12)  # the rate each step trained at
        expected, got = final_weights(whole), final_weights(folder)
        assert expected.keys() == got.keys() and expected
        for name, tensor in expected.items():
            torch.testing.assert_close(got[name], tensor, atol=1e-5, rtol=1e-5, msg=name)
    if out.refinished:  # killed after its last checkpoint, in the final save: the resume trains no step
        assert losses(out.refinished) == pytest.approx(losses(whole), abs=1e-5)
        assert final_weights(out.refinished).keys() == final_weights(whole).keys()
    moved = resumed[-1]
    if recipe in ("single-gpu-lora", "qlora"):  # a checkpoint keeps the adapters, not the base again
        assert all("lora_" in name for name in load_file(moved / "checkpoints" / "step-6" / "model.safetensors"))
        assert_merged_equals_adapter(moved, out.export)
    elif recipe == "fsdp-lora":  # FSDP saves what trains: no checkpoint or final save gathers the frozen base
        model_file = moved / "checkpoints" / "step-6" / "pytorch_model_fsdp.bin"
        state = torch.load(model_file, weights_only=True)
        assert state and all("lora_" in name for name in state)
        params = json.loads((moved / "report.json").read_text())["setup"]["params"]
        for saved in (model_file, moved / "final" / "adapter_model.safetensors"):
            assert saved.stat().st_size < 4 * params / 4  # the adapters (~15% of the parameters), not the model
        assert_merged_equals_adapter(moved, out.export)  # and they are the trained ones (step-6's)
    else:  # the last checkpoint (a ZeRO checkpoint, FSDP's state dict) exports to the final weights
        assert_checkpoint_exports_final(moved, out.export)


def export(run, output, *flags):
    """`memrecipe export RUN OUTPUT FLAGS...` from outside (the CLI's own path, DeepSpeed named before it is
    imported): (the CompletedProcess, OUTPUT)."""
    done = subprocess.run([sys.executable, "-m", "memrecipe", "export", str(run), str(output), *flags],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    return done, output


def export_here(run, output, **how):
    """The same export in this process (no new process proves more for the weights it writes): as `export`."""
    from memrecipe.export import export as export_run

    export_run(run, output, **how)
    return SimpleNamespace(returncode=0, stderr=""), output


def assert_checkpoint_exports_final(run, exported):
    done, output = exported
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Setting accelerator to CPU" not in done.stderr  # DeepSpeed's CPU accelerator is named, not guessed
    exported, final = load_file(output / "model.safetensors"), load_file(run / "final" / "model.safetensors")
    assert exported.keys() == final.keys()
    for name, tensor in final.items():
        torch.testing.assert_close(exported[name], tensor.float(), atol=0, rtol=0, msg=name)


def assert_merged_equals_adapter(run, exported):
    """--merge folds the adapter (final/, or a checkpoint's) into the base: the merged model's logits
    equal the final adapter model's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    done, output = exported
    assert done.returncode == 0, done.stderr[-2000:]
    base = json.loads((run / "final" / "adapter_config.json").read_text())["base_model_name_or_path"]
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), run / "final")
    merged = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32)
    ids = torch.randint(0, merged.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapter.eval()(ids).logits, atol=1e-5, rtol=1e-5)
    assert not any("lora" in name for name, _ in merged.named_parameters())


SIGNALS = [("single-gpu-lora", 1, signal.SIGINT), ("fsdp", 2, signal.SIGTERM)]


def stopped_by_a_signal(folder, recipe, sig, core):
    proc = start(["--recipe", recipe, "max_steps=500", "eval_steps=null"], folder, core if recipe in ONE_PROCESS else None)
    wait_for(lambda: "step 10/500" in (folder / "train.log").read_text() if (folder / "train.log").exists()
             else False, proc)
    proc.send_signal(sig)  # to the launcher alone (a scheduler's SIGTERM; Ctrl-C's SIGINT)
    return proc.wait(timeout=120), folder


@pytest.mark.parametrize("recipe, processes, sig", SIGNALS)
def test_a_signal_checkpoints_and_names_the_resume_command(runs, recipe, processes, sig):
    status, folder = runs(f"signal/{recipe}")
    assert status == 128 + sig
    log = open(f"{folder}.log").read()
    assert f"resume with: memrecipe run sft --resume --output-dir {folder}" in log
    (checkpoint,) = (folder / "checkpoints").glob("step-*")
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["step"] >= 10 and state["num_processes"] == processes
    assert f"stopped by {sig.name} at step {state['step']}" in (folder / "train.log").read_text()
    assert not (folder / ".lock").exists()
    assert "Traceback" not in log and "Traceback" not in (folder / "train.log").read_text()  # the launchers' own


def resumed_with_changes(folder, core):
    """A 2-step FSDP2 run, then --resume with changes it refuses, then one to 4 steps; its last checkpoint exported."""
    finish(start(["--recipe", "fsdp", "max_steps=2", "save_steps=1", "save_total_limit=10"], folder))
    refused = [refusal(folder, ["learning_rate=1e-2"]), refusal(folder, ["fsdp.activation_checkpointing=false"]),
               refusal(folder, [], num_processes=1)]
    longer = run_cli("run", "sft", "--resume", "--output-dir", str(folder), "max_steps=4", "save_steps=1",
                     "save_total_limit=10", timeout=600, preexec_fn=pin(None))  # (unchanged keys are fine)
    return folder, refused, longer, longer.returncode == 0 and export_here(folder, folder.parent / "keeps-exported",
                                                                   checkpoint="step-4")


def refusal(folder, words, **topology) -> str:
    """What `memrecipe run sft --resume --output-dir FOLDER WORDS` refuses, asked in this process (the refusal is
    made before anything launches: its one line through the CLI is test_run's)."""
    from memrecipe.errors import RecipeError
    from memrecipe.launching.runner import plan_run

    with pytest.raises(RecipeError) as refused:
        plan_run("sft", None, words, folder, {"cpu": True, **topology}, resume=True)
    return str(refused.value)


def test_resume_keeps_the_recipe_and_the_process_count(runs):
    folder, (changed, activation, fewer), longer, exported = runs("keeps")
    assert "learning_rate cannot change on --resume" in changed
    assert "fsdp.activation_checkpointing cannot change on --resume" in activation
    assert "trained by 2 processes: resume it with --num-processes 2" in fewer
    assert longer.returncode == 0, longer.stderr[-2000:]
    assert len(losses(folder)) == 4 and "max_steps: 4" in (folder / "recipe.yaml").read_text()
    assert "resumed from checkpoints/step-2 at step 2" in (folder / "train.log").read_text()  # the end was saved too
    # The 2-step cosine ended at 0, the rate FSDP2's optimizer saved for step 3: the rebuilt 4-step schedule's
    # rate must be the one step 3 trains with, so the weights move from step 2 to step 3 as much as the next step.
    weights = [torch.load(folder / "checkpoints" / f"step-{n}" / "pytorch_model_fsdp.bin", weights_only=True)
               for n in (2, 3, 4)]
    moved = [max((b[k].float() - a[k].float()).abs().max().item() for k in a) for a, b in zip(weights, weights[1:])]
    assert moved[0] > 0.5 * moved[1] > 0, moved
    assert losses(folder, "lr")[2] > 0  # the rate the optimizer held for step 3
    assert_checkpoint_exports_final(folder, exported)  # FSDP's full state dict


def a_locked_folder(folder, core):
    """A second run and a resume asked for while a run trains in the folder; then the run is killed."""
    proc = start(["--recipe", "single-gpu-lora", "max_steps=500", "eval_steps=null"], folder, core)
    wait_for(lambda: (folder / ".lock").exists() and (folder / "train.log").exists(), proc)
    second = run_cli("run", "sft", "--recipe", "single-gpu-lora", "--output-dir", str(folder), "--overwrite")
    resumed = run_cli("run", "sft", "--resume", "--output-dir", str(folder))  # not "no complete checkpoint"
    signal_tree(proc, signal.SIGKILL)
    proc.wait()
    return proc.pid, second, resumed


def test_a_running_folder_is_locked(runs):
    pid, second, resumed = runs("locked")
    assert second.returncode == 2 and f"in use by process {pid}" in second.stderr
    assert resumed.returncode == 2 and f"in use by process {pid}" in resumed.stderr


def a_non_finite_loss(base, core):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memrecipe.training.loading import embedded_model

    base.mkdir()
    poisoned = base / "poisoned-model"  # one NaN weight: the very first loss is NaN
    model = AutoModelForCausalLM.from_pretrained(embedded_model())
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    model.save_pretrained(poisoned)
    AutoTokenizer.from_pretrained(embedded_model()).save_pretrained(poisoned)
    folder = base / "run"
    proc = start(["--recipe", "adamw-8bit", "--num-processes", "1", "--model", str(poisoned), "save_steps=1",
                  "max_steps=5", "max_seq_length=256"], folder, core)  # (a real model's rows would hold the set in 2)
    return proc.wait(timeout=600), folder


def test_a_non_finite_loss_stops_in_one_line_naming_the_step(runs):
    status, folder = runs("nan")
    assert status != 0
    log = open(f"{folder}.log").read()
    assert "memrecipe: error: the loss is nan at step 1: stopped without saving" in log
    assert not list((folder / "checkpoints").glob("step-*")) if (folder / "checkpoints").exists() else True
    assert not (folder / "final").exists()


def test_a_checkpoint_that_lost_a_file_or_a_hand_edited_recipe_is_named_before_a_resume(runs, tmp_path):
    """A copy of the uninterrupted single-gpu-lora run (checkpoints step-4 and step-6, each listing its files as
    written): with a file of step-6 gone, `--resume` names it and the newest whole checkpoint; with a file cut short,
    the same; with recipe.yaml's lora.r edited by hand, it names the key the checkpoint cannot load. Each is one
    line, exit 2, and the folder's files are as they were."""
    import hashlib

    folder = tmp_path / "run"
    shutil.copytree(runs("single-gpu-lora/whole"), folder)
    listed = json.loads((folder / "checkpoints" / "step-6" / "trainer_state.json").read_text())["files"]
    assert "model.safetensors" in listed and listed["model.safetensors"] > 0

    def sums():
        return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}

    weights = folder / "checkpoints" / "step-6" / "model.safetensors"
    kept = weights.read_bytes()
    recipe = (folder / "recipe.yaml").read_text()
    for damage, says in ((lambda: weights.unlink(), "step-6/model.safetensors is missing or cut short; the newest whole "
                                                     f"checkpoint is step-4: move {folder}/checkpoints/step-6 out"),
                         (lambda: weights.write_bytes(kept[:100]), "step-6/model.safetensors is missing or cut short"),
                         (lambda: (folder / "recipe.yaml").write_text(recipe.replace("  r: 16", "  r: 8")),
                          "recipe.yaml says lora.r: 8, and step-6 was trained with 16: its weights cannot load")):
        damage()
        before = sums()
        done = run_cli("run", "sft", "--resume", "--output-dir", str(folder), "max_steps=8")
        assert done.returncode == 2 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert sums() == before
        weights.write_bytes(kept)
        (folder / "recipe.yaml").write_text(recipe)
