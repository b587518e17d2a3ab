"""The ``tensoropt`` click group and its commands.

User errors (``TensorOptError``) become one line on stderr and exit status 1, and click's own usage errors
(an unknown option, a value of the wrong type) one line and exit status 2, both written by
``errors.error_line``; nothing else is caught, so a real bug still shows its traceback.
"""

from __future__ import annotations

import sys

import click

from launcher.cli import launch

from ..errors import TensorOptError, error_line
from . import INTERRUPTED_STATUS
from .estimate_cmd import estimate
from .frontier_cmd import frontier
from .inspect_cmd import inspect
from .profile_cmd import profile
from .show_cmd import show


class _Group(click.Group):
    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode: bool = True, **extra):
        """As click's ``main``, but a usage error is one line (click prints the usage, a hint and the error)."""
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.Abort:                     # Ctrl-C while click parses the command line
            click.echo("interrupted", err=True)
            code = INTERRUPTED_STATUS
        except click.exceptions.NoArgsIsHelpError as exc:      # `tensoropt` alone: the help, as click shows it
            exc.show()
            code = exc.exit_code
        except click.ClickException as exc:
            where = getattr(exc, "ctx", None)
            hint = f" (see '{where.command_path} --help')" if where is not None else ""
            click.echo(error_line(exc.format_message() + hint), err=True)
            code = exc.exit_code
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except TensorOptError as exc:
            click.echo(error_line(exc), err=True)
            ctx.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(INTERRUPTED_STATUS)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tensoropt")
def cli() -> None:
    """TensorOpt: find the Pareto frontier of parallel training plans (time vs memory per device)
    and launch the one that fits your devices."""


# the launcher sits on top of the library; the CLI is the one place that joins them (launcher.cli imports no part
# of tensoropt.cli: the options both use are in tensoropt.options)
for _command in (inspect, frontier, estimate, show, profile, launch):
    cli.add_command(_command)
