"""Deployment targets beyond ``btbctl up``: manifests for Kubernetes rendered from a cluster file
(:mod:`btbctl.engine.deploy.kubernetes`), written as YAML by PyYAML
(:func:`~btbctl.engine.deploy.kubernetes.dump_all`)."""
