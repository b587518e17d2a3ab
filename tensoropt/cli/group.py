"""The ``tensoropt`` click group and its commands.

User errors (``TensorOptError``) become one line on stderr and exit status 1; nothing else is
caught, so a real bug still shows its traceback.
"""

from __future__ import annotations

import click

from ..errors import TensorOptError
from . import INTERRUPTED_STATUS


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except TensorOptError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(INTERRUPTED_STATUS)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tensoropt")
def cli() -> None:
    """TensorOpt: find the Pareto frontier of parallel training plans (time vs memory per device)
    and launch the one that fits your devices."""


def _register() -> None:
    from .estimate_cmd import estimate
    from .frontier_cmd import frontier
    from .inspect_cmd import inspect
    from .profile_cmd import profile
    from .show_cmd import show
    for command in (inspect, frontier, estimate, show, profile):
        cli.add_command(command)
    # the launcher sits on top of the library; the CLI is the one place that joins them
    from launcher.cli import launch
    cli.add_command(launch)


_register()
