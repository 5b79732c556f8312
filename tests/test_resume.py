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

import pytest
import torch
from safetensors.torch import load_file

from helpers import REPO, child_env, finish, free_port, pin, signal_tree, start, stop_at_a_checkpoint, wait_for

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
@pytest.mark.parametrize("recipe, launched_by, mode, words", [
    ("single-gpu-lora", "accelerate", "kill", ["per_device_train_batch_size=16"]),
    ("fsdp", "accelerate", "kill", []),
    ("fsdp-lora", "memrecipe", "kill", []),
    ("zero3-offload", "memrecipe", "extend", []),
    ("qlora", "memrecipe", "extend", []),
    ("adamw-8bit", "memrecipe", "extend", []),
    ("single-gpu-full", "memrecipe", "extend", [])])
def test_killed_and_resumed_equals_uninterrupted(tmp_path, cli, recipe, launched_by, mode, words):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    one = recipe in ("single-gpu-lora", "qlora", "single-gpu-full")  # 1-process recipes: each run pinned to a core
    launch = (lambda folder, *extra, core: plain_launch(recipe, folder, *words, *extra, core=core if one else None)) \
        if launched_by == "accelerate" else (lambda folder, *extra, core: start(
            ["--recipe", recipe, *EXACT, *words, *extra], folder, core if one else None))  # (a shipped config's precision wins)
    uninterrupted = launch(whole, core=0)  # beside the cut run
    if mode == "kill":
        resumed_at = stop_at_a_checkpoint(launch(cut, core=1), cut)
        assert resumed_at < 6 and not (cut / "final").exists()
        finish(uninterrupted)
    else:
        finish(uninterrupted, launch(cut, "max_steps=2", core=1))
        resumed_at = 2
    assert {"recipe.yaml", "accelerate_config.yaml"} <= {p.name for p in cut.iterdir()}  # however it was launched
    partial = cut / "checkpoints" / ".tmp-step-5"  # a save cut off by a kill: never taken for a checkpoint
    partial.mkdir(exist_ok=True)
    (partial / "model.safetensors").write_bytes(b"cut off mid-write")
    resumed = [tmp_path / "moved"]
    if launched_by == "accelerate":  # a copy resumes through its own launch line
        resumed.append(tmp_path / "twin")
        subprocess.run(["cp", "-r", str(cut), str(resumed[1])], check=True)
    cut.rename(resumed[0])  # a moved run folder still resumes
    runs = [start(["--resume", "max_steps=6"], resumed[0], 0 if one else None)]
    if launched_by == "accelerate":
        runs.append(launch(resumed[1], "--resume", core=1))
    finish(*runs)
    if launched_by == "accelerate":
        assert cli("report", str(resumed[1])).returncode == 0
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
    if recipe == "single-gpu-lora":  # killed after its last checkpoint, in the final save: the resume trains no step
        shutil.rmtree(resumed[0] / "final")
        (resumed[0] / "report.json").unlink()
        finish(start(["--resume"], resumed[0], 0))
        assert losses(resumed[0]) == pytest.approx(losses(whole), abs=1e-5)
        assert final_weights(resumed[0]).keys() == final_weights(whole).keys()
    moved = resumed[-1]  # the export checks: on the folder resumed by its own launch line when there is one
    if recipe in ("single-gpu-lora", "qlora"):  # a checkpoint keeps the adapters, not the base again
        assert all("lora_" in name for name in load_file(moved / "checkpoints" / "step-6" / "model.safetensors"))
        assert_merged_equals_adapter(moved, tmp_path / "merged")
    elif recipe == "fsdp-lora":  # FSDP saves what trains: no checkpoint or final save gathers the frozen base
        model_file = moved / "checkpoints" / "step-6" / "pytorch_model_fsdp.bin"
        state = torch.load(model_file, weights_only=True)
        assert state and all("lora_" in name for name in state)
        params = json.loads((moved / "report.json").read_text())["setup"]["params"]
        for saved in (model_file, moved / "final" / "adapter_model.safetensors"):
            assert saved.stat().st_size < 4 * params / 4  # the adapters (~15% of the parameters), not the model
        assert_merged_equals_adapter(moved, tmp_path / "merged", checkpoint="step-6")  # and they are the trained ones
    else:  # the last checkpoint (a ZeRO checkpoint, FSDP's state dict) exports to the final weights
        assert_checkpoint_exports_final(moved, "step-6", tmp_path / "exported")


