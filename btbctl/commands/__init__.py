"""The Typer CLI: one module per command group; thin (parse, call the engine, print through one output sink)."""
