"""The gateway's control API as its clients see it: the schema of every request, answer and event
(:mod:`~btbctl.engine.control.schema`). The server side is :mod:`btbctl.engine.gateway.control_api`.
"""
