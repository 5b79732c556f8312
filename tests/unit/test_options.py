"""options.py: the flags several commands share are one definition, so they are spelled and documented alike."""

import click
import pytest

from memrecipe.commands import config, plan, run, slurm
from memrecipe.options import topology_options

TOPOLOGY = ["num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port", "cpu"]


def described(command) -> dict:
    return {p.name: (p.opts, getattr(p, "help", None), p.default) for p in command.params}


@pytest.mark.parametrize("command", [run.command, config.command], ids=["run", "config"])
def test_the_commands_that_place_processes_take_the_same_topology_flags(command):
    bare = topology_options(click.command()(lambda **kw: None))
    assert {name: described(command)[name] for name in TOPOLOGY} == described(bare)


@pytest.mark.parametrize("command", [run.command, config.command, plan.command, slurm.command],
                         ids=["run", "config", "plan", "slurm"])
def test_overrides_are_read_alike_by_every_command_that_takes_a_recipe(command):
    overrides = [p for p in command.params if p.name == "overrides"]
    assert len(overrides) == 1 and (overrides[0].nargs, overrides[0].metavar) == (-1, "[KEY=VALUE]...")
