"""The command modules that kvcal/cli.py assembles into the `kvcal` app: one module per area."""
