"""The front door: the `loraplane` command line (cli.py), the HTTP API (http/) and the router (router/).

May import: engine, spec, adapters, store, executor, kernels, platforms.
"""
