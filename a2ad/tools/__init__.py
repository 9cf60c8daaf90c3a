"""Tools: the `a2ad` entry point (serve, demo), `a2ad-ctl`, and the shared daemon launcher."""
