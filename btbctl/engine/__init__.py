"""The headless engine: traces, cost model, detector, routing policies, replication, simulator, workers, gateway.

Never imports textual, typer or rich (a test checks ``sys.modules`` in a subprocess). Heavy optional modules are
imported inside the functions that need them.
"""
