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
