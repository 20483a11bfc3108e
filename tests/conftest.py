"""What the entry points do before they read a command line, done for every test: ``${demo:NAME}``
in the confs names the demo's assets (``rlhf_paro.cli.register_demo_resolver``)."""

from rlhf_paro.cli import register_demo_resolver

register_demo_resolver()
