"""The `tokenmill` commands, one module per group (service/cli.py parses and dispatches)."""
