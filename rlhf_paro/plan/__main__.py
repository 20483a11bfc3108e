"""``python -m rlhf_paro.plan``: the planner's command line (``command.main``)."""

from rlhf_paro import cli
from rlhf_paro.plan.command import main

cli.exit_when_done(main)
