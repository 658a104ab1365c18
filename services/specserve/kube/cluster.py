"""The thin layer between the checks and a cluster: an API client from a kubeconfig (or the
pod's service account), and the lists the checks read, as the client's model objects.

Read-only: it lists nodes, CustomResourceDefinitions and StorageClasses (cluster-scoped) and
reads the secrets the values name (in the release's namespace); the Helm hook's Role grants
exactly that (``helm/specserve/templates/preflight.yaml``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from specserve.errors import ConfigError

T = TypeVar("T")


@dataclass
class ClusterView:
    """What the preflight reads of a cluster."""

    nodes: list = field(default_factory=list)             # V1Node
    crds: list = field(default_factory=list)              # V1CustomResourceDefinition
    storage_classes: list = field(default_factory=list)   # V1StorageClass
    secrets: dict = field(default_factory=dict)           # name -> V1Secret, None where absent


def connect(*, kubeconfig: str | None = None, context: str | None = None,
            in_cluster: bool = False) -> client.ApiClient:
    """An API client: the pod's service account (``in_cluster``), else the kubeconfig
    (``$KUBECONFIG`` or ``~/.kube/config``) and its current or named context."""
    try:
        if in_cluster:
            config.load_incluster_config()
            return client.ApiClient()
        return config.new_client_from_config(config_file=kubeconfig, context=context)
    except (ConfigException, OSError) as exc:
        where = "the pod's service account" if in_cluster else (kubeconfig or "the kubeconfig")
        raise ConfigError(f"cannot reach a cluster through {where}: {exc}") from None


def read_cluster(api: client.ApiClient, namespace: str, secret_names: list[str]) -> ClusterView:
    """Everything the checks read; an API error (unreachable, forbidden) is one line."""
    core = client.CoreV1Api(api)
    with one_line_errors():
        return ClusterView(
            nodes=core.list_node().items,
            crds=client.ApiextensionsV1Api(api).list_custom_resource_definition().items,
            storage_classes=client.StorageV1Api(api).list_storage_class().items,
            secrets={name: or_none(lambda name=name: core.read_namespaced_secret(name, namespace))
                     for name in dict.fromkeys(secret_names)})


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """The API's refusals and an unreachable API as one line each (a ``ConfigError``)."""
    try:
        yield
    except ApiException as exc:
        raise ConfigError(f"the Kubernetes API answered {exc.status} {exc.reason} "
                          f"({api_message(exc)})") from None
    except (OSError, urllib3.exceptions.HTTPError) as exc:  # refused, timed out, DNS
        raise ConfigError(f"cannot reach the Kubernetes API: {exc}") from None


def or_none(read: Callable[[], T]) -> T | None:
    """``read()``, or None where the API says 404 (the object does not exist)."""
    try:
        return read()
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def api_message(exc: ApiException) -> str:
    """The API's own message (a Status object's ``message``), else its reason."""
    try:
        return json.loads(exc.body or "{}").get("message") or exc.reason
    except (ValueError, AttributeError):
        return str(exc.reason)
