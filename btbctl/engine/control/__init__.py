"""The gateway's control API as its clients see it: the schema of every request, answer and event
(:mod:`~btbctl.engine.control.schema`), the one client, async and sync (:mod:`~btbctl.engine.control.client`), and
the CLI's operations built on it (:mod:`~btbctl.engine.control.steering`: ``btbctl tune``'s arguments,
``btbctl replicate``'s start-and-wait). The server side is :mod:`btbctl.engine.gateway.control_api`.
"""
