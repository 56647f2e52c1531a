"""Sub-command modules of `threed` that need several layers of the house (each defines `register(subparsers)`
and sets `run` on its parsers; threed.cli collects them). `convert`: convert / export / reshard / verify /
make-tiny-hf.
"""
