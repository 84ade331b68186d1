"""The Textual operations dashboard (``btbctl tui``). Talks to the engine only through its public facades."""
