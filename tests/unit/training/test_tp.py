"""The tp recipe: accelerate refuses tensor parallelism on CPU, so what can run here does: the
generated config through accelerate's launcher, the planner's division by tp_size, and the
recipe's own model loading split by transformers' tensor-parallel plan over the "tp" dimension of a
2 x 2 mesh on 4 gloo ranks (a run's real shape: TP within FSDP2's data-parallel shards), with
accelerate's data sharding over that mesh and the loop's token count (each TP group's batch once)."""

import json
import sys

import pytest

from helpers import REPO, child_env, free_port
from memrecipe.planning.architecture import read_config, structure
from memrecipe.planning.configs import generate
from memrecipe.planning.planner import estimate
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.topology import Topology, check_supported


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp2_by_dp2_on_four_ranks_forward_backward_equals_the_whole_model(tmp_path):
    import subprocess

    out = tmp_path / "tp.json"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port",
                           str(free_port()), str(REPO / "tests" / "workers" / "tp_forward_backward.py"), str(out)],
                          env=child_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["losses"]["split"] == pytest.approx(r["losses"]["whole"], abs=1e-5)
    assert r["max_grad_diff"] < 1e-5
    assert r["sharded_tensors"] >= 7 * r["layers"]  # every attention and MLP linear is split
    assert r["local_numel"] < 0.75 * r["numel"]  # each rank holds about half of the layers' weights
    # accelerate gives the two ranks of a TP group one batch; the loop counts each batch once
    assert r["batches"][0] == r["batches"][1] and r["batches"][2] == r["batches"][3] != r["batches"][0]
    assert r["counted_tokens"] == r["distinct_tokens"] > 0


def test_generated_tp_config_passes_accelerates_launcher(tmp_path):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    r = load_recipe("tp")
    (name, text), = generate(r, Topology(8)).items()
    (tmp_path / name).write_text(text)
    args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(
        ["--config_file", str(tmp_path / name), "sft.py"]))
    assert args.use_fsdp and args.fsdp_version == 2 and args.use_parallelism_config
    env = prepare_multi_gpu_env(args)  # what every process of the launch is told
    assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    assert (env["PARALLELISM_CONFIG_TP_SIZE"], env["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == ("2", "4")
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import patch_environment

    with patch_environment(**{k: v for k, v in env.items() if k.startswith("PARALLELISM_CONFIG_")}):
        config = ParallelismConfig()  # what the Accelerator of every process builds from that environment
    assert (config.tp_size, config.dp_shard_size, config.total_size) == (2, 4, 8) and config.tp_enabled


def test_tp_topologies_and_cpu_are_refused_with_the_reason(cli):
    from memrecipe.errors import RecipeError

    r = load_recipe("tp")
    with pytest.raises(RecipeError, match="multiple of 2, at least 4; got 5"):
        check_supported(r, Topology(5))
    with pytest.raises(RecipeError, match="multiple of 4, at least 8; got 4"):  # FSDP would have nothing to shard
        check_supported(load_recipe("tp", ["parallelism.tp_size=4"]), Topology(4))
    check_supported(r, Topology(6))  # 2-way TP x 3 FSDP shards
    done = cli("run", "sft", "--recipe", "tp", "--dry-run")
    assert done.returncode == 2 and "accelerate refuses tensor parallelism (ParallelismConfig) on CPU" in done.stderr
    with pytest.raises(RecipeError, match="FSDP2 only"):
        load_recipe("tp", ["fsdp.version=1"])


def test_planner_divides_layer_activations_and_gathered_weights_by_tp():
    s = structure(read_config(None) | {"num_hidden_layers": 8, "hidden_size": 1024, "intermediate_size": 2816,
                                       "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64})
    topo = Topology(8)
    fsdp = estimate(load_recipe("tp", ["parallelism=null"]), s, topo)
    tp2 = estimate(load_recipe("tp"), s, topo)
    tp4 = estimate(load_recipe("tp", ["parallelism.tp_size=4"]), s, topo)
    assert tp2.optimizer_state == fsdp.optimizer_state  # sharded over all 8 either way
    assert tp2.activations < fsdp.activations and tp4.activations < tp2.activations
    # one layer recomputed at a time: its activations are what TP divides
    from memrecipe.planning.activations import activation_bytes, activation_mode
    full = activation_bytes(load_recipe("tp", ["parallelism=null"]), s, "half", 1, 1024)["layer"]
    assert activation_bytes(load_recipe("tp"), s, "half", 1, 1024)["layer"] == full // 2
    assert tp2.parameters < fsdp.parameters  # the gathered unit is a TP shard
    assert activation_mode(load_recipe("tp"), 2) == "half"
