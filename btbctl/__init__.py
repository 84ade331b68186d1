"""btbctl: burst-aware LLM serving with Biting-the-Bullet (BTB) predictive KV-cache replication.

The package is layered: ``btbctl.engine`` holds everything that works without a screen (traces, cost model,
detector, routing policies, simulator, ...); ``btbctl.commands`` is the Typer CLI and ``btbctl.tui`` the Textual
dashboard. The engine never imports the other two.
"""

__version__ = "0.1.0"
