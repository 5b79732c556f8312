"""checkpoint.py: how several machines share (or not) the run folder. Resume and kill tests: test_resume.py."""

import json
import subprocess
import sys

import pytest

from helpers import REPO, child_env, free_port
from memrecipe.training.checkpoint import sharing_verdict
from memrecipe.errors import RecipeError


def test_machines_share_the_run_folder_all_or_each_their_own():
    both = frozenset({0, 2})
    assert sharing_verdict([(0, frozenset({0})), (0, frozenset({0}))], "runs/x") == (1, True)  # one machine, 2 ranks
    assert sharing_verdict([(0, both), (0, both), (2, both)], "runs/x") == (2, True)  # a shared filesystem
    assert sharing_verdict([(0, frozenset({0})), (2, frozenset({2})), (4, frozenset({4}))], "runs/x") == (3, False)
    with pytest.raises(RecipeError, match=r"first ranks \[2, 4\] share one.*give all machines one shared folder"):
        sharing_verdict([(0, frozenset({0})), (2, frozenset({2, 4})), (4, frozenset({2, 4}))], "runs/x")
    with pytest.raises(RecipeError, match=r"first ranks \[0, 2\] share one; 4 has its own"):
        sharing_verdict([(0, both), (2, both), (4, frozenset({4}))], "runs/x")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("folders, expected", [
    ("ABC", {"machines": 3, "shared": False}),  # node-local disks: a folder each
    ("ABB", "first ranks [1, 2] share one"),  # machines 1 and 2 share a folder that machine 0 does not see
], ids=["a-folder-each", "two-of-three-share"])
def test_folder_sharing_on_three_machines_on_one_box(tmp_path, folders, expected):
    """folder_sharing itself, in a gloo world of three one-process "machines": every machine's answer."""
    from runs.test_multinode import wait_for_port

    port = free_port()

    def machine(rank):
        line = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "3",
                "--num_processes", "3", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
                "--main_process_port", str(port), "--same_network", str(REPO / "tests" / "workers" / "folder_sharing.py"),
                str(tmp_path / folders[rank]), str(tmp_path / f"result{rank}.json")]
        return subprocess.Popen(line, env=child_env(ACCELERATE_USE_CPU="true"), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    first = machine(0)
    wait_for_port(port, first)
    others = [machine(1), machine(2)]
    for proc in (first, *others):
        out, _ = proc.communicate(timeout=200)
        assert proc.returncode == 0, out[-3000:]
    answers = [json.loads((tmp_path / f"result{rank}.json").read_text()) for rank in range(3)]
    for answer in answers:
        if isinstance(expected, dict):
            assert answer == expected
        else:
            assert expected in answer["error"] and "give all machines one shared folder" in answer["error"]
    assert not [p for p in tmp_path.rglob(".probe-*")]  # every machine took its probe away