def assert_checkpoint_exports_final(run, checkpoint, output):
    done = subprocess.run([sys.executable, "-m", "memrecipe", "export", str(run), str(output), "--checkpoint",
                           checkpoint], env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Setting accelerator to CPU" not in done.stderr  # DeepSpeed's CPU accelerator is named, not guessed
    exported, final = load_file(output / "model.safetensors"), load_file(run / "final" / "model.safetensors")
    assert exported.keys() == final.keys()
    for name, tensor in final.items():
        torch.testing.assert_close(exported[name], tensor.float(), atol=0, rtol=0, msg=name)


def assert_merged_equals_adapter(run, output, checkpoint=None):
    """--merge folds the adapter (final/, or a checkpoint's) into the base: the merged model's logits
    equal the final adapter model's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    pick = ["--checkpoint", checkpoint] if checkpoint else []
    done = subprocess.run([sys.executable, "-m", "memrecipe", "export", str(run), str(output), "--merge", *pick],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    base = json.loads((run / "final" / "adapter_config.json").read_text())["base_model_name_or_path"]
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), run / "final")
    merged = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32)
    ids = torch.randint(0, merged.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapter.eval()(ids).logits, atol=1e-5, rtol=1e-5)
    assert not any("lora" in name for name, _ in merged.named_parameters())


@pytest.mark.parametrize("recipe, processes, sig", [("single-gpu-lora", 1, signal.SIGINT),
                                                     ("fsdp", 2, signal.SIGTERM)])
def test_a_signal_checkpoints_and_names_the_resume_command(tmp_path, recipe, processes, sig):
    folder = tmp_path / "run"
    proc = start(["--recipe", recipe, "max_steps=500", "eval_steps=null"], folder)
    wait_for(lambda: "step 10/500" in (folder / "train.log").read_text() if (folder / "train.log").exists()
             else False, proc)
    proc.send_signal(sig)  # to the launcher alone (a scheduler's SIGTERM; Ctrl-C's SIGINT)
    assert proc.wait(timeout=120) == 128 + sig
    log = open(f"{folder}.log").read()
    assert f"resume with: memrecipe run sft --resume --output-dir {folder}" in log
    (checkpoint,) = (folder / "checkpoints").glob("step-*")
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["step"] >= 10 and state["num_processes"] == processes
    assert f"stopped by {sig.name} at step {state['step']}" in (folder / "train.log").read_text()
    assert not (folder / ".lock").exists()
    assert "Traceback" not in log and "Traceback" not in (folder / "train.log").read_text()  # the launchers' own


def test_resume_keeps_the_recipe_and_the_process_count(tmp_path, cli):
    folder = tmp_path / "run"
    finish(start(["--recipe", "fsdp", "max_steps=2", "save_steps=1", "save_total_limit=10"], folder))
    changed = cli("run", "sft", "--resume", "--output-dir", str(folder), "learning_rate=1e-2")
    assert changed.returncode == 2 and "learning_rate cannot change on --resume" in changed.stderr
    changed = cli("run", "sft", "--resume", "--output-dir", str(folder), "fsdp.activation_checkpointing=false")
    assert changed.returncode == 2 and "fsdp.activation_checkpointing cannot change on --resume" in changed.stderr
    fewer = cli("run", "sft", "--resume", "--output-dir", str(folder), "--num-processes", "1")
    assert fewer.returncode == 2 and "trained by 2 processes: resume it with --num-processes 2" in fewer.stderr
    longer = cli("run", "sft", "--resume", "--output-dir", str(folder), "max_steps=4", "save_steps=1",  # unchanged
                 "save_total_limit=10", timeout=600)
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
    assert_checkpoint_exports_final(folder, "step-4", tmp_path / "exported")  # FSDP's full state dict


def test_a_running_folder_is_locked(tmp_path, cli):
    folder = tmp_path / "run"
    proc = start(["--recipe", "single-gpu-lora", "max_steps=500", "eval_steps=null"], folder)
    wait_for(lambda: (folder / ".lock").exists() and (folder / "train.log").exists(), proc)
    second = cli("run", "sft", "--recipe", "single-gpu-lora", "--output-dir", str(folder), "--overwrite")
    assert second.returncode == 2 and f"in use by process {proc.pid}" in second.stderr
    resumed = cli("run", "sft", "--resume", "--output-dir", str(folder))  # not "no complete checkpoint"
    assert resumed.returncode == 2 and f"in use by process {proc.pid}" in resumed.stderr
    signal_tree(proc, signal.SIGKILL)
    proc.wait()


def test_a_non_finite_loss_stops_in_one_line_naming_the_step(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memrecipe.training.modeling import embedded_model

    poisoned = tmp_path / "poisoned-model"  # one NaN weight: the very first loss is NaN
    model = AutoModelForCausalLM.from_pretrained(embedded_model())
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    model.save_pretrained(poisoned)
    AutoTokenizer.from_pretrained(embedded_model()).save_pretrained(poisoned)
    folder = tmp_path / "run"
    proc = start(["--recipe", "adamw-8bit", "--num-processes", "1", "--model", str(poisoned), "save_steps=1",
                  "max_steps=5"], folder)
    assert proc.wait(timeout=600) != 0
    log = open(f"{folder}.log").read()
    assert "memrecipe: error: the loss is nan at step 1: stopped without saving" in log
    assert not list((folder / "checkpoints").glob("step-*")) if (folder / "checkpoints").exists() else True
    assert not (folder / "final").exists()
