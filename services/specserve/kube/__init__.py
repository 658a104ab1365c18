"""The deployment on Kubernetes, read through the official ``kubernetes`` client.

- ``needs.py``: what a Helm values file asks of a cluster (pods and their GPUs, CRDs, the
  model cache's StorageClass, the secrets it refers to), from the same pydantic models that
  render the chart;
- ``preflight.py``: whether a cluster can hold that, as pure functions over the client's own
  model objects (``V1Node``, ``V1CustomResourceDefinition``, ...): one finding per line, and
  how many units fit;
- ``cluster.py``: the thin layer that lists those objects from the API server;
- ``status.py``: after the install, what the cluster is doing with a release (the RayService's
  and RayCluster's conditions, the Serve app's health, each unit's pods and why one is not
  ready, the endpoints), from the same kind of objects.
"""
