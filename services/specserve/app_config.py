"""The Serve application's configuration: the units (:class:`~specserve.config.UnitConfig`)
and what sits in front of them: API keys, per-request limits, routing, autoscaling, drain. Split
from :mod:`specserve.config` (the engine's and a unit's settings), with the same rules: shapes,
bounds and cross-field rules only."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from specserve.config import NodeResource, UnitConfig, _Strict


class AuthConfig(_Strict):
    """API keys, as OpenAI's: ``Authorization: Bearer <key>`` on every ``/v1`` route.

    Keys come from ``api_keys_file`` (default: the file named by ``$SPECSERVE_API_KEYS_FILE``;
    one key per line, ``#`` comments) and from the comma-separated ``$<api_keys_env>``; the
    Helm chart mounts its Secret as that file. The file is re-read when it changes, so keys
    rotate without a restart. Keys are compared in constant time and never logged; logs and
    metrics name a key by the first 8 hex digits of its SHA-256 (``key-1a2b3c4d``).
    """

    enabled: bool = Field(
        True, description="Require a key. Turning it off is explicit, and the server says so at "
                          "start-up (`specserve serve` without --config runs that way, on 127.0.0.1).")
    api_keys_file: str | None = Field(
        None, min_length=1, max_length=4096,
        description="File with one key per line; default: the file named by $SPECSERVE_API_KEYS_FILE.")
    api_keys_env: str = Field(
        "SPECSERVE_API_KEYS", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=128,
        description="Environment variable holding comma-separated keys (read as well as the file).")
    protect_metrics: bool = Field(
        False, description="Require a key on /metrics too (Prometheus then sends it as a bearer "
                           "token). /health is always open.")


class LimitsConfig(_Strict):
    """What one request and one key may take. Every cap answers with an OpenAI-shaped error
    (400, 413 or 429 with ``Retry-After``) before the request reaches a unit. Per-key limits are
    exact because the app runs one ingress replica."""

    requests_per_minute: int | None = Field(
        None, ge=1, le=1_000_000,
        description="Requests per key per minute (a token bucket refilled continuously); "
                    "None: unlimited. With auth off, every client shares the one anonymous key.")
    burst: int | None = Field(
        None, ge=1, le=1_000_000,
        description="Bucket size: requests a key may send at once; default requests_per_minute.")
    max_concurrent_requests: int | None = Field(
        None, ge=1, le=1_000_000,
        description="Generation requests (streamed or not) one key may have in flight; None: "
                    "unlimited (the units' queues still bound the total).")
    max_request_bytes: int = Field(
        1_048_576, ge=1024, le=67_108_864, description="Largest request body (413 beyond).")
    max_prompt_tokens: int | None = Field(
        None, ge=1, le=1_048_576,
        description="Longest prompt in tokens; None: whatever the context length leaves room for.")
    request_timeout_s: float = Field(
        600.0, gt=0, le=86_400,
        description="A request still running after this long is cancelled (its slot freed) and "
                    "ends with a 504 (in-band in a stream).")
    log_request_content: bool = Field(
        False, description="Log prompts and outputs (debugging only). Off: logs carry ids, "
                           "key ids, token counts and timings, never text.")

    @model_validator(mode="after")
    def _burst_needs_a_rate(self) -> LimitsConfig:
        # A bucket size without a refill rate limits nothing: the setting would be silently
        # dead, and whoever wrote it meant a limit.
        if self.burst is not None and self.requests_per_minute is None:
            raise ValueError("limits.burst needs limits.requests_per_minute (the bucket's refill "
                             "rate); set both or neither")
        return self


class RoutingConfig(_Strict):
    """Which unit a request goes to (``serve/request_router.py``)."""

    prefix_affinity: bool = Field(
        True, description="With kv_cache.layout paged and prefix_caching: send a request to the "
                          "unit that was sent the longest prefix of its prompt (a "
                          "conversation's later turns to the unit that holds its earlier ones), "
                          "unless that unit is busier than the least-loaded one by more than "
                          "max_imbalance. Off: always the least-loaded unit.")
    max_imbalance: int = Field(
        4, ge=0, le=100_000,
        description="Requests in flight by which the unit holding a prefix may exceed the "
                    "least-loaded unit and still get it: a hot prefix spreads beyond this.")


class UnitAutoscalingConfig(_Strict):
    """Units that follow the traffic (``serve/autoscaling.py`` states the rule)."""

    policy: Literal["speculation", "requests"] = Field(
        "speculation",
        description="speculation: scale on what the units report (KV blocks in use, sequences "
                    "running and queued, and what speculation buys at that load); requests: "
                    "Ray Serve's own policy, ongoing requests per unit (target_ongoing_requests "
                    "= max_num_seqs x target_utilization), for comparison.")
    min_units: int = Field(1, ge=1, le=1024, description="Fewest units (never zero: a unit "
                                                          "loads its models for minutes).")
    max_units: int = Field(2, ge=1, le=1024, description="Most units; the cluster must hold them "
                                                          "(specserve preflight counts).")
    target_utilization: float = Field(
        0.7, gt=0.05, le=1.0,
        description="The load each unit is held at: its fuller resource (KV pool or slots, "
                    "priced at speculation's cost) as a share.")
    hysteresis: float = Field(
        0.2, ge=0, le=0.9,
        description="Fewer units only where they would run below target_utilization x "
                    "(1 - hysteresis): a noisy signal does not flap.")
    upscale_delay_s: float = Field(10.0, ge=0, le=3600,
                                   description="How long more units must be wanted before they start.")
    downscale_delay_s: float = Field(60.0, ge=0, le=86_400,
                                     description="How long fewer units must be wanted before one drains.")
    look_back_s: float = Field(10.0, gt=0, le=3600,
                               description="The window Serve averages the units' signals over.")
    metrics_interval_s: float = Field(2.0, gt=0, le=600,
                                      description="How often each unit reports its signals.")

    @model_validator(mode="after")
    def _bounds(self) -> UnitAutoscalingConfig:
        if self.min_units > self.max_units:
            raise ValueError(f"autoscaling.min_units {self.min_units} exceeds max_units {self.max_units}")
        return self


class DirectHTTPConfig(_Strict):
    """Where the ingress replica serves the API itself (``AppConfig.direct_http``)."""

    host: str = Field("127.0.0.1", min_length=1, max_length=255,
                      description="The address its server listens on.")
    port: int = Field(ge=1, le=65535, description="Its port.")


class AppConfig(_Strict):
    """The Serve application: an OpenAI-compatible ingress in front of N units."""

    unit: UnitConfig = Field(default_factory=UnitConfig, description="What every unit runs.")
    num_units: int = Field(
        1, ge=1, le=1024,
        description="Unit replicas (each a whole placement group); with autoscaling, the units "
                    "it starts with.")
    autoscaling: UnitAutoscalingConfig | None = Field(
        None, description="Scale the units with the traffic between min_units and max_units; "
                          "null: num_units, fixed.")
    routing: RoutingConfig = Field(default_factory=RoutingConfig,
                                   description="Which unit a request goes to.")
    served_model_name: str | None = Field(
        None, min_length=1, max_length=256,
        description="The model id clients send; default the target's name.")
    max_tokens_cap: int = Field(
        4096, ge=1, le=1_048_576, description="Largest max_tokens a request may ask for.")
    route_prefix: str = Field("/", pattern=r"^/", description="HTTP prefix of the API.")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="API keys.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig,
                                 description="Per-request caps and per-key limits.")
    drain_timeout_s: float = Field(
        30.0, ge=0, le=3600,
        description="On shutdown or redeploy, how long a replica keeps serving the requests it "
                    "already has (new ones go elsewhere or get 503) before it is stopped.")
    ingress_node_resource: NodeResource | None = Field(
        None,
        description="A custom Ray resource the node for the API ingress advertises (the Helm "
                    "chart's head group, beside the HTTP proxy). None: any node.")
    unit_in_ingress: bool | None = Field(
        None,
        description="Run the one unit in the ingress replica's process: a token goes from the "
                    "engine to the HTTP proxy's stream with no Ray message between two replicas. "
                    "It needs one unit (num_units 1, no autoscaling) whose target runs in the "
                    "unit (tensor_parallel_size 1, accelerator cpu) and no "
                    "ingress_node_resource. None: wherever that holds.")
    direct_http: DirectHTTPConfig | None = Field(
        None,
        description="With the unit in the ingress: the ingress replica also serves the API on "
                    "this address itself, so a token goes from the engine to the client's "
                    "socket without the hop through Serve's proxy (which keeps serving on its "
                    "own port). specserve serve sets it to --host and --port and moves the "
                    "proxy to a free loopback port. None: the proxy only.")

    @model_validator(mode="after")
    def _starts_within_bounds(self) -> AppConfig:
        scaling = self.autoscaling
        if scaling is not None and not scaling.min_units <= self.num_units <= scaling.max_units:
            raise ValueError(f"num_units {self.num_units} (the units a deployment starts with) is "
                             f"outside autoscaling's {scaling.min_units}..{scaling.max_units}")
        if self.unit_in_ingress and not self._one_unit_here():
            raise ValueError("unit_in_ingress runs the one unit in the ingress's process: it needs "
                             "num_units 1, no autoscaling, no ingress_node_resource, and a target "
                             "in the unit (tensor_parallel_size 1, accelerator cpu)")
        if self.direct_http is not None and not self.unit_here:
            raise ValueError("direct_http is the ingress replica's own server, for the unit it "
                             "runs: it needs the unit in the ingress (unit_in_ingress)")
        return self

    def _one_unit_here(self) -> bool:
        return (self.num_units == 1 and self.autoscaling is None and self.unit.target_here
                and self.ingress_node_resource is None)

    @property
    def unit_here(self) -> bool:
        """The unit runs in the ingress's process (``unit_in_ingress``, or its default)."""
        return self._one_unit_here() if self.unit_in_ingress is None else self.unit_in_ingress
