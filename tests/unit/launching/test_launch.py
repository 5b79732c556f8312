"""launch.py: what `accelerate launch` prints, passed on to the terminal and train.log."""


def test_launch_output_keeps_the_loops_lines_and_drops_the_launchers_tracebacks():
    """After the loop's error line nothing more; after a stop signal no KeyboardInterrupt traceback, but
    any other traceback (a real crash while stopping) still shows; before either, output passes as it comes."""
    from memrecipe.launching.launch import LaunchOutput

    out = LaunchOutput()
    shown, logged = out.feed(b"train: 10%\rtrain: 20%")  # a progress bar redraws in place
    assert shown == b"train: 10%\rtrain: 20%" and logged == []
    out.filtering = True  # Ctrl-C reached the launch
    shown, logged = out.feed(b"\ncheckpoint checkpoints/step-3\nTraceback (most recent call last):\n  File \"a\"\n"
                             b"KeyboardInterrupt\nstopped by SIGINT at step 3\nTraceback (most recent call last):\n"
                             b"  File \"c\"\nsubprocess.CalledProcessError: Command '[sft.py]' returned non-zero exit "
                             b"status 130.\nTraceback (most recent call last):\n"
                             b"  File \"b\"\nRuntimeError: disk full\n")
    assert logged == ["train: 20%", "checkpoint checkpoints/step-3", "stopped by SIGINT at step 3",
                      "Traceback (most recent call last):", '  File "b"', "RuntimeError: disk full"]
    assert shown.startswith(b"\ncheckpoint") and b"KeyboardInterrupt" not in shown  # the bar's text was shown already
    failed = LaunchOutput()
    shown, logged = failed.feed(b"data: train\nmemrecipe: error: the dataset gives 1 micro batch(es)\n"
                                b"memrecipe: error: the dataset gives 1 micro batch(es)\nTraceback (most recent call "
                                b"last):\n  File \"c\"\nsubprocess.CalledProcessError: exit status 2\n")
    assert logged == ["data: train", "memrecipe: error: the dataset gives 1 micro batch(es)"] and failed.finish() == []
    assert failed.error == "memrecipe: error: the dataset gives 1 micro batch(es)"


def test_torchrun_gives_a_stopping_run_time_for_its_step_and_checkpoint(monkeypatch):
    """A stop signal reaches torchrun too, which SIGKILLs the workers 30 s later by default: the launch's environment
    sets the grace torchrun itself reads (its LaunchConfig), and a user's own setting is kept. (CI once lost a
    2-process FSDP run's stop checkpoint to those 30 s; with 1 s the loss is seen on any machine.)"""
    from torch.distributed.launcher.api import LaunchConfig

    from memrecipe.launching.launch import STOP_GRACE, launch
    from memrecipe.planning.registry import load_recipe
    from memrecipe.planning.topology import Topology

    def torchruns_grace():
        _, env = launch("sft", load_recipe("fsdp"), Topology(2, cpu=True), cores=2)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2).shutdown_timeout

    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert torchruns_grace() == STOP_GRACE >= 600  # minutes: a long-context step alone can take them
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "90")
    assert torchruns_grace() == 90
